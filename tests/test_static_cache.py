"""The decoding steps a GPU may choose at load time (usd/runners/transformers/static_cache.py and steps.py), run on this
CPU with tiny models: a static cache, and one whose one-token step is compiled. The same bars as transformers' own
cache: the logits of a context that grows, rolls back and is reused are what a fresh evaluation gives; every algorithm's
greedy output is plain greedy's; sampling is distributed as plain sampling. And the choice between kinds is the measured
fastest, cached, and survives a kind that fails.
"""

from __future__ import annotations

import gc
import json
import random

import pytest
import tiny_tokenizers as tiny
import torch
from test_tiny_decoder import ALPHA, PROMPT, PROMPTS, build_pairs, exact_joint, p_value, run, sample_two
from tiny_pairs import tiny_pair

from usd.runners.transformers import Context, TransformersRunner, static_cache, steps
from usd.runners.transformers.static_cache import MIN_POSITIONS, StaticContext, size_of

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    t = tiny.target()
    target, _ = tiny_pair(t, t)
    return target


def fresh_logits(model, ids: list[int]) -> torch.Tensor:
    return Context(model, ids).forward()


@pytest.mark.parametrize("kind", ["static", "compiled"])
def test_a_context_that_grows_and_rolls_back_has_a_fresh_evaluations_logits(model, kind):
    """A long generation with rejections (random rollbacks of 1-5 positions) past the first cache size: every
    step's logits equal those of one forward over the same prefix on transformers' own cache."""
    rng = random.Random(0)
    ids = tiny.target().encode("def fibonacci(n):")
    ctx = TransformersRunner(model, kind).new_context(ids)
    assert isinstance(ctx, StaticContext) and (ctx.step is not None) == (kind == "compiled")
    ctx.forward(keep=1)
    seen = []
    while len(ctx.ids) < MIN_POSITIONS + 40:
        n = rng.choice([1, 1, 2, 4])  # single steps (compiled ones) and verifies
        ctx.ids += [rng.randrange(300) for _ in range(n)]
        seen.append((list(ctx.ids), ctx.forward(keep=n)))
        if rng.random() < 0.3:
            ctx.truncate(len(ctx.ids) - rng.randint(1, min(5, len(ctx.ids) - len(ids))))
    assert size_of(ctx.cache) == 2 * MIN_POSITIONS, "the cache grew once"
    for prefix, logits in seen[::7] + seen[-10:]:  # before and after the growth
        want = fresh_logits(model, prefix)[-len(logits) :]
        torch.testing.assert_close(logits, want, rtol=0, atol=1e-4)
        assert torch.equal(logits.argmax(-1), want.argmax(-1))


