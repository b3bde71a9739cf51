"""The llama.cpp runner (precision gguf) is lossless like the transformers one: on the real small pair (Qwen2.5-Coder
0.5B target, SmolLM2-135M drafter, both their GGUFs as they are) greedy output under every algorithm is token-identical
to plain decoding of the same loaded model, also with the runners mixed; sampling is distributed as plain sampling; a
cache rolled back through many rejections holds what a fresh evaluation computes. All of it rests on llama.cpp giving
a position the same logits alone and in a batch, which the first tests check on their own.

Skipped only when llama-cpp-python is not installed (`./dev.sh setup` builds it; CI does).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import test_decoder_distribution
import torch

from usd import api, llamacpp
from usd.decoder import stream
from usd.loading import LoadError, load_model
from usd.pair import Pair, model_vocab_size
from usd.sampling import SamplingParams, probabilities

QWEN, SMOL = "qwen2.5-coder-0.5b-instruct", "smollm2-135m-instruct"
FUNC = 'def add_{i}(x):\n    """Return x plus {i}."""\n    return x + {i}\n\n\n'
LONG = "".join(FUNC.format(i=i) for i in range(30)) + "def add_30(x):"  # past 512 positions
PROMPTS = ["def fibonacci(n):", "The capital of France is", "日本の首都は", "x =     [1,    2,\n\n\n    3]", LONG]
CHATS = ["Write a Python function that reverses a string.", "What is 17 * 23?"]
MAX_NEW = 40

needs_llama = pytest.mark.skipif(
    not llamacpp.available(),
    reason="llama-cpp-python is not installed (the llamacpp extra: ./dev.sh setup builds it; CI installs it)",
)


def _load(catalog, name, precision):
    m = load_model(catalog.get(name), device="cpu", precision=precision, log=lambda m: None)
    return m.model, m.tokenizer


@pytest.fixture(scope="module")
def gguf(catalog, real_paths):
    return {name: _load(catalog, name, "gguf") for name in (QWEN, SMOL)}


@pytest.fixture(scope="module")
def fp32(catalog, real_paths):
    return {name: _load(catalog, name, "fp32") for name in (QWEN, SMOL)}


def pair_of(target, drafter) -> Pair:
    (t, tt), (d, dt) = target, drafter
    limits = [n for n in (getattr(t.config, "max_position_embeddings", None), 32768) if n]
    return Pair(t, tt, d, dt, context_length=min(limits))


# --- batch invariance: the ground lossless stands on -----------------------------------------------------------------


@pytest.mark.parametrize("name", [QWEN, SMOL])
@pytest.mark.parametrize("prompt", [PROMPTS[0], LONG], ids=["short", "long"])
@pytest.mark.real_models
@needs_llama
def test_a_position_has_the_same_logits_alone_and_in_a_batch(gguf, name, prompt):
    model, tok = gguf[name]
    ids = tok.encode(prompt)
    # past 512 positions the single-row attention kernel changes; the longest verify (17 tokens) covers it there
    for k in (1, 4, 8, 16) if prompt != LONG else (16,):
        gap = llamacpp.batch_invariance(model, ids, k)
        assert gap == 0.0, (
            f"{name}: a batch of {k + 1} differs from single steps by {gap:.3g} logits; llama.cpp "
            "picks batch-dependent kernels here: see usd/llamacpp.py's docstring"
        )


# --- greedy identity -------------------------------------------------------------------------------------------------


def _identity(pair, prompt=None, messages=None, algorithms=(("tli", 4), ("slem", 4), ("auto", "auto"))):
    kw = {"messages": messages} if messages else {"prompt": prompt}
    ref = api.generate(pair, algorithm="none", max_new_tokens=MAX_NEW, **kw)
    for algorithm, k in algorithms:
        done = api.generate(pair, algorithm=algorithm, draft_tokens=k, max_new_tokens=MAX_NEW, **kw)
        assert done.target_ids == ref.target_ids, f"{algorithm} k={k} differs from plain decoding on {kw}"
        if algorithm in ("tli", "slem", "standard"):
            assert done.stats.drafted > 0
    return ref


@pytest.mark.parametrize("prompt", PROMPTS, ids=range(len(PROMPTS)))
@pytest.mark.real_models
@needs_llama
def test_every_algorithm_equals_plain_greedy_on_llama_cpp(gguf, prompt):
    pair = pair_of(gguf[QWEN], gguf[SMOL])
    more = (("tli", 1), ("slem", 8)) if prompt == PROMPTS[0] else ()
    _identity(pair, prompt, algorithms=(("tli", 4), ("slem", 4), ("auto", "auto"), *more))


@pytest.mark.parametrize("question", CHATS, ids=range(len(CHATS)))
@pytest.mark.real_models
@needs_llama
def test_chat_on_llama_cpp_equals_plain_greedy(gguf, question):
    _identity(pair_of(gguf[QWEN], gguf[SMOL]), messages=[{"role": "user", "content": question}])


@pytest.mark.real_models
@needs_llama
def test_the_default_pair_equals_plain_greedy(catalog, real_paths):
    """The app's and CLI's default pair as they load it (the 1.5B target and SmolLM2, both on llama.cpp on a CPU)."""
    import usd

    pair = usd.load_pair(catalog=catalog, device="cpu", log=lambda m: None)
    assert pair.target_name == catalog.default.target and isinstance(pair.target, llamacpp.LlamaCppModel)
    assert isinstance(pair.drafter, llamacpp.LlamaCppModel)
    _identity(pair, PROMPTS[0])
    _identity(pair, messages=[{"role": "user", "content": CHATS[0]}])


@pytest.mark.real_models
@needs_llama
def test_standard_with_a_same_vocabulary_drafter_on_llama_cpp(catalog, gguf):
    drafter = _load(catalog, QWEN, "gguf")  # its own llama.cpp context, as load_pair gives it
    pair = pair_of(gguf[QWEN], drafter)
    for prompt in PROMPTS[:2]:
        _identity(pair, prompt, algorithms=(("standard", 4), ("auto", "auto")))


@pytest.mark.real_models
@needs_llama
def test_target_and_drafter_sharing_one_llama_context(gguf):
    """One model object as both: each context keeps what they share of the one cache and re-feeds the rest."""
    pair = pair_of(gguf[QWEN], gguf[QWEN])
    _identity(pair, PROMPTS[0], algorithms=(("standard", 4),))


@pytest.mark.parametrize("mix", ["gguf target, fp32 drafter", "fp32 target, gguf drafter"])
@pytest.mark.real_models
@needs_llama
def test_mixed_runners_equal_plain_greedy(gguf, fp32, mix):
    pair = pair_of(gguf[QWEN], fp32[SMOL]) if mix.startswith("gguf") else pair_of(fp32[QWEN], gguf[SMOL])
    for prompt in (PROMPTS[0], PROMPTS[2]) if mix.startswith("gguf") else (PROMPTS[2],):  # fp32 targets are slow
        _identity(pair, prompt)
    _identity(pair, messages=[{"role": "user", "content": CHATS[0]}], algorithms=(("tli", 4),))


# --- sampling --------------------------------------------------------------------------------------------------------

N = 600


@pytest.mark.real_models
@needs_llama
def test_first_two_tokens_distributed_as_plain_sampling_on_llama_cpp(gguf, monkeypatch):
    """As tests/test_decoder_distribution.py, on the real GGUF pair: the exact joint of the first two tokens (T=1,
    top-k 4) from the target's own logits, against N speculative generations (tli, k=3)."""
    pair = pair_of(gguf[QWEN], gguf[SMOL])
    prompt = "def add(a, b):\n    return"
    ids, dids = pair.target_tokenizer.encode(prompt), pair.drafter_tokenizer.encode(prompt)
    params = SamplingParams(temperature=1.0, top_k=4)
    target = pair.target
    p1 = probabilities(target.new_context(ids).forward(keep=1)[-1], params)
    joint = {}
    for x in p1.nonzero().flatten().tolist():
        p2 = probabilities(target.new_context([*ids, x]).forward(keep=1)[-1], params)
        joint.update({(x, y): float(p1[x] * p2[y]) for y in p2.nonzero().flatten().tolist()})
    counts, drafted, accepted = {}, 0, 0
    for seed in range(N):
        p = SamplingParams(temperature=1.0, top_k=4, seed=seed)
        *_, ev = stream(pair, ids, dids, algorithm="tli", k=3, params=p, max_new_tokens=2, probe_first=False)
        counts[tuple(ev.target_ids)] = counts.get(tuple(ev.target_ids), 0) + 1
        drafted, accepted = drafted + ev.stats.drafted, accepted + ev.stats.accepted
    assert 0.02 < accepted / drafted < 0.98, "the test must exercise both accept and reject paths"
    monkeypatch.setattr(test_decoder_distribution, "N", N)  # its pooling of small cells counts on N samples
    test_decoder_distribution.assert_matches(counts, joint)


