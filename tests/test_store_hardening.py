"""The store's failure modes, offline and without the registry models: a manifest of the wrong shape, a corrupted
weight file whose size and mtime still match, interrupted pulls, package names that look like pip options."""

from __future__ import annotations

import json

import pytest

from usd import store
from usd.catalog import ModelEntry, PypiSource
from usd.store import MANIFEST

SHA = "0" * 64


def _pypi_entry(name: str = "tiny", package: str = "llm-tiny", version: str = "1.0") -> ModelEntry:
    source = PypiSource(kind="pypi", packages=[{"name": package, "version": version}], files=["tiny.gguf"], sha256=SHA)
    return ModelEntry(name=name, family="test", roles=["drafter"], source=source, context_length=64, license="mit",
                      chat_template=False)  # fmt: skip


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(store.CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


def _fake_pulled(entry: ModelEntry, manifest_text: str):
    """A model directory as a pull leaves it, with `manifest_text` as its manifest."""
    d = store.model_dir(entry)
    d.mkdir(parents=True)
    (d / "config.json").write_text("{}")
    (d / MANIFEST).write_text(manifest_text)
    return d


@pytest.mark.parametrize("manifest", [[], {}, {"files": []}, {"files": {"config.json": "abc"}},
                                      {"files": {"config.json": {"sha256": "x"}}}, "null", 3])  # fmt: skip
def test_manifest_of_the_wrong_shape_counts_as_missing_and_pull_repairs_it(cache, monkeypatch, manifest):
    entry = _pypi_entry()
    text = manifest if isinstance(manifest, str) else json.dumps(manifest)
    d = _fake_pulled(entry, text)
    for source_key in (None, store._source_key(entry)):
        problem = store.verify_dir(d, source_key)
        assert problem is not None and MANIFEST in problem and "malformed" in problem
    assert store.local_path(entry) is None
    refetched = []
    monkeypatch.setattr(store, "_pull_pypi", lambda e, final: refetched.append(e.name))
    store.pull(entry, log=lambda m: None)
    assert refetched == ["tiny"]


# --- package specs on pip's command line -----------------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["--index-url=http://evil.example/simple==1.0", "pkg==--pre", "pkg", "-e==1",
                                  "pkg==1.0 --no-deps"])  # fmt: skip
def test_pip_download_refuses_specs_that_are_not_name_and_version(tmp_path, monkeypatch, spec):
    ran = []
    monkeypatch.setattr(store.subprocess, "run", lambda cmd, **kw: ran.append(cmd))
    with pytest.raises(store.StoreError, match="not a package name and version"):
        store._pip_download([spec], tmp_path)
    assert ran == []


def test_pip_download_puts_specs_after_double_dash(tmp_path, monkeypatch):
    ran = []

    def fake_run(cmd, **kw):
        ran.append(cmd)
        return store.subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(store.subprocess, "run", fake_run)
    store._pip_download(["llm-tiny==1.0"], tmp_path)
    assert ran[0][-2:] == ["--", "llm-tiny==1.0"]
