"""The llama.cpp runner (precision gguf) is lossless like the transformers one: on the real small pair (Qwen2.5-Coder
0.5B target, SmolLM2-135M drafter, both their GGUFs as they are) greedy output under every algorithm is token-identical
to plain decoding of the same loaded model, also with the runners mixed; sampling is distributed as plain sampling; a
cache rolled back through many rejections holds what a fresh evaluation computes. All of it rests on llama.cpp giving
a position the same logits alone and in a batch, which the first tests check on their own.

Skipped only when llama-cpp-python is not installed (`./dev.sh setup` builds it; CI does).
"""

from __future__ import annotations

import itertools
import os

import numpy as np
import pytest
import reference_sampling as reference
import test_decoder_distribution
import torch
from tiny_pairs import how

from usd import api
from usd.datasets import recall_prompts
from usd.decoder import stream
from usd.loading import LoadError, load_model
from usd.pair import Pair, model_vocab_size
from usd.runners import llamacpp
from usd.sampling import SamplingParams

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
@pytest.mark.parametrize("prompt", [FUNC.format(i=7), LONG], ids=["short", "long"])
@pytest.mark.real_models
@needs_llama
def test_a_position_has_the_same_logits_alone_and_in_a_batch(gguf, name, prompt):
    model, tok = gguf[name]
    ids = tok.encode(prompt)
    assert len(ids) >= 18, "a verify of 17 positions after at least one"
    # past 512 positions the single-row attention kernel changes; the longest verify (17 tokens) covers it there
    for k in (1, 4, 8, 16) if prompt != LONG else (16,):
        gap = llamacpp.batch_invariance(model, ids, k)
        assert gap == 0.0, (
            f"{name}: a batch of {k + 1} differs from single steps by {gap:.3g} logits; llama.cpp "
            "picks batch-dependent kernels here: see usd/runners/llamacpp/kernels.py"
        )