# --- rollback --------------------------------------------------------------------------------------------------------


@pytest.mark.real_models
@needs_llama
def test_a_cache_rolled_back_through_many_rejections_equals_a_fresh_evaluation(gguf):
    pair = pair_of(gguf[QWEN], gguf[SMOL])
    model = pair.target
    ids = pair.target_tokenizer.encode(PROMPTS[3])
    params = SamplingParams(temperature=1.0, seed=3)  # sampling from the full distribution: drafts are often rejected
    *_, done = stream(
        pair, ids, pair.drafter_tokenizer.encode(PROMPTS[3]), algorithm="tli", k=8, params=params, max_new_tokens=96
    )
    assert done.stats.drafted - done.stats.accepted >= 20, "too few rejections to test rollback"
    # what the target's cache holds now, after every crop (past it, the last round's rejected draft: crops are lazy)
    held, answer = [], ids + list(done.target_ids)
    while len(held) < min(len(model.kv), len(answer)) and model.kv[len(held)] == answer[len(held)]:
        held.append(answer[len(held)])
    assert len(held) >= len(ids) + 40
    extra = pair.target_tokenizer.encode("\n# done")
    rolled = model.new_context(held + extra).forward(keep=len(extra) + 1)  # reuses the cache, feeds only `extra`
    model.keep_first(0)
    # everything again from an empty cache, each position on the kernels the generation computed it with
    fresh = model.new_context(held + extra).forward(keep=len(extra) + 1)
    assert torch.equal(rolled, fresh), f"max difference {float((rolled - fresh).abs().max()):.3g}"