def test_a_dropped_context_gives_its_cache_back_and_the_next_starts_clean(model):
    runner = TransformersRunner(model, "static")
    ids = tiny.target().encode("The capital of France is")
    first = runner.new_context(ids + [5, 6, 7])
    first.forward()
    held = first.cache
    del first
    gc.collect()
    second = runner.new_context(ids)
    assert second.cache is held, "the pool hands the same tensors out again (a CUDA graph's addresses)"
    torch.testing.assert_close(second.forward(), fresh_logits(model, ids), rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def pairs_by_kind():
    built = {}
    for kind in ("static", "compiled"):
        pairs = build_pairs(60.0)
        for pair in pairs.values():
            pair.target_runner = TransformersRunner(pair.target, kind)
            pair.drafter_runner = TransformersRunner(pair.drafter, kind)
        built[kind] = pairs
    return built


@pytest.mark.parametrize("kind", ["static", "compiled"])
@pytest.mark.parametrize("key", ["byte-level", "sentencepiece", "same"])
def test_every_algorithm_equals_plain_greedy_on_static_caches(pairs_by_kind, kind, key):
    pair = pairs_by_kind[kind][key]
    algorithms = ["standard"] if key == "same" else ["tli", "slem"]
    for prompt in PROMPTS[:4]:
        _, plain = run(pair, prompt, algorithm="none", max_new_tokens=24)
        for algorithm in algorithms:
            _, done = run(pair, prompt, algorithm=algorithm, k=4, max_new_tokens=24, probe_first=False)
            assert done.target_ids == plain.target_ids, f"{algorithm} on {prompt!r} ({kind}): not plain greedy's"
            assert done.stats.drafted > 0


@pytest.fixture(scope="module")
def sampling_pair():
    return build_pairs(10.0)["byte-level"]


@pytest.mark.parametrize("kind", ["static", "compiled"])
@pytest.mark.parametrize("algorithm", ["tli", "slem"])
def test_sampling_on_static_caches_is_distributed_as_plain_sampling(sampling_pair, algorithm, kind):
    pair = sampling_pair
    joint = exact_joint(pair.target, pair.target_tokenizer.encode(PROMPT))
    pair.target_runner = TransformersRunner(pair.target, kind)
    pair.drafter_runner = TransformersRunner(pair.drafter, kind)
    counts, alpha = sample_two(pair, algorithm)
    assert 0.02 < alpha < 0.98
    p = p_value(counts, joint)
    assert p > ALPHA, f"{algorithm} ({kind}): p = {p:.1e}, observed {counts}"


def test_the_pool_hands_out_a_cache_of_exactly_the_size_asked_for(model):
    """Never a larger free one: attention runs over the whole static cache, so its size must depend on the positions
    alone, not on which caches earlier contexts gave back."""
    pool = static_cache.CachePool(model.config)
    big = pool.take(3 * MIN_POSITIONS)
    pool.give(big)
    small = pool.take(10)
    assert small is not big and size_of(small) == MIN_POSITIONS
    pool.give(small)
    assert pool.take(MIN_POSITIONS + 1) is not big
    assert pool.take(4 * MIN_POSITIONS) is big


def test_the_fastest_kind_is_chosen_only_beyond_the_margin():
    def timed(step, verify):
        return {"first_s": step, "step_s": step, "verify_s": verify}

    assert steps.best_kind({"dynamic": timed(10, 20), "static": timed(9, 19), "compiled": timed(2, 20)}) == ("compiled")
    assert steps.best_kind({"dynamic": timed(10, 20), "compiled": timed(9.5, 19)}) == "dynamic"
    assert steps.best_kind({"static": timed(1, 1)}) == "dynamic"


def test_the_choice_is_measured_once_cached_and_skips_a_kind_that_fails(model, tmp_path, monkeypatch):
    measured = []

    def fake_time_kind(runner):
        kind = runner.steps
        measured.append(kind)
        if kind == "compiled":
            raise RuntimeError("inductor could not compile this")
        return {"first_s": 1.0, "step_s": {"dynamic": 1.0, "static": 0.5}[kind], "verify_s": 1.0}

    monkeypatch.setattr(steps, "time_kind", fake_time_kind)
    said = []
    runner = steps.choose_steps(model, "tiny", "fp32", tmp_path, said.append)
    assert runner.steps == "static"
    assert measured == ["dynamic", "static", "compiled", "static"], "each kind timed, then the chosen one warmed up"
    assert any("compiled decoding steps do not run here" in s and "inductor could not compile" in s for s in said)
    assert isinstance(runner.new_context([1, 2]), StaticContext)
    assert steps.choose_steps(model, "tiny", "fp32", tmp_path, said.append).steps == "static"
    assert measured[4:] == ["static"], "read from the cache the second time, only warmed up"
    assert [c["kind"] for c in json.loads((tmp_path / steps.CACHE_FILE).read_text()).values()] == ["static"]
    assert type(TransformersRunner(model).new_context([1, 2])) is Context


def test_a_sliding_window_model_keeps_transformers_cache(model, monkeypatch):
    monkeypatch.setattr(model.config, "sliding_window", 512, raising=False)
    said = []
    assert steps.choose_steps(model, "tiny", "fp32", None, said.append).steps == "dynamic"
    assert "sliding window" in said[0]


def test_the_real_measurement_runs_every_kind(model):
    before = dict(vars(model))
    choice = steps.measure_kinds(model, "tiny", print)
    assert set(choice["timed"]) == set(static_cache.KINDS) and choice["kind"] in static_cache.KINDS
    assert vars(model).keys() == before.keys(), "measuring leaves the model as it was"


def test_generations_at_once_on_one_compiled_model_each_get_their_own_answer(pairs_by_kind):
    """Server slots share a model: its static caches come from one pool and its compiled step runs one call at a
    time (a CUDA graph writes every call's logits into the same buffers)."""
    from concurrent.futures import ThreadPoolExecutor

    pair = pairs_by_kind["compiled"]["byte-level"]
    want = {p: run(pair, p, algorithm="none", max_new_tokens=24)[1].target_ids for p in PROMPTS[:4]}

    def answer(prompt):
        return run(pair, prompt, algorithm="tli", k=3, max_new_tokens=24)[1].target_ids

    with ThreadPoolExecutor(4) as ex:
        got = dict(zip(want, ex.map(answer, want), strict=True))
    assert got == want
