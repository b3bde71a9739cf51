"""Loading: the real models on CPU, precision choice, the bitsandbytes config, the memory check."""

from __future__ import annotations

import pytest
import torch

from usd import loading
from usd.loading import LoadError, bnb_config, choose_precision, entry_for, load_model, plan_load

# A fixed prompt per model and words a coherent greedy continuation must contain (checked on this machine in fp32).
CONTINUATIONS = {
    "smollm2-135m-instruct": ("The capital of France is", ["Paris"]),
    "qwen2.5-coder-0.5b-instruct": ("def fibonacci(n):", ["if n", "return"]),
    "gemma-3-270m": ("The capital of France is", ["France"]),
}


@pytest.mark.real_models
@pytest.mark.parametrize("name", list(CONTINUATIONS))
def test_real_model_loads_on_cpu_and_continues_coherently(name, catalog, real_paths):
    lm = load_model(catalog.get(name), device="cpu", precision="fp32", log=lambda m: None)
    assert lm.plan.device == "cpu" and lm.plan.precision == "fp32"
    assert next(lm.model.parameters()).dtype == torch.float32
    assert not lm.model.training
    prompt, expected = CONTINUATIONS[name]
    ids = lm.tokenizer(prompt, return_tensors="pt")
    out = lm.model.generate(**ids, max_new_tokens=20, do_sample=False)
    text = lm.tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    for word in expected:
        assert word in text, f"{name}: {text!r}"


def test_nf4_config_has_the_intended_fields(catalog):
    entry = catalog.get("llama-3.1-8b-instruct")
    precision, note = choose_precision(entry, "cuda")
    assert precision == "nf4" and "NF4" in note
    cfg = bnb_config(precision)
    assert cfg.load_in_4bit and not cfg.load_in_8bit
    assert cfg.bnb_4bit_quant_type == "nf4"
    assert cfg.bnb_4bit_compute_dtype == torch.bfloat16
    assert cfg.bnb_4bit_use_double_quant is True


def test_int8_and_unquantized_configs(catalog):
    assert bnb_config("int8").load_in_8bit
    assert bnb_config("bf16") is None
    entry = catalog.get("smollm2-135m-instruct")
    assert choose_precision(entry, "cuda") == ("bf16", "bf16, not quantized.")
    assert choose_precision(entry, "cuda", "int8")[0] == "int8"


def test_cpu_never_quantizes_and_says_why(catalog, monkeypatch):
    entry = catalog.get("llama-3.1-8b-instruct")  # nf4 on CUDA
    monkeypatch.setattr(loading, "cpu_has_bf16", lambda: True)
    precision, note = choose_precision(entry, "cpu")
    assert precision == "bf16" and "No quantization on a CPU" in note
    monkeypatch.setattr(loading, "cpu_has_bf16", lambda: False)
    precision, note = choose_precision(entry, "cpu")
    assert precision == "fp32" and "no native bf16" in note
    with pytest.raises(LoadError, match="needs a CUDA GPU"):
        choose_precision(entry, "cpu", "nf4")


def test_memory_estimate_scales_with_precision(catalog):
    from transformers import AutoConfig

    entry = catalog.get("llama-3.1-8b-instruct")
    # The real Llama-3.1-8B shape, built from its config values (no download).
    cfg = AutoConfig.for_model(
        "llama",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
    )
    linear, other = loading.count_params(cfg)
    assert 7.9e9 < linear + other < 8.1e9
    nf4 = loading.estimate_bytes(entry, "nf4", "cuda", cfg)
    bf16 = loading.estimate_bytes(entry, "bf16", "cuda", cfg)
    assert 4.5 * 2**30 < nf4 < 7 * 2**30  # ~5.5 GiB is what NF4 8B models take in practice
    assert 15 * 2**30 < bf16 < 18 * 2**30
    # without a config, the catalog's parameter count still gives an estimate
    assert 4 * 2**30 < loading.estimate_bytes(entry, "nf4", "cuda") < 7 * 2**30


def test_load_refuses_what_cannot_fit(catalog, real_paths, monkeypatch):
    monkeypatch.setattr(loading, "available_bytes", lambda device: 100 * 2**20)
    with pytest.raises(LoadError, match=r"needs about .* GiB as .* but only 0\.1 GiB is free"):
        load_model(catalog.get("qwen2.5-coder-0.5b-instruct"), device="cpu", log=lambda m: None)
    plan = plan_load(catalog.get("qwen2.5-coder-0.5b-instruct"), "cpu")
    assert not plan.fits


def test_entry_for_specs(catalog, tiny_llama_dir):
    assert entry_for("gemma-3-270m", catalog).source.kind == "pypi"
    local = entry_for(str(tiny_llama_dir), catalog)
    assert local.source.kind == "path" and local.context_length == 512 and local.chat_template
    assert not local.trust_remote_code
    hub = entry_for("someone/some-model", catalog)
    assert hub.source.kind == "hub" and hub.source.repo == "someone/some-model"
    with pytest.raises(LoadError, match="not a catalog model, an existing path, or a hub repo id"):
        entry_for("no such thing", catalog)
    with pytest.raises(LoadError, match="only catalog models are allowed"):
        entry_for(str(tiny_llama_dir), catalog, allow_unlisted=False)