# --- which kernels compute a position ----------------------------------------------------------------------------


def _next_logits(model, ids):
    return model.new_context(ids).forward(keep=1)


@pytest.mark.real_models
@needs_llama
def test_a_prompt_gets_the_same_logits_whatever_the_cache_held(gguf):
    """A prompt is read in one prefill run, its last token included, however much of it the cache held and on which
    kernels: a prompt sharing a prefix with it, one it goes on from, a longer one, an unrelated one,
    nothing. (A conversation it continues is the exception: its answer's positions keep their kernels, next test.)"""
    model, tok = gguf[QWEN]
    ids = tok.encode(LONG)[:120]
    model.forget()
    fresh = _next_logits(model, ids)
    model.forget()
    all_rows = model.feed(ids, 1)  # every position on the row kernels: other bits, so the choice matters here
    if os.environ.get("GGML_CPU_TILED_MM", "1") != "0":
        assert not torch.equal(fresh, torch.from_numpy(all_rows)), "the prefill kernels gave the row kernels' bits"
    before = {
        "all but 3 tokens": ids[:-3] + tok.encode(" pass"),
        "the first 20": ids[:20] + tok.encode(" # unrelated"),
        "it and more": ids + tok.encode("\n    return x"),
        "a shorter prompt it goes on from": ids[:-5],
        "itself less its last token": ids[:-1],
        "it": ids,
        "an unrelated prompt": tok.encode(PROMPTS[1]),
    }
    for label, other in before.items():
        model.forget()
        _next_logits(model, other)
        got = _next_logits(model, ids)
        assert torch.equal(got, fresh), f"after {label}: max difference {float((got - fresh).abs().max()):.3g}"