def _filler(tok, n: int) -> list[int]:
    """About n ids of code, for a cache of that length."""
    ids = tok.encode("".join(FUNC.format(i=i) for i in range(n // 20 + 1)))
    assert len(ids) >= n
    return ids[:n]


@pytest.mark.parametrize("name", [QWEN, SMOL])
@pytest.mark.parametrize("cached", [300, 600, 4000, 4200], ids=lambda n: f"{n} cached")
@pytest.mark.real_models
@needs_llama
def test_every_row_of_a_verify_has_a_single_steps_bits(gguf, name, cached):
    """Each row of a call of n rows, n = 2 .. the row batch (16 with the exact-rows patch), gets the bits of the same
    position evaluated alone, with the cache on both sides of 512 (where one query takes flash attention's split-KV
    kernel unless the V cache is bf16) and of 4096. Where the patch is built in, the calls are its rows kernels."""
    model, tok = gguf[name]
    sizes = list(range(2, model.batching.row_batch + 1))
    assert model.batching.exact_rows == (llamacpp.exact_rows() > 0)
    gaps = llamacpp.row_gaps(model, _filler(tok, cached + max(sizes)), sizes)
    assert all(gap == 0.0 for gap in gaps.values()), f"{name}, {cached} cached: gaps by rows {gaps}"


@pytest.mark.real_models
@needs_llama
def test_ci_builds_the_exact_rows_patch(gguf):
    """dev.sh (and so CI) builds llama.cpp with patches/llama-cpp-python-exact-rows.patch: the tests above check its
    kernels, not the unpatched rule's."""
    assert llamacpp.exact_rows() == llamacpp.EXACT_ROWS
    assert gguf[QWEN][0].batching == llamacpp.Batching.for_weights(True, llamacpp.EXACT_ROWS)


@needs_llama
def test_ci_builds_llama_cpp_on_its_own_threads():
    """dev.sh (and so CI) builds llama.cpp without OpenMP. With it, llama.cpp shares libgomp with torch, and a step run
    on a thread other than the one that first used OpenMP (the app's and the server's worker threads) was far slower
    than the same step on that thread (binding.OPENMP_HINT)."""
    from usd.runners.llamacpp import binding

    assert b"OPENMP = 1" not in binding.library().llama_print_system_info()
    assert binding.threads_why() == ""


@pytest.mark.real_models
@needs_llama
def test_each_llama_context_keeps_a_pool_of_llama_cpps_own_threads(gguf):
    """Without a kept pool, llama.cpp on its own threads starts and joins them at every call, which measured slower
    (binding.Threadpools)."""
    for name in (QWEN, SMOL):
        assert all(free_pool is not None for _, _, free_pool in gguf[name][0].handles)


@pytest.mark.real_models
@needs_llama
def test_a_build_with_openmp_says_what_it_costs_in_the_load_line(gguf, monkeypatch):
    """pip's own build runs llama.cpp on OpenMP: the load line says that its worker threads decode slower and how to
    build it on its own threads."""
    from usd.runners.llamacpp import binding

    monkeypatch.setitem(binding._state, "threadpools", None)  # as an OpenMP build has
    why = gguf[QWEN][0].rule_why
    assert binding.OPENMP_HINT in why and "./dev.sh setup" in why


@needs_llama
def test_a_build_without_the_patch_runs_on_the_unpatched_rule_and_says_so(monkeypatch):
    """pip's own build of llama-cpp-python (a Space's requirements.txt, a plain pip install) has no exact rows: the
    runner takes the unpatched rule, and the load line says what that gives up and how to get the patch."""
    from usd.runners.llamacpp import binding

    def no_symbol(name):
        raise AttributeError(f"{name}: undefined symbol: ggml_cpu_set_exact_rows")

    monkeypatch.setattr(binding.ctypes, "CDLL", no_symbol)
    assert binding._exact_rows() == {"exact_rows": 0, "exact_why": binding.PATCH_HINT}
    assert "calls of at most 3 tokens" in binding.PATCH_HINT and "./dev.sh setup" in binding.PATCH_HINT
    assert llamacpp.Batching.for_weights(True, 0).rule == "a verify in calls of at most 3 tokens"


@pytest.mark.real_models
@needs_llama
def test_rows_that_differ_at_load_put_the_process_on_the_unpatched_rule(catalog, gguf, monkeypatch):
    """The first model a process loads checks the patch's rows; rows that differ (a CPU where the kernels' premises
    fail) turn exact rows off, the model takes the unpatched rule, and the load line says why."""
    from usd.runners.llamacpp import binding
    from usd.runners.llamacpp import model as model_module

    if not llamacpp.exact_rows():
        pytest.skip("llama.cpp without the exact-rows patch")
    monkeypatch.setattr(model_module, "_exact_rows_checked", False)
    monkeypatch.setattr(model_module, "row_gaps", lambda model, ids, sizes: {n: 0.25 for n in sizes})
    lines: list[str] = []
    try:
        loaded = load_model(catalog.get(SMOL), device="cpu", precision="gguf", log=lines.append).model
        assert loaded.batching == llamacpp.Batching.for_weights(True) and llamacpp.exact_rows() == 0
        assert any("calls of at most 3 tokens: its rows differed from single steps by 0.25" in line for line in lines)
    finally:
        binding._state.update(binding._exact_rows())  # exact rows on again, for the tests after this one
    assert llamacpp.exact_rows() == llamacpp.EXACT_ROWS


# --- greedy identity -------------------------------------------------------------------------------------------------


def _identity(pair, prompt=None, messages=None, algorithms=(("tli", 4), ("slem", 4), ("ngram", 4), ("auto", "auto"))):
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
    _identity(pair, prompt, algorithms=(("tli", 4), ("slem", 4), ("ngram", 4), ("auto", "auto"), *more))


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
def test_the_default_pair_in_a_chat_asking_for_its_answer_again_equals_plain_greedy(catalog, real_paths):
    """Verifies of up to 16 tokens in one call (the exact-rows patch) on the default pair: the second turn asks for the
    first answer again with a change, so the lookup drafts long copied spans; every turn of every algorithm's
    conversation is plain decoding's."""
    import usd

    pair = usd.load_pair(catalog=catalog, device="cpu", log=lambda m: None)
    questions = [CHATS[0], "Write that function again, with a docstring."]

    def conversation(algorithm, k):
        messages, answers, mean_k = [], [], []
        for q in questions:
            messages.append({"role": "user", "content": q})
            done = api.generate(pair, messages=messages, algorithm=algorithm, draft_tokens=k, max_new_tokens=64)
            answers.append(done.target_ids)
            mean_k.append(done.stats.mean_k)
            messages.append({"role": "assistant", "content": done.text})
        return answers, mean_k

    plain, _ = conversation("none", "auto")
    for algorithm, k in (("ngram", 16), ("suffix", 16), ("auto", "auto"), ("tli", 8)):
        answers, mean_k = conversation(algorithm, k)
        assert answers == plain, f"{algorithm}: a turn differs from plain decoding's"
        if algorithm == "ngram":
            assert mean_k[1] > pair.target.batching.row_batch // 4, "the second turn's drafts should copy long spans"


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

N = 400
K = 2
"""Two drafts decide both tokens the test counts (a third would be verified and then cut off), at a fifth less time
a generation than three."""


@pytest.mark.real_models
@needs_llama
def test_the_default_pair_asked_again_in_new_conversations_drafts_from_memory_and_equals_plain(catalog, real_paths):
    """A session of three requests, each a new conversation asking for the first answer again with a change
    (the recall set): suffix drafts the later answers from the earlier ones, and each is plain decoding's."""
    import usd
    from usd.suffix import SuffixMemory

    pair = usd.load_pair(catalog=catalog, device="cpu", log=lambda m: None)
    session = [list(p.messages or ()) for p in recall_prompts() if p.id.startswith("binary-")]
    scope = SuffixMemory().scope(pair.tokenizer_key, "test")
    for i, messages in enumerate(session):
        plain = api.generate(pair, messages=messages, algorithm="none", max_new_tokens=64, scope=None)
        t_ids, _ = usd.chat.prompt_ids(pair, None, messages, "own")
        *_, done = stream(pair, t_ids, None, how(algorithm="suffix", k=16, max_new_tokens=64), memory=scope)
        assert done.target_ids == plain.target_ids, f"request {i + 1} differs from plain decoding's"
        if i:
            assert done.stats.accepted_by_algorithm.get("suffix", 0) > 16, "the earlier answers should be drafted"


@pytest.mark.parametrize("algorithm", ["tli", "ngram"])
@pytest.mark.real_models
@needs_llama
def test_first_two_tokens_distributed_as_plain_sampling_on_llama_cpp(gguf, monkeypatch, algorithm):
    """As tests/test_decoder_distribution.py, on the real GGUF pair: the exact joint of the first two tokens (T=1,
    top-k 4) from the target's own logits, against N speculative generations (K drafts): tli, and ngram on the target
    alone after a prompt that echoes itself (the prompt, its greedy two tokens, the prompt again)."""
    pair = pair_of(gguf[QWEN], gguf[SMOL])
    prompt = "def add(a, b):\n    return"
    ids, dids = pair.target_tokenizer.encode(prompt), pair.drafter_tokenizer.encode(prompt)
    if algorithm == "ngram":
        pair = Pair(pair.target, pair.target_tokenizer, context_length=pair.context_length)
        *_, greedy = stream(pair, ids, None, how(algorithm="none", max_new_tokens=2))
        ids, dids = ids + list(greedy.target_ids) + ids, None
    target = pair.target
    eos = frozenset(pair.eos_ids())
    joint = reference.exact_joint(lambda p: _next_logits(target, p)[-1].numpy(), ids, eos, temperature=1.0, top_k=4)
    counts, drafted, accepted = {}, 0, 0
    for seed in range(N):
        p = SamplingParams(temperature=1.0, top_k=4, seed=seed)
        *_, ev = stream(pair, ids, dids, how(algorithm=algorithm, k=K, params=p, max_new_tokens=2), probe_first=False)
        counts[tuple(ev.target_ids)] = counts.get(tuple(ev.target_ids), 0) + 1
        drafted, accepted = drafted + ev.stats.drafted, accepted + ev.stats.accepted
    assert 0.02 < accepted / drafted < 0.98, "the test must exercise both accept and reject paths"
    monkeypatch.setattr(test_decoder_distribution, "N", N)  # its pooling of small cells counts on N samples
    test_decoder_distribution.assert_matches(counts, joint)


@pytest.mark.real_models
@needs_llama
def test_auto_switching_among_every_source_equals_plain_greedy_on_llama_cpp(gguf, auto_switching):
    """auto choosing at random, round by round, among plain decoding, tli, slem and the lookups (on LONG, whose
    functions repeat, they find continuations) gives plain decoding's answer on llama.cpp. The draft length is
    fixed: a k that follows this machine's timings changes how many rounds there are, and so which sources the random
    order reaches (in a busy full run the lookup was never reached)."""
    pair = pair_of(gguf[QWEN], gguf[SMOL])
    ids, dids = pair.target_tokenizer.encode(LONG), pair.drafter_tokenizer.encode(LONG)
    *_, ref = stream(pair, ids, dids, how(algorithm="none", max_new_tokens=MAX_NEW))
    events = list(stream(pair, ids, dids, how(algorithm="auto", k=2, max_new_tokens=MAX_NEW), probe_first=False))
    assert events[-1].target_ids == ref.target_ids
    ran = {r.algorithm for r in events[:-1] if r.drafted}
    assert ran & {"ngram", "suffix"} and ran & {"tli", "slem"}, ran  # a lookup (whichever the order reached), a model


# --- rollback --------------------------------------------------------------------------------------------------------


@pytest.mark.real_models
@needs_llama
def test_a_cache_rolled_back_through_many_rejections_equals_a_fresh_evaluation(gguf):
    """The target's own context after a generation that rolled back many rejected drafts goes on with the logits a
    context that was only ever fed plain steps computes."""
    from usd.decoder import Generation

    pair = pair_of(gguf[QWEN], gguf[SMOL])
    model = pair.target
    ids, dids = pair.target_tokenizer.encode(PROMPTS[3]), pair.drafter_tokenizer.encode(PROMPTS[3])
    params = SamplingParams(temperature=1.0, seed=3)  # sampling from the full distribution: drafts are often rejected
    gen = Generation(pair, ids, dids, how(algorithm="tli", k=8, params=params, max_new_tokens=96), probe_first=True)
    while gen.answer.stop_reason is None:
        gen.step()
    assert gen.tally.drafted - gen.tally.accepted >= 20, "too few rejections to test rollback"
    answer, extra = list(gen.answer.ids), pair.target_tokenizer.encode("\n# done")
    assert len(answer) >= 40
    gen.target.truncate(len(ids) + len(answer))
    gen.target.ids.extend(extra)
    rolled = gen.target.forward(keep=len(extra) + 1)  # feeds the last answer token and `extra`
    model.forget()
    plain = model.new_context(ids)
    plain.forward(keep=1)
    for t in answer[:-1]:  # as plain decoding fed the answer: a token at a time
        plain.ids.append(t)
        plain.forward(keep=1)
    plain.ids.extend([answer[-1], *extra])
    fresh = plain.forward(keep=len(extra) + 1)
    assert torch.equal(rolled, fresh), f"max difference {float((rolled - fresh).abs().max()):.3g}"


# --- which kernels compute a position ----------------------------------------------------------------------------


def _next_logits(model, ids):
    return model.new_context(ids).forward(keep=1)


@pytest.mark.real_models
@needs_llama
def test_a_prompt_gets_the_same_logits_whatever_the_cache_held(gguf):
    """A prompt is read in one prefill run, its last token included, however much of it the cache held and on which
    kernels: a prompt sharing a prefix with it, one it goes on from, a longer one, an unrelated one, nothing (and a
    conversation it continues: next test)."""
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
def test_a_prompt_and_the_steps_after_it_are_what_llama_cpps_own_generate_computes(catalog, real_paths, monkeypatch):
    """llama-cpp-python's `Llama` (its default kernels, repacked weights and the tiled matmul; given the attention
    settings our runner needs) reads a prompt in one batch and its answer a token at a time. Our runner's logits for
    the default target are the same bits, whatever the prompt's length modulo a gemm group; the old layout (the
    prompt's last token on the row kernels) was not. Where a twin reads the prompts (twin.py), they are the bits of
    `Llama` with its weights in the AMX buffer, and without the twin those of its default kernels."""
    from llama_cpp import llama_get_logits_ith

    from usd.runners.llamacpp import binding

    model, tok = _load(catalog, catalog.default.target, "gguf")
    ids = tok.encode(LONG)

    def theirs(tokens):
        llm.eval(tokens)
        return torch.from_numpy(np.ctypeslib.as_array(llama_get_logits_ith(llm.ctx, -1), shape=(model.n_vocab,)))

    if model.twin is not None:
        with binding.amx_weights():
            llm = llamacpp.llama_with_our_attention(model)
        for n in (40, 41, 42, 43):  # prefill runs (a prompt under PREFILL_MIN_ROWS is on the row kernels)
            model.forget()
            llm.reset()
            assert torch.equal(model.new_context(ids[:n]).forward(keep=1)[-1], theirs(ids[:n])), f"{n} on AMX"
        for cache in model.pool.caches:
            monkeypatch.setattr(cache, "twin", None)
    llm = llamacpp.llama_with_our_attention(model)
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
def test_a_chats_next_turn_gets_the_same_bits_undisturbed_displaced_or_from_nothing(gguf):
    """A chat's next turn reads the whole conversation as its prompt: the first turn's answer, generated on the row
    kernels, is read again on the prefill kernels, so the turn gets the same bits whether its first turn is still in
    the cache, another conversation took the cache (a server slot's, say), or the cache was emptied."""
    model, tok = gguf[QWEN]
    ctx = model.new_context(tok.encode(LONG)[:100])
    for _ in range(24):  # a first answer, a token at a time
        ctx.ids.append(int(ctx.forward(keep=1)[-1].argmax()))
    turn2 = ctx.ids + tok.encode("\n# and now the tests\n")
    undisturbed = _next_logits(model, turn2)
    _next_logits(model, tok.encode(PROMPTS[1]))  # another conversation takes the cache
    model.keep_first(0)
    assert torch.equal(_next_logits(model, turn2), undisturbed), "displaced"
    model.forget()
    assert torch.equal(_next_logits(model, turn2), undisturbed), "from an empty cache"
    if os.environ.get("GGML_CPU_TILED_MM", "1") != "0":  # the answer's positions on the row kernels: other bits
        model.forget()
        model.feed(turn2[:100], 0, model.batching.kernels([], 100, 1))
        model.feed(turn2[100:124], 24)
        tail = turn2[124:]
        row_read = torch.from_numpy(model.feed(tail, 1, model.batching.kernels([], len(tail), 1))[-1:])
        assert not torch.equal(row_read, undisturbed), "the test cannot tell the kernels apart"
        model.forget()


@pytest.mark.real_models
@needs_llama
def test_a_verify_longer_than_a_row_batch_equals_plain_greedy(gguf):
    """k + 1 > the row batch: the verify takes several llama_decode calls."""
    pair = pair_of(gguf[QWEN], gguf[SMOL])
    k = pair.target.batching.row_batch
    _identity(pair, PROMPTS[0], algorithms=(("tli", k), ("slem", k)))


# --- the llama_decode calls ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("repacked", [True, False], ids=["repacked weights", "plain weights"])
@pytest.mark.parametrize("exact_rows", [0, 16], ids=["unpatched", "exact rows"])
def test_no_llama_decode_call_is_longer_than_the_batch_arrays(repacked, exact_rows):
    """llama_batch_init sizes its token, position and sequence arrays for N_BATCH tokens: a longer call writes past
    them. Every prompt length up to the context cap is cut into calls that fit, each large enough for the prefill
    kernels (or, too short for them, on the row kernels in row batches), covering the prompt once."""
    batching = llamacpp.Batching.for_weights(repacked, exact_rows)
    for n in range(1, llamacpp.N_CTX_CAP + 1):
        calls = batching.calls(batching.kernels([], n, 1))
        sizes = [end - start for start, end in calls]
        assert max(sizes) <= llamacpp.N_BATCH, f"a prompt of {n}: calls of {sizes}"
        assert calls[0][0] == 0 and calls[-1][1] == n, (n, calls)
        assert max(sizes) <= batching.row_batch or min(sizes) >= batching.prefill_min, (n, calls)
        assert all(a[1] == b[0] for a, b in itertools.pairwise(calls)), (n, calls)


@pytest.mark.parametrize("repacked", [True, False], ids=["repacked weights", "plain weights"])
@pytest.mark.parametrize("exact_rows", [0, 16], ids=["unpatched", "exact rows"])
def test_a_refeed_from_any_position_of_a_prompt_is_cut_into_calls_the_kernels_allow(repacked, exact_rows):
    """A position re-fed (the last one again, after a rollback, or a cache another context changed) starts where its
    prefill batch can be computed again (`refeed_from`), and what is fed from there cuts into valid calls: a prefill
    run too short for the prefill kernels, or not whole gemm groups, would be a bug (seen with exact rows, whose
    smallest prefill batch of 17 rows was not whole groups of 4)."""
    batching = llamacpp.Batching.for_weights(repacked, exact_rows)
    for n in range(1, 200):
        kinds = batching.kernels([], n, 1)
        for start in range(n):
            begin = batching.refeed_from(kinds, start)
            assert begin <= start
            for a, b in batching.calls(kinds[begin:]):
                assert b - a <= batching.row_batch or b - a >= batching.prefill_min, (n, start, a, b)


def test_a_call_that_would_not_fit_is_refused_before_it_reaches_llama_cpp():
    """The last line of defence: a bug that asks for more than the C arrays hold fails as a bug, not as a write past
    them."""
    from usd.errors import InternalError
    from usd.runners.llamacpp.cache import LlamaCache

    cache = object.__new__(LlamaCache)  # no model needed: the check comes before anything is written
    with pytest.raises(InternalError, match="llama_decode call of 513 tokens"):
        cache.decode([1] * (llamacpp.N_BATCH + 1), 0, 1)


@pytest.mark.real_models
@needs_llama
def test_a_prompt_of_1023_tokens_decodes_as_plain_decoding_under_slem(gguf):
    """1023 tokens: with repacked weights the old cut gave its last call 515 tokens (a write past the C arrays)."""
    tok = gguf[SMOL][1]
    ids = tok.encode(LONG * 3)[:1023]
    assert len(ids) == 1023
    pair = pair_of(gguf[SMOL], gguf[SMOL])
    *_, plain = stream(pair, ids, None, how(algorithm="none", max_new_tokens=16))
    *_, done = stream(pair, ids, None, how(algorithm="slem", k=4, max_new_tokens=16), probe_first=False)
    assert done.target_ids == plain.target_ids and done.stats.drafted > 0


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

    pair.target.pool.max_caches = pair.drafter.pool.max_caches = max_caches
    try:
        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
    finally:
        pair.target.pool.max_caches = pair.drafter.pool.max_caches = llamacpp.MAX_CACHES
    assert [got.get(i) for i in range(len(prompts))] == plain
    assert 1 < len(pair.target.pool.caches) <= llamacpp.MAX_CACHES or max_caches == 1


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
    with model.pool.borrow(b) as first, model.pool.borrow(model.new_context(prompt)) as second:
        assert first is not second
    a, got = first_conversation(before_the_step=lambda: b.forward(keep=1))
    assert a.cache is not b.cache
    assert a.cache is not None and a.cache.kv == a.ids, "the first conversation's cache was displaced"
    assert torch.equal(got, alone)


@pytest.mark.real_models
@needs_llama
def test_logits_do_not_depend_on_the_thread_count(gguf):
    """Generations at once share the cores (`CachePool.borrow`); that must not change a bit."""
    model, tok = gguf[QWEN]
    ids = tok.encode(LONG)[:100]
    cache = model.pool.caches[0]
    outs = []
    for n in (model.n_threads, 1):
        cache.set_threads(n)
        model.forget()
        outs.append(
            np.concatenate([model.feed(ids, 1, model.batching.kernels([], len(ids), 1)), model.feed(ids[:3], 3)])
        )
    cache.set_threads(model.n_threads)
    assert np.array_equal(outs[0], outs[1])


# --- conversations: a turn's bits never depend on an earlier turn's algorithm ---------------------------------------


def _accepted_a_drafted_end(rounds) -> bool:
    """The last round kept a drafted end of sequence: accepted more drafts than it has accepted pieces (an end of
    sequence is not a piece)."""
    last = rounds[-1]
    return last.accepted > sum(p.kind == "accepted" for p in last.pieces)


@pytest.mark.real_models
@needs_llama
def test_a_chats_second_turn_gets_the_same_bits_whatever_algorithm_ran_the_first(gguf):
    """One model object as target and drafter (`standard` then accepts every draft, its drafted end of turn too, and
    the two share one model's caches): turn 2's first-token logits after a speculative turn 1 equal those after a plain
    turn 1, and those of the same prompt from an empty cache."""
    from usd.events import Finished

    model, tok = gguf[QWEN]
    pair = pair_of(gguf[QWEN], gguf[QWEN])
    turn1 = [{"role": "user", "content": CHATS[1]}]
    got = {}
    for algorithm in ("standard", "none", "forgotten"):
        model.forget()
        events = list(
            api.stream(
                pair,
                messages=turn1,
                algorithm=algorithm.replace("forgotten", "none"),
                draft_tokens=4,
                max_new_tokens=MAX_NEW,
            )
        )
        done = events[-1]
        assert isinstance(done, Finished) and done.stats.stop_reason == "eos"
        if algorithm == "standard":
            assert _accepted_a_drafted_end(events[:-1]), "the test needs a speculative turn that accepted its end"
        if algorithm == "forgotten":
            model.forget()
        turn2 = [*turn1, {"role": "assistant", "content": done.text}, {"role": "user", "content": "And 23 * 17?"}]
        ids = tok.apply_chat_template(turn2, tokenize=False, add_generation_prompt=True)
        got[algorithm] = _next_logits(model, tok.encode(ids, add_special_tokens=False))
    for algorithm in ("standard", "forgotten"):
        gap = float((got[algorithm] - got["none"]).abs().max())
        assert torch.equal(got[algorithm], got["none"]), f"turn 2 after {algorithm}: {gap:.3g} logits apart"


@pytest.mark.real_models
@needs_llama
def test_a_multi_turn_greedy_chat_is_the_same_under_every_algorithm(gguf):
    """Three turns, each algorithm running every turn of its own conversation: every turn's answer equals the one
    plain decoding gives (on one loaded pair, whose caches hold what earlier conversations left)."""
    pair = pair_of(gguf[QWEN], gguf[SMOL])
    questions = [CHATS[1], "And 23 * 17? Answer in one sentence.", "Write both products as a Python list."]

    def conversation(algorithm):
        messages, answers = [], []
        for q in questions:
            messages.append({"role": "user", "content": q})
            done = api.generate(pair, messages=messages, algorithm=algorithm, max_new_tokens=MAX_NEW)
            answers.append(done.target_ids)
            messages.append({"role": "assistant", "content": done.text})
        return answers

    plain = conversation("none")
    for algorithm in ("tli", "slem", "auto", "none"):
        assert conversation(algorithm) == plain, f"{algorithm}: a turn differs from plain decoding's"


def test_a_build_with_amx_kernels_but_without_the_patch_is_refused_with_how_to_rebuild(monkeypatch):
    """llama.cpp's AMX kernels built by GCC 12 without the patch die on their first tile load (a general protection
    fault kills the process, no error to catch), and their buffer would take every model's weights off the kernels
    the exactness rule covers: such a build is refused by name with the command that rebuilds it without them. The
    patched build (./dev.sh builds AMX kernels where the CPU has them) is taken, its switch found."""
    from pathlib import Path

    from usd.runners.llamacpp import binding

    plain = b"CPU : SSE3 = 1 | AVX2 = 1 | AVX512 = 1 | AVX512_VNNI = 1 | LLAMAFILE = 1 | REPACK = 1 | "
    with_amx = plain.replace(b"LLAMAFILE", b"AMX_INT8 = 1 | LLAMAFILE")
    assert binding._amx_switch(plain) is None
    binding.library()  # the patched library, loaded: its switch is found by name
    assert binding._amx_switch(with_amx) is not None

    def no_symbol(name):
        raise AttributeError(f"{name}: undefined symbol: ggml_cpu_set_amx_weights")

    monkeypatch.setattr(binding.ctypes, "CDLL", no_symbol)
    with pytest.raises(llamacpp.LlamaCppUnavailable, match="AMX kernels but without usd-chat's patch") as refused:
        binding._amx_switch(with_amx)
    assert binding.NO_AMX in str(refused.value) and "./dev.sh setup" in str(refused.value)
    dev_sh = (Path(__file__).resolve().parent.parent / "dev.sh").read_text()
    assert "-mno-amx" not in dev_sh and "ggml_cpu_set_amx_weights" in dev_sh


def test_prompts_go_to_amx_tiles_only_where_the_switch_turns_them_on(monkeypatch):
    """A twin per model only where the patch's switch turns the AMX buffer on (the operating system may refuse the
    tiles), and not with USD_AMX_PREFILL=0, which side-by-side measurements use; each says why."""
    from usd.runners.llamacpp import binding

    monkeypatch.delenv(binding.AMX_PREFILL_ENV, raising=False)
    set_to: list[int] = []
    on = binding._amx_prefill(lambda value: set_to.append(value) or value)
    assert on["amx_switch"] is not None and on["amx_why"] == "" and set_to == [1, 0]
    assert binding._amx_prefill(lambda value: 0) == {
        "amx_switch": None,
        "amx_why": "the operating system refused this process the AMX tiles",
    }
    assert binding._amx_prefill(None)["amx_switch"] is None
    monkeypatch.setenv(binding.AMX_PREFILL_ENV, "0")
    assert binding._amx_prefill(lambda value: value) == {"amx_switch": None, "amx_why": "USD_AMX_PREFILL=0"}


needs_amx_twin = pytest.mark.skipif(
    not (llamacpp.available() and llamacpp.amx_prefill()),
    reason="no AMX tiles here (this CPU, this build or USD_AMX_PREFILL=0): models read prompts on the row kernels",
)


@pytest.mark.real_models
@needs_llama
@needs_amx_twin
def test_a_model_reads_its_prompts_on_its_twin_and_its_steps_and_verifies_on_its_own_weights(gguf, monkeypatch):
    """Where the CPU has AMX every model loads a twin (twin.py): the calls on the prefill kernels run there, plain
    steps and verifies never do, and the twin's rows have the same bits in one call as one at a time (a refeed that
    cuts a prefill run anew gets them again)."""
    model, tok = gguf[QWEN]
    twin = model.twin
    assert twin is not None and twin.row_gap(model.n_vocab) == 0.0
    calls: list[int] = []
    decode = twin.decode

    def counted(cache, tokens, *rest):
        calls.append(len(tokens))
        return decode(cache, tokens, *rest)

    monkeypatch.setattr(twin, "decode", counted)
    model.forget()
    ctx = model.new_context(tok.encode(LONG)[:120])
    ctx.forward(keep=1)
    ctx.ids.append(5)
    ctx.forward(keep=1)  # a plain step
    ctx.ids.extend([5, 6, 7])
    ctx.forward(keep=3)  # a verify
    assert calls == [120]


@pytest.mark.real_models
@needs_llama
@needs_amx_twin
def test_a_twin_whose_rows_differ_at_load_is_dropped_and_the_load_line_says_why(catalog, gguf, monkeypatch):
    """The first twin a process loads checks its rows; rows that differ between batches (a CPU where the AMX kernels'
    premises fail) end the twins for the process: the model reads its prompts on its own weights, and the load line
    says why."""
    from usd.runners.llamacpp import binding
    from usd.runners.llamacpp import model as model_module
    from usd.runners.llamacpp.twin import Twin

    monkeypatch.setattr(model_module, "_twin_checked", False)
    monkeypatch.setattr(Twin, "row_gap", lambda self, n_vocab: 0.5)
    kept = {key: binding._state[key] for key in ("amx_switch", "amx_why")}
    lines: list[str] = []
    try:
        loaded = load_model(catalog.get(SMOL), device="cpu", precision="gguf", log=lines.append).model
        assert loaded.twin is None and not llamacpp.amx_prefill()
        assert any("AMX tiles' rows differed by 0.5 logits between batches" in line for line in lines), lines
    finally:
        binding._state.update(kept)  # twins on again, for the tests after this one
    assert llamacpp.amx_prefill()


@pytest.mark.real_models
@needs_llama
@needs_amx_twin
def test_a_twin_reads_a_prompt_after_torch_used_the_amx_tiles_on_the_same_thread(catalog, real_paths):
    """oneDNN's kernels under torch release the AMX tiles when they are done; llama.cpp's AMX kernels configured them
    once a thread, and their next tile instruction on that thread was illegal, which killed the process (the app
    runs torch and llama.cpp on the same worker threads). The patch loads the config at every call. In a child
    process, since the failure is a signal."""
    import subprocess
    import sys

    script = f"""
import torch
from usd.catalog import load_catalog
from usd.runners import llamacpp
from usd.store import gguf_file
model = llamacpp.LlamaCppModel(gguf_file(load_catalog().get({SMOL!r}), log=lambda m: None), n_ctx=1024)
ids = [(7 * i + 1000) % model.n_vocab for i in range(64)]
prompt = lambda: model.new_context(ids).forward(keep=1)
first = prompt()
model.forget()
torch.nn.functional.linear(torch.randn(256, 1024, dtype=torch.bfloat16), torch.randn(1024, 1024, dtype=torch.bfloat16))
assert torch.equal(prompt(), first)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-2000:]}"