def test_local_directory_loads_through_the_same_code(catalog, tiny_llama_dir):
    lm = load_model(str(tiny_llama_dir), device="cpu", precision="fp32", catalog=catalog, log=lambda m: None)
    assert lm.model.config.hidden_size == 64
    assert lm.tokenizer.eos_token == "<|im_end|>"


@pytest.fixture(scope="module")
def tiny_mamba_dir(tmp_path_factory):
    """A random MambaForCausalLM from config with a tiny tokenizer, saved in hub layout (no download)."""
    import tiny_tokenizers as tiny
    from transformers import MambaConfig, MambaForCausalLM

    d = tmp_path_factory.mktemp("tiny-mamba")
    tok = tiny.target()
    config = MambaConfig(
        vocab_size=len(tok), hidden_size=32, state_size=4, num_hidden_layers=2, eos_token_id=tok.eos_token_id
    )
    torch.manual_seed(0)
    MambaForCausalLM(config).save_pretrained(d)
    tok.save_pretrained(d)
    return d


def test_a_model_without_attention_sizes_gets_an_estimate_from_its_parameters(catalog, tiny_mamba_dir):
    """Issue 27 point 10: a Mamba config has no num_attention_heads, and the memory estimate died of an
    AttributeError. Without attention there is no KV cache to count: the weights (counted from the config) and the
    runtime are the estimate, and the model loads."""
    from transformers import AutoConfig

    entry = entry_for(str(tiny_mamba_dir), catalog)
    config = AutoConfig.from_pretrained(tiny_mamba_dir)
    linear, other = loading.count_params(config)
    plan = plan_load(entry, "cpu", "fp32", config)
    assert plan.estimate_bytes == 4 * (linear + other) + loading._RUNTIME_OVERHEAD["cpu"]
    lm = load_model(str(tiny_mamba_dir), device="cpu", precision="fp32", catalog=catalog, log=lambda m: None)
    assert type(lm.model).__name__ == "MambaForCausalLM"


def _precision_compares(path) -> list[str]:
    """Where a source file compares something with the name "gguf" (x == "gguf", x in ("gguf", ...))."""
    import ast

    compares = [node for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Compare)]
    return [
        f"{path.name}:{node.lineno}"
        for node in compares
        if "gguf" in [n.value for n in ast.walk(node) if isinstance(n, ast.Constant)]
    ]


def test_the_runner_a_precision_loads_on_is_asked_of_the_registry_alone():
    """A new runner is a row of usd/runners/registry.py: no module outside the catalog (which reads the name) and the
    registry chooses a runner by comparing with the name "gguf"."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    allowed = {"catalog.py", "registry.py"}
    files = [p for d in ("usd", "app") for p in (root / d).rglob("*.py") if p.name not in allowed]
    assert [hit for p in files for hit in _precision_compares(p)] == []


def test_torch_computes_on_one_thread_while_no_model_of_the_process_runs_on_torch(monkeypatch):
    """A llama.cpp model's decode loop wakes torch's threads only for small operations, and their spinning slowed the
    next llama.cpp step (usd/runners/torch_threads.py): torch gets one thread while no model computes on torch, and
    its own count back while one does."""
    import gc
    import weakref

    from usd.runners import torch_threads

    class LlamaCppStandIn:
        pass

    before = torch.get_num_threads()
    monkeypatch.setattr(torch_threads, "_on_torch", weakref.WeakSet())
    monkeypatch.setattr(torch_threads, "_default", [2])
    try:
        torch_threads.follow(LlamaCppStandIn(), on_torch=False)
        assert torch.get_num_threads() == 1
        on_torch = torch.nn.Linear(1, 1)
        torch_threads.follow(on_torch, on_torch=True)
        assert torch.get_num_threads() == 2
        torch_threads.follow(LlamaCppStandIn(), on_torch=False)
        assert torch.get_num_threads() == 2, "a model on torch is still held"
        del on_torch
        gc.collect()
        torch_threads.follow(LlamaCppStandIn(), on_torch=False)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_a_gguf_whose_prompts_a_twin_reads_counts_its_weights_and_cache_twice(catalog, monkeypatch):
    """Where each model on llama.cpp loads a twin for its prompts (usd/runners/llamacpp/twin.py, on a CPU with AMX),
    the twin holds the weights and a KV cache again: the memory estimate counts both twice."""
    entry = catalog.get("qwen2.5-coder-1.5b-instruct")
    monkeypatch.setattr(loading, "_reads_prompts_on_amx", lambda: False)
    one = loading.estimate_bytes(entry, "gguf", "cpu") - loading._RUNTIME_OVERHEAD["cpu"]
    monkeypatch.setattr(loading, "_reads_prompts_on_amx", lambda: True)
    two = loading.estimate_bytes(entry, "gguf", "cpu") - loading._RUNTIME_OVERHEAD["cpu"]
    assert one > 1e9 and two == 2 * one