@pytest.mark.real_models
@needs_llama
def test_a_prompt_and_the_steps_after_it_are_what_llama_cpps_own_generate_computes(catalog, real_paths):
    """llama-cpp-python's `Llama` (its default kernels, repacked weights and the tiled matmul; given the attention
    settings our runner needs) reads a prompt in one batch and its answer a token at a time. Our runner's logits for
    the default target are the same bits, whatever the prompt's length modulo a gemm group; the old layout (the
    prompt's last token on the row kernels) was not."""
    from llama_cpp import llama_get_logits_ith

    model, tok = _load(catalog, catalog.default.target, "gguf")
    llm = llamacpp.llama_with_our_attention(model)

    def theirs(tokens):
        llm.eval(tokens)
        return torch.from_numpy(np.ctypeslib.as_array(llama_get_logits_ith(llm.ctx, -1), shape=(model.n_vocab,)))

    ids = tok.encode(LONG)
    for n in (40, 41, 42, 43, 9):
        model.forget()
        llm.reset()
        ctx = model.new_context(ids[:n])
        assert torch.equal(ctx.forward(keep=1)[-1], theirs(ids[:n])), f"a prompt of {n} tokens"
        for i in range(n, n + 3):
            ctx.ids.append(ids[i])
            assert torch.equal(ctx.forward(keep=1)[-1], theirs([ids[i]])), f"step {i - n + 1} after {n} tokens"
    model.forget()
    model.feed(ids[:42], 0, [llamacpp.PREFILL] * 40 + [llamacpp.ROW] * 2)
    row_read = torch.from_numpy(model.feed(ids[42:43], 1)[-1])
    llm.reset()
    assert not torch.equal(row_read, theirs(ids[:43])), "the test cannot tell the layouts apart"
    model.forget()


@pytest.mark.real_models
@needs_llama
def test_a_conversation_displaced_from_the_cache_gets_its_positions_bits_back(gguf):
    """A chat's next turn after another conversation took the cache (a server slot's, say) re-feeds the first turn's
    answer on the row kernels it was generated with, so it gets what it would have got undisturbed."""
    model, tok = gguf[QWEN]
    ctx = model.new_context(tok.encode(LONG)[:100])
    for _ in range(24):  # a first answer, a token at a time
        ctx.ids.append(int(ctx.forward(keep=1)[-1].argmax()))
    turn2 = ctx.ids + tok.encode("\n# and now the tests\n")
    undisturbed = _next_logits(model, turn2)
    _next_logits(model, tok.encode(PROMPTS[1]))  # another conversation takes the cache
    model.keep_first(0)
    displaced = _next_logits(model, turn2)
    assert torch.equal(displaced, undisturbed)
    model.forget()  # what the kernels were is forgotten too: the answer's positions now run on the prefill kernels
    if os.environ.get("GGML_CPU_TILED_MM", "1") != "0":
        assert not torch.equal(_next_logits(model, turn2), undisturbed), "the test cannot tell the kernels apart"


@pytest.mark.real_models
@needs_llama
def test_a_verify_longer_than_a_row_batch_equals_plain_greedy(gguf):
    """k + 1 > the row batch: the verify takes several llama_decode calls."""
    pair = pair_of(gguf[QWEN], gguf[SMOL])
    assert pair.target.batching.row_batch < 5
    _identity(pair, PROMPTS[0], algorithms=(("tli", 4), ("slem", 8)))


# --- loading ---------------------------------------------------------------------------------------------------------


def test_gguf_without_llama_cpp_is_a_load_error_that_says_how_to_install(catalog, monkeypatch):
    monkeypatch.setattr(llamacpp, "available", lambda: False)
    with pytest.raises(LoadError, match=r"pip install .*usd-chat\[llamacpp\]"):
        load_model(catalog.get(QWEN), device="cpu", precision="gguf", log=lambda m: None)


def test_catalog_gguf_falls_back_to_transformers_without_llama_cpp(catalog, monkeypatch):
    from usd.loading import choose_precision

    monkeypatch.setattr(llamacpp, "available", lambda: False)
    entry = catalog.get("qwen2.5-coder-1.5b-instruct")
    assert entry.precision.cpu == "gguf"
    chosen, note = choose_precision(entry, "cpu")
    assert chosen in ("bf16", "fp32") and "llama-cpp-python is not installed" in note


@pytest.mark.real_models
@needs_llama
def test_vocabulary_sizes_and_context_on_both_runners(gguf, fp32):
    for name, vocab in ((QWEN, 151936), (SMOL, 49152)):
        assert model_vocab_size(gguf[name][0]) == model_vocab_size(fp32[name][0]) == vocab
        assert gguf[name][0].config.max_position_embeddings == 8192


@pytest.mark.real_models
@needs_llama
@pytest.mark.parametrize("max_caches", [1, llamacpp.MAX_CACHES])
def test_generations_on_several_threads_each_get_plain_decodings_answer(gguf, max_caches):
    """The server's slots run generations at once on one pair: each takes a llama.cpp context (not thread-safe) of its
    own while one is to be had, or waits for its turn on one; either way it gets plain decoding's answer."""
    import threading

    pair = pair_of(gguf[QWEN], gguf[SMOL])
    prompts = [PROMPTS[0], PROMPTS[1], CHATS[1]]
    plain = [api.generate(pair, prompt=p, algorithm="none", max_new_tokens=24).target_ids for p in prompts]
    got: dict[int, list[int]] = {}

    def run(i: int) -> None:
        got[i] = api.generate(pair, prompt=prompts[i], algorithm="tli", draft_tokens=3, max_new_tokens=24).target_ids

    pair.target.max_caches = pair.drafter.max_caches = max_caches
    try:
        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
    finally:
        pair.target.max_caches = pair.drafter.max_caches = llamacpp.MAX_CACHES
    assert [got.get(i) for i in range(len(prompts))] == plain
    assert 1 < len(pair.target.caches) <= llamacpp.MAX_CACHES or max_caches == 1


@pytest.mark.real_models
@needs_llama
def test_a_conversation_keeps_its_cache_while_another_runs(gguf):
    """A second generation that runs while the first's cache is busy gets a cache of its own, and later picks the
    empty one over the first's; each goes on from what its cache holds, with the bits one cache gives."""
    model, tok = gguf[QWEN]
    model.forget()
    prompt, step = tok.encode(LONG)[:60], tok.encode(" pass")[0]

    def first_conversation(before_the_step=lambda: None):
        a = model.new_context(prompt)
        a.forward(keep=1)
        before_the_step()
        a.ids.append(step)
        return a, a.forward(keep=1)

    alone = first_conversation()[1]
    model.forget()
    b = model.new_context(tok.encode(PROMPTS[1]))
    with model.borrow(b) as first, model.borrow(model.new_context(prompt)) as second:
        assert first is not second
    a, got = first_conversation(before_the_step=lambda: b.forward(keep=1))
    assert a.cache is not b.cache
    assert a.cache is not None and a.cache.kv == a.ids, "the first conversation's cache was displaced"
    assert torch.equal(got, alone)


@pytest.mark.real_models
@needs_llama
def test_logits_do_not_depend_on_the_thread_count(gguf):
    """Generations at once share the cores (`LlamaCppModel.borrow`); that must not change a bit."""
    model, tok = gguf[QWEN]
    ids = tok.encode(LONG)[:100]
    cache = model.caches[0]
    outs = []
    for n in (model.n_threads, 1):
        cache.set_threads(n)
        model.forget()
        outs.append(
            np.concatenate([model.feed(ids, 1, model.batching.prompt_kernels([], len(ids))), model.feed(ids[:3], 3)])
        )
    cache.set_threads(model.n_threads)
    assert np.array_equal(outs[0], outs[1])
