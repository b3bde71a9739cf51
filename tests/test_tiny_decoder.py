"""The decode loop on tiny random models over the tokenizers built in tests/tiny_tokenizers.py: the fast tier's
counterpart of test_decoder_greedy.py and test_decoder_distribution.py (which use the real tokenizers or models).

Three pairs as in the slow tests: a byte-level target with a byte-level drafter of other merges (Qwen + SmolLM2),
with a SentencePiece drafter with byte fallback (SmolLM2 + Gemma), and with itself (`standard`).
- greedy: every algorithm's output is plain greedy's, token for token (the loop's own k = 0 path and transformers'
  generate), and speculation really happened (drafts, some accepted, some rejected);
- the rounds' emitted pieces add up to the answer: the same ids, the same text, never half a character;
- sampling: the first two tokens are distributed as plain sampling from the target (chi-square, as in
  test_decoder_distribution.py but with fewer samples), and the same check rejects a rejection sampler that draws
  from the wrong distribution, so it can fail.
"""

from __future__ import annotations

import codecs

import numpy as np
import pytest
import reference_sampling as reference
import tiny_tokenizers as tiny
import torch
from scipy.stats import chisquare
from tiny_pairs import how, tiny_pair

import usd.decoder
from usd.decoder import stream
from usd.events import Finished, Round
from usd.pair import Pair, bytes_of
from usd.sampling import SamplingParams, probabilities, sample, uniform

PROMPTS = [
    "def fibonacci(n):",
    "The capital of France is",
    "日本の首都は",
    "Emoji party: 🎉🌟 Ω",  # 🌟 and Ω are outside every tiny vocabulary: bare bytes, <0xNN> pieces
    "Écrivez une phrase en français : ",
    "x =     [1,    2,\n\n\n    3]",
    "Count: one two three",
]
MAX_NEW = 24
ALGORITHMS = {
    "byte-level": ["tli", "slem", "auto"],
    "sentencepiece": ["tli", "slem", "auto"],
    "same": ["standard", "auto"],
}


pytestmark = pytest.mark.usefixtures("one_thread")


def build_pairs(sharpness: float, attention: float = 0.05) -> dict[str, Pair]:
    t = tiny.target()
    drafters = {"byte-level": tiny.drafter_byte_level(), "sentencepiece": tiny.drafter_sentencepiece(), "same": t}
    out = {}
    for key, d in drafters.items():
        target, drafter = tiny_pair(t, d, seed=0, sharpness=sharpness, attention=attention)
        for m in (target, drafter):  # generate() stops at the tokenizer's eos, as a real checkpoint's config says
            m.generation_config.eos_token_id = m.config.eos_token_id
            m.generation_config.pad_token_id = m.config.eos_token_id
        out[key] = Pair(target, t, drafter, d, "tiny-target", f"tiny-{key}")
    return out


@pytest.fixture(scope="module")
def pairs():
    """Peaked models (tiny_pair's default sharpness): wide margins between the best two tokens, as greedy needs; with
    attention at full strength, so that a wrong row in a cache changes the answer (`test_a_stale_row_...`)."""
    return build_pairs(60.0, attention=1.0)


@pytest.fixture(scope="module")
def sampling_pairs():
    """Flatter models: the first two tokens spread over all sixteen top-4 cells, and every drafter here has its
    drafts accepted 20-50% of the time on PROMPT (sharpness 60 left half the cells below five expected counts)."""
    return build_pairs(10.0)


def run(pair, prompt, **kwargs) -> tuple[list[Round], Finished]:
    ids, dids = pair.target_tokenizer.encode(prompt), pair.drafter_tokenizer.encode(prompt)
    loop = {key: kwargs.pop(key) for key in ("probe_first", "cancel", "memory") if key in kwargs}
    events = list(stream(pair, ids, dids, how(**kwargs), **loop))
    assert all(isinstance(e, Round) for e in events[:-1]) and isinstance(events[-1], Finished)
    return events[:-1], events[-1]


@torch.no_grad()
def plain_greedy(pair, prompt, n=MAX_NEW) -> list[int]:
    ids = pair.target_tokenizer.encode(prompt)
    out = pair.target.generate(
        torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), max_new_tokens=n, do_sample=False
    )[0, len(ids) :].tolist()
    eos = pair.eos_ids()
    return next((out[:i] for i, t in enumerate(out) if t in eos), out)


def assert_pieces_are_the_text(pair, rounds, done) -> None:
    """The emitted pieces are the answer's tokens, and after each piece the text shown so far is every complete
    character of the answer's bytes so far: a character split across tokens waits for its rest, never shows half
    (a random model also says bytes that are no UTF-8 at all: those show as U+FFFD, in the final text too)."""
    pieces = [p for r in rounds for p in r.emitted]
    assert [p.target_id for p in pieces] == list(done.target_ids)
    data, shown = b"", ""
    for p in pieces:
        data += bytes_of(pair.target_bytes, p.target_id)
        shown += p.text
        assert shown == codecs.getincrementaldecoder("utf-8")("replace").decode(data), f"at piece {p}"
    # max_new_tokens can end inside a character: the pieces hold it back, the final text shows U+FFFD
    assert done.text == shown or done.text == shown + "\ufffd"


@pytest.mark.parametrize("key", list(ALGORITHMS))
@pytest.mark.parametrize("prompt", PROMPTS, ids=range(len(PROMPTS)))
def test_every_algorithm_equals_plain_greedy(pairs, key, prompt):
    pair = pairs[key]
    ref = plain_greedy(pair, prompt)
    rounds, plain = run(pair, prompt, algorithm="none", max_new_tokens=MAX_NEW)
    assert list(plain.target_ids) == ref
    assert_pieces_are_the_text(pair, rounds, plain)
    for algorithm in ALGORITHMS[key]:
        for k in (4, "auto") if algorithm != "auto" else ("auto",):
            # round 0 drafts too: its verify's first row is the prompt's kept logits (runners.kept.KeptLogits); and
            # where an answer turns to bare bytes at once, it is the one round slem can draft in
            rounds, done = run(pair, prompt, algorithm=algorithm, k=k, max_new_tokens=MAX_NEW, probe_first=False)
            what = f"{algorithm} k={k} on {prompt!r}"
            assert done.target_ids == plain.target_ids and done.text == plain.text, f"{what}: not plain greedy's"
            assert done.stats.stop_reason == plain.stats.stop_reason
            assert_pieces_are_the_text(pair, rounds, done)
            if algorithm != "auto":
                assert all(r.algorithm in ("none", algorithm) for r in rounds)
                assert done.stats.drafted > 0, f"{what}: nothing was drafted"


def test_a_stale_row_left_by_a_rollback_fails_the_identity_check(pairs, monkeypatch):
    """The power of the identity test above: a rollback that leaves the last rejected draft's row in the cache (the
    ids cut back, the cache one row short of it) must change some answer."""
    from usd.runners.transformers import Context

    def one_row_short(self, drop):
        if drop > 1:
            self.cache.crop(1 - drop)
        self.cached -= drop
        self.fed_since_crop = 0

    plain = {}
    for key in ALGORITHMS:
        for prompt in PROMPTS:
            plain[key, prompt] = run(pairs[key], prompt, algorithm="none", max_new_tokens=MAX_NEW)[1].target_ids
    monkeypatch.setattr(Context, "_rollback", one_row_short)
    differ = 0
    for key in ALGORITHMS:
        algorithm = "standard" if key == "same" else "tli"
        for prompt in PROMPTS:
            _, done = run(pairs[key], prompt, algorithm=algorithm, k=4, max_new_tokens=MAX_NEW, probe_first=False)
            differ += done.target_ids != plain[key, prompt]
    assert differ >= 3, f"a stale row changed {differ} of {len(ALGORITHMS) * len(PROMPTS)} answers"


@pytest.mark.parametrize(("algorithm", "k"), [("none", None), ("tli", 3)])
def test_the_prompt_is_fed_in_one_forward_and_never_again(pairs, algorithm, k):
    """As plain tools read a prompt: whole, its last position's logits choosing the first token; round 0 reads them
    again from the context (runners.kept.KeptLogits), so a plain round 0 feeds nothing and a verify only its drafts."""
    pair = pairs["byte-level"]
    fed: list[int] = []
    hook = pair.target.register_forward_pre_hook(
        lambda _m, _args, kw: fed.append(kw["input_ids"].shape[1]), with_kwargs=True
    )
    try:
        rounds, _ = run(pair, PROMPTS[0], algorithm=algorithm, k=k, max_new_tokens=4)
    finally:
        hook.remove()
    n = len(pair.target_tokenizer.encode(PROMPTS[0]))
    first = rounds[0].drafted
    assert fed[0] == n and fed.count(n) == 1
    assert fed[1:] == [first] * bool(first) + [r.drafted + 1 for r in rounds[1:]]


def test_a_generation_times_a_plain_step_before_it_speculates(pairs):
    """probe_first: round 0 reads the prompt's logits and times nothing, so round 1 is plain too; a fixed-k run then
    has the step that c and v are counted in."""
    rounds, done = run(pairs["byte-level"], PROMPTS[0], algorithm="tli", k=3, max_new_tokens=10)
    assert [r.algorithm for r in rounds[:3]] == ["none", "none", "tli"]
    assert done.stats.c is not None and done.stats.v is not None


def test_the_stats_hold_the_prompts_forward_inside_the_answers_wall_time(pairs):
    """What plain decoding pays for this answer too (`Stats.plain_step_speedup`)."""
    _, done = run(pairs["byte-level"], PROMPTS[0], algorithm="tli", k=3, max_new_tokens=10)
    assert 0 < done.stats.prompt_s < done.stats.wall_s


def test_round_0_is_neither_a_step_nor_a_verify_of_its_k_in_the_stats():
    """Round 0 feeds one position less than its kind (the prompt's last came with the prompt): a plain one nothing, a
    drafting one only its drafts. Counted, it would make the step look free and c and v huge."""
    from usd.tally import Tally

    tally = Tally("tli")
    from usd.record import RoundRecord

    tally.record(RoundRecord("none", 0, 0, 0, verify_s=0.001, fed=0))
    tally.record(RoundRecord("tli", 3, 3, 1, draft_steps=3, draft_s=0.3, verify_s=0.12, fed=3))
    tally.record(RoundRecord("none", 0, 0, 0, verify_s=0.1, fed=1))
    tally.record(RoundRecord("tli", 3, 3, 3, draft_steps=3, draft_s=0.3, verify_s=0.2, fed=4))
    stats = tally.stats(8, None, 0.0, None)
    assert stats.step_s == pytest.approx(0.1)
    assert (stats.c, stats.v, stats.mean_k) == (pytest.approx(1.0), pytest.approx(2.0), 3.0)


def test_an_answer_with_few_plain_steps_measures_c_and_v_in_the_step_timed_at_load():
    """One plain step slowed by other work (0.4 s where a step takes 0.1) made the README's screenshot show a verify
    cheaper than a step and a gain where there was a loss; until the answer has MIN_PLAIN_STEPS of its own, the
    step timed at load is the unit, and from then on the answer's own."""
    from usd.record import RoundRecord
    from usd.tally import MIN_PLAIN_STEPS, Tally

    def tally_of(plain_steps: list[float]) -> Tally:
        tally = Tally("tli", step_at_load=0.1)
        tally.record(RoundRecord("none", 0, 0, 0, verify_s=0.001, fed=0))
        for s in plain_steps:
            tally.record(RoundRecord("none", 0, 0, 0, verify_s=s, fed=1))
        tally.record(RoundRecord("tli", 2, 2, 1, draft_steps=2, draft_s=0.06, verify_s=0.18, fed=3))
        return tally

    few = tally_of([0.4]).stats(4, None, 0.0, None)
    assert (few.step_s, few.c, few.v) == (0.1, pytest.approx(0.3), pytest.approx(1.8))
    own = tally_of([0.12] * MIN_PLAIN_STEPS).stats(7, None, 0.0, None)
    assert own.step_s == pytest.approx(0.12) and own.v == pytest.approx(1.5)


@pytest.mark.parametrize("key", list(ALGORITHMS))
def test_speculation_both_accepts_and_rejects(pairs, key):
    """Over all prompts, each drafting algorithm's drafts are partly kept and partly thrown away: the identity above
    covers both paths of the acceptance rule, not only one. (auto's rounds are these algorithms' rounds; how much it
    drafts depends on timings, and on tiny models speculation loses on time, so it may draft too little to tell.)"""
    pair = pairs[key]
    for algorithm in (a for a in ALGORITHMS[key] if a != "auto"):
        drafted = accepted = 0
        kinds = set()
        for prompt in PROMPTS:
            rounds, done = run(pair, prompt, algorithm=algorithm, k=4, max_new_tokens=MAX_NEW, probe_first=False)
            drafted, accepted = drafted + done.stats.drafted, accepted + done.stats.accepted
            kinds |= {p.kind for r in rounds for p in r.pieces}
        assert 0 < accepted < drafted, f"{algorithm}: {accepted} of {drafted} drafted tokens accepted"
        assert {"accepted", "rejected", "resampled"} <= kinds, f"{algorithm}: {kinds}"


# --- sampling --------------------------------------------------------------------------------------------------------

PROMPT = "The capital of France is"
N = 400  # test_decoder_distribution.py takes 1,000 per case on the real tokenizers
ALPHA = 1e-4  # false alarms per test
TOP4 = {"temperature": 1.0, "top_k": 4}
"""The settings of most cases: the first two tokens spread over sixteen cells."""


def exact_joint(target, ids, **settings) -> dict[tuple[int, ...], float]:
    """The target's exact joint distribution of the first two tokens, from tests/reference_sampling.py (numpy, not
    usd.sampling: a bug there must not be in the reference too)."""

    @torch.no_grad()
    def next_logits(prefix):
        return target(torch.tensor([prefix])).logits[0, -1].float().numpy()

    eos = frozenset([target.config.eos_token_id])
    return reference.exact_joint(next_logits, ids, eos, **(settings or TOP4))


def check_fails(counts, joint) -> bool:
    """Whether the goodness-of-fit check rejects `counts`: outputs the target cannot produce, or a p-value below
    ALPHA (the power tests below)."""
    return not set(counts) <= set(joint) or p_value(counts, joint) < ALPHA


def sample_two(pair, algorithm, k=3, seeds=range(N), prompt=None, sources=None, **settings) -> tuple[dict, float]:
    """The first two tokens of N seeded generations, and their acceptance; `prompt`: (target ids, drafter ids)
    instead of PROMPT's; `sources` collects what drafted."""
    ids, dids = prompt or (pair.target_tokenizer.encode(PROMPT), pair.drafter_tokenizer.encode(PROMPT))
    counts, drafted, accepted = {}, 0, 0
    for seed in seeds:
        params = SamplingParams(**(settings or TOP4), seed=seed)
        *_, done = stream(
            pair, ids, dids, how(algorithm=algorithm, k=k, params=params, max_new_tokens=2), probe_first=False
        )
        counts[done.target_ids] = counts.get(done.target_ids, 0) + 1
        drafted += done.stats.drafted
        accepted += done.stats.accepted
        if sources is not None:
            sources.update(a for a, n in done.stats.drafted_by_algorithm.items() if n)
    return counts, accepted / max(1, drafted)


def p_value(counts, joint) -> float:
    """Chi-square goodness of fit; cells expected fewer than 5 times are pooled. Outputs the target cannot produce
    fail at once."""
    assert set(counts) <= set(joint), f"outputs the target cannot produce: {set(counts) - set(joint)}"
    n = sum(counts.values())
    obs, exp, pool_o, pool_e = [], [], 0, 0.0
    for cell in sorted(joint, key=joint.get, reverse=True):
        e = joint[cell] * n
        if e >= 5:
            obs.append(counts.get(cell, 0))
            exp.append(e)
        else:
            pool_o += counts.get(cell, 0)
            pool_e += e
    if pool_e > 0:
        obs.append(pool_o)
        exp.append(pool_e)
    assert len(obs) >= 4, "too few cells for the test to mean anything"
    exp = [e * sum(obs) / sum(exp) for e in exp]
    return float(chisquare(obs, exp).pvalue)


CASES = {
    # the first two tokens at T = 1, top-k 4, three drafts a round
    "byte-level tli": ("sampling_pairs", "byte-level", "tli", 3, TOP4),
    "byte-level slem": ("sampling_pairs", "byte-level", "slem", 3, TOP4),
    "byte-level auto": ("sampling_pairs", "byte-level", "auto", 3, TOP4),
    "sentencepiece tli": ("sampling_pairs", "sentencepiece", "tli", 3, TOP4),
    "sentencepiece slem": ("sampling_pairs", "sentencepiece", "slem", 3, TOP4),
    "same standard": ("sampling_pairs", "same", "standard", 3, TOP4),
    "byte-level none": ("sampling_pairs", "byte-level", "none", 3, TOP4),
    # one draft a round: when it is accepted, the second token is the bonus
    "bonus tli": ("sampling_pairs", "byte-level", "tli", 1, TOP4),
    "bonus slem": ("sampling_pairs", "byte-level", "slem", 1, TOP4),
    "bonus standard": ("sampling_pairs", "same", "standard", 1, TOP4),
    # adaptive draft length (with its confidence stop), top-p, temperatures other than 1
    "adaptive auto, T 0.7, top-p 0.9": (
        "confident_pairs",
        "byte-level",
        "auto",
        "auto",
        {"temperature": 0.7, "top_p": 0.9},
    ),
    "adaptive tli, T 1.5, top-k 8, top-p 0.95": (
        "confident_pairs",
        "byte-level",
        "tli",
        "auto",
        {"temperature": 1.5, "top_k": 8, "top_p": 0.95},
    ),
    "adaptive standard, T 0.8, top-p 0.8": (
        "confident_pairs",
        "same",
        "standard",
        "auto",
        {"temperature": 0.8, "top_p": 0.8},
    ),
}


@pytest.fixture(scope="module")
def confident_pairs():
    """Sharper than sampling_pairs: drafters confident enough at the prompt that adaptive k's confidence stop (the
    drafter's top probability below 0.25) leaves drafts to verify, and still a dozen cells of the first two tokens."""
    return build_pairs(20.0)


@pytest.mark.parametrize("case", list(CASES))
def test_first_two_tokens_distributed_as_plain_sampling(case, request):
    fixture, key, algorithm, k, settings = CASES[case]
    pair = request.getfixturevalue(fixture)[key]
    if algorithm == "auto":  # switching between plain, tli and slem; the seeds only make it repeatable
        request.getfixturevalue("auto_switching")
    joint = exact_joint(pair.target, pair.target_tokenizer.encode(PROMPT), **settings)
    counts, alpha = sample_two(pair, algorithm, k, **settings)
    if algorithm != "none":
        assert 0.02 < alpha < 0.98, f"acceptance {alpha:.2f}: both the accept and the reject paths must run"
    p = p_value(counts, joint)
    assert p > ALPHA, f"{case}: p = {p:.1e}, observed {counts}"
    if algorithm == "auto":
        assert {"none", "tli", "slem"} <= set(pair.memory.schedule.modes)


def test_seeded_auto_mixing_plain_slem_and_lookups_is_distributed_as_plain_sampling(confident_pairs, monkeypatch):
    """Under a seed auto keeps to plain decoding, slem and the lookups (whose answers the seed fixes, however rounds
    are cut): the real seeded schedule, switching among them in a random order (the lookups where they find something:
    the echoing prompt), with adaptive k."""
    import random

    real = usd.decoder.Schedule
    order = random.Random(1)

    def switching(*args, **kwargs):
        schedule = real(*args, **kwargs)
        assert schedule.modes == ["none", "slem", "ngram", "suffix"], "a seeded auto mixes seed-stable modes only"
        schedule._choose = lambda modes: order.choice(modes)
        schedule._fit = lambda mode: schedule.k_for(mode)  # at their own k, whatever the probing budget says
        return schedule

    monkeypatch.setattr(usd.decoder, "Schedule", switching)
    pair = confident_pairs["byte-level"]
    ids = echoing_prompt(pair)
    joint, sources = exact_joint(pair.target, ids), set()
    counts, alpha = sample_two(pair, "auto", "auto", prompt=both_prompts(pair, ids), sources=sources)
    assert 0.02 < alpha < 0.98 and sources == {"slem", "ngram", "suffix"}
    assert p_value(counts, joint) > ALPHA


@pytest.fixture(scope="module")
def duplicate_spellings():
    """The SentencePiece pair, with six tokens that the drafter spells twice (as a piece and as its byte-fallback
    <0xNN>, both in the shared vocabulary, so both map to one target id) made the most likely at the prompt: the
    target's LM-head rows of its six likeliest tokens copied to them, and to both spellings in the drafter. Under tli
    their proposal probability is the sum of both spellings', which a rule taking one spelling's would halve."""
    pair = build_pairs(20.0)["sentencepiece"]
    d_ids, t_ids, _ = pair.intersection()
    spellings: dict[int, list[int]] = {}
    for d, t in zip(d_ids.tolist(), t_ids.tolist(), strict=True):
        spellings.setdefault(t, []).append(d)
    twice = sorted(t for t, ds in spellings.items() if len(ds) > 1)[:6]
    with torch.no_grad():
        logits = pair.target(torch.tensor([pair.target_tokenizer.encode(PROMPT)])).logits[0, -1]
        likeliest = [t for t in logits.argsort(descending=True).tolist() if t not in twice][: len(twice)]
        target_rows, drafter_rows = pair.target.lm_head.weight, pair.drafter.lm_head.weight
        for t, row in zip(twice, likeliest, strict=True):
            target_rows[t] = target_rows[row]
            for d in spellings[t]:
                drafter_rows[d] = target_rows[t]
    return pair, twice


def test_draft_tokens_proposes_the_summed_probability_of_every_spelling(duplicate_spellings):
    """q over target ids, built by draft_tokens, against the drafter's own distribution over its ids: each target
    id gets the sum over the drafter ids that spell it."""
    from usd.drafters import draft_tokens
    from usd.runners.transformers import Context

    pair, twice = duplicate_spellings
    params = SamplingParams(temperature=1.0, seed=0)
    dids = pair.drafter_tokenizer.encode(PROMPT)
    draft = draft_tokens(pair, Context(pair.drafter, dids), 1, params, np.random.default_rng(0), pair.eos_ids())
    with torch.no_grad():
        logits = pair.drafter(torch.tensor([dids])).logits[0, -1].numpy()
    d_ids, t_ids, _ = pair.intersection()
    q_own = reference.reference_p(logits[d_ids.numpy()])  # the drafter's distribution on the shared vocabulary
    for t in twice:
        spelled = (t_ids == t).numpy()
        assert spelled.sum() > 1 and float(draft.q[0][t]) == pytest.approx(q_own[spelled].sum(), rel=1e-4)
    assert float(draft.q[0].sum()) == pytest.approx(1.0, rel=1e-4)


FULL = {"temperature": 1.0}
"""No top-k: the drafter's second spellings are inside what it samples from."""


def first_token_check(pair, **settings) -> tuple[float, bool]:
    """(acceptance, whether the check rejects) for the first token of N tli generations (k = 1) against the
    target's exact distribution (its whole vocabulary has mass without top-k: too many cells for two tokens)."""
    ids, dids = pair.target_tokenizer.encode(PROMPT), pair.drafter_tokenizer.encode(PROMPT)
    with torch.no_grad():
        p1 = reference.reference_p(pair.target(torch.tensor([ids])).logits[0, -1].numpy(), **settings)
    eos = pair.target.config.eos_token_id
    exact = {((x,) if x != eos else ()): float(p1[x]) for x in np.flatnonzero(p1).tolist()}
    counts: dict = {}
    drafted = accepted = 0
    for seed in range(N):
        params = SamplingParams(**settings, seed=seed)
        *_, done = stream(
            pair, ids, dids, how(algorithm="tli", k=1, params=params, max_new_tokens=1), probe_first=False
        )
        counts[done.target_ids] = counts.get(done.target_ids, 0) + 1
        drafted, accepted = drafted + done.stats.drafted, accepted + done.stats.accepted
    return accepted / max(1, drafted), check_fails(counts, exact)


def test_tli_with_duplicate_spellings_is_distributed_as_plain_sampling(duplicate_spellings):
    alpha, fails = first_token_check(duplicate_spellings[0], **FULL)
    assert 0.02 < alpha < 0.98 and not fails


# --- the checks above can fail: each catches a broken rule -------------------------------------------------------


def test_the_check_catches_one_spellings_probability_for_the_sum(duplicate_spellings, monkeypatch):
    """tli's q with each target id given one of its spellings' probability instead of their sum."""
    import usd.drafters

    def one_spelling(q_shared, t_ids, vocab_t):
        return torch.zeros(vocab_t).index_copy_(0, t_ids, q_shared)  # the last spelling of a target id wins

    monkeypatch.setattr(usd.drafters, "target_proposal", one_spelling)
    assert first_token_check(duplicate_spellings[0], **FULL)[1]


@pytest.mark.parametrize("key", ["byte-level", "sentencepiece"])
def test_the_check_catches_resampling_from_p_instead_of_the_residual(sampling_pairs, key, monkeypatch):
    """The power of the test above at this N. The classic bug: at a rejection, draw from p instead of
    normalize(max(0, p - q)). Every output stays one the target can produce, so only the chi-square can tell; it
    does, by far (p near 1e-18 with the byte-level drafter, 1e-37 with SentencePiece)."""

    def wrong_residual(p, q, drafted, generator):
        for i, d in enumerate(drafted):
            if uniform(generator) >= min(1.0, float(p[i, d]) / float(q[i, d])):
                return i, sample(p[i], generator), "resampled"
        return len(drafted), sample(p[len(drafted)], generator), "bonus"

    monkeypatch.setattr(usd.decoder, "rejection_sampling", wrong_residual)
    pair = sampling_pairs[key]
    joint = exact_joint(pair.target, pair.target_tokenizer.encode(PROMPT))
    counts, _ = sample_two(pair, "tli")
    assert set(counts) <= set(joint) and p_value(counts, joint) < ALPHA


@pytest.mark.parametrize("algorithm", ["tli", "slem"])
def test_the_check_catches_a_bonus_that_repeats_the_last_candidate(sampling_pairs, algorithm, monkeypatch):
    """After a fully accepted draft the bonus is a draw from p past the last candidate; a rule that emitted the last
    candidate again instead must fail the bonus cases above."""
    name = {"tli": "rejection_sampling", "slem": "exact_match"}[algorithm]
    real = getattr(usd.decoder, name)

    def repeat_last(p, *args):
        accepted, token, kind = real(p, *args)
        drafted = args[-2]  # both rules take (p, [q,] drafted, generator(s))
        return (accepted, drafted[-1], kind) if kind == "bonus" and drafted else (accepted, token, kind)

    monkeypatch.setattr(usd.decoder, name, repeat_last)
    pair = sampling_pairs["byte-level"]
    joint = exact_joint(pair.target, pair.target_tokenizer.encode(PROMPT))
    counts, _ = sample_two(pair, algorithm, 1)
    assert check_fails(counts, joint)


def test_a_temperature_near_zero_decodes_greedily_never_nan(pairs):
    """Issue 27 point 8 (and issue 23 point 4): temperatures inside the documented range but below
    settings.GREEDY_BELOW decode as 0 does. Dividing by 1e-40 overflowed the logits to inf and the probabilities to
    NaN, and the answer came out as padding tokens."""
    pair = pairs["byte-level"]
    logits = pair.target(torch.tensor([pair.target_tokenizer.encode(PROMPTS[0])])).logits[0, -1:].detach()
    for t in (1e-40, 1e-38, 1e-20, 9.9e-6):
        params = SamplingParams(temperature=t, seed=1)
        assert params.greedy
        p = probabilities(logits, params)
        assert torch.isfinite(p).all() and p.sum() == 1 and int(p.argmax()) == int(logits.argmax())
    assert not SamplingParams(temperature=1e-5).greedy
    assert torch.isfinite(probabilities(logits, SamplingParams(temperature=1e-5))).all()
    _, greedy = run(pair, PROMPTS[0], algorithm="none", max_new_tokens=MAX_NEW)
    for algorithm in ("none", "tli", "slem"):
        params = SamplingParams(temperature=1e-40, seed=5)
        _, tiny_t = run(pair, PROMPTS[0], algorithm=algorithm, k=3, params=params, max_new_tokens=MAX_NEW)
        assert tiny_t.target_ids == greedy.target_ids and tiny_t.text == greedy.text, algorithm


class _CountingBytes(bytes):
    """The committed answer, counting the times it is copied whole (each `+` on it makes a new one)."""

    copies = 0

    def __add__(self, other):
        _CountingBytes.copies += 1
        return _CountingBytes(bytes(self) + other)


def test_the_stop_check_reads_only_the_tail_of_a_long_answer(pairs):
    """Issue 27 point 1: the stop check joined the whole committed answer to each emitted token, so an answer of n
    tokens cost n copies of itself (quadratic); it reads the stop strings' reach only. Committing a round appends to
    the answer once, which is the one copy left."""
    from usd.decoder import Answer, Verdict
    from usd.drafters import Draft

    pair = pairs["byte-level"]
    answer = Answer(pair, max_new_tokens=1000, stop_strings=("@@stop@@", "never"))
    answer.committed = _CountingBytes(b"x" * 100_000)
    word = pair.target_tokenizer.encode(" the")[0]
    candidates = [word] * 6
    draft = Draft(candidates=candidates, q=[], drafter_ids=[(c,) for c in candidates], steps=6)
    _CountingBytes.copies = 0
    pieces = answer.commit(draft, Verdict(accepted=6, token=word, kind="bonus"), round_index=0)
    assert len(pieces) == 7 and answer.stop_reason is None
    assert _CountingBytes.copies == 1, f"the answer was copied {_CountingBytes.copies} times in one round"


# --- ngram: drafting without a drafter model (usd/ngram.py) --------------------------------------------------------


def target_alone(pair) -> Pair:
    """The pair's target with no drafter loaded: ngram needs none."""
    return Pair(pair.target, pair.target_tokenizer, target_name="tiny-target")


def echoing_prompt(pair) -> list[int]:
    """PROMPT, the target's own greedy two tokens after it, then PROMPT again: at its end the lookup finds PROMPT's
    earlier occurrence and proposes what followed it, which the target may or may not say again."""
    ids = pair.target_tokenizer.encode(PROMPT)
    with torch.no_grad():
        out = pair.target.generate(torch.tensor([ids]), max_new_tokens=2, do_sample=False)[0, len(ids) :].tolist()
    return ids + out + ids


@pytest.mark.parametrize("lookup", ["ngram", "suffix"])
@pytest.mark.parametrize("prompt", [*PROMPTS, None], ids=[*map(str, range(len(PROMPTS))), "echo"])
def test_lookups_equal_plain_greedy_without_a_drafter_model(pairs, prompt, lookup):
    alone = target_alone(pairs["byte-level"])
    ids = echoing_prompt(alone) if prompt is None else alone.target_tokenizer.encode(prompt)
    *_, plain = stream(alone, ids, None, how(algorithm="none", max_new_tokens=MAX_NEW))
    for k in (4, "auto"):
        events = list(stream(alone, ids, None, how(algorithm=lookup, k=k, max_new_tokens=MAX_NEW), probe_first=False))
        rounds, done = events[:-1], events[-1]
        assert done.target_ids == plain.target_ids and done.text == plain.text, f"{lookup} k={k} on {prompt!r}"
        assert all(r.algorithm in ("none", lookup) for r in rounds)
        assert_pieces_are_the_text(alone, rounds, done)
        if prompt is None:
            assert done.stats.drafted > 0 and done.stats.accepted > 0, "the echo must be looked up and kept"


def sample_two_ngram(pair, ids, rule=None, seeds=range(N), algorithm="ngram", memory=None) -> tuple[dict, float]:
    counts, drafted, accepted = {}, 0, 0
    for seed in seeds:
        params = SamplingParams(**TOP4, seed=seed)
        *_, done = stream(
            pair,
            ids,
            None,
            how(algorithm=algorithm, k=2, params=params, max_new_tokens=2),
            probe_first=False,
            memory=memory,
        )
        counts[done.target_ids] = counts.get(done.target_ids, 0) + 1
        drafted += done.stats.drafted
        accepted += done.stats.accepted
    return counts, accepted / max(1, drafted)


@pytest.mark.parametrize("lookup", ["ngram", "suffix"])
def test_lookups_first_two_tokens_distributed_as_plain_sampling(sampling_pairs, lookup):
    alone = target_alone(sampling_pairs["byte-level"])
    ids = echoing_prompt(alone)
    joint = exact_joint(alone.target, ids)
    counts, alpha = sample_two_ngram(alone, ids, algorithm=lookup)
    assert 0.02 < alpha < 0.98, f"acceptance {alpha:.2f}: both the accept and the reject paths must run"
    p = p_value(counts, joint)
    assert p > ALPHA, f"{lookup}: p = {p:.1e}, observed {counts}"


class FrozenScope:
    """A suffix memory scope that holds given answers and keeps no new ones: every sample drafts from the same."""

    def __init__(self, *answers: list[int]):
        from usd.suffix import SuffixMemory

        self.scope = SuffixMemory().scope("tiny", "test")
        for answer in answers:
            self.scope.remember(answer)

    def occurrences(self, tail):
        return self.scope.occurrences(tail)

    def remember(self, ids):
        pass


def test_suffix_drafting_from_an_earlier_answer_is_distributed_as_plain_sampling(sampling_pairs):
    """Drafts from memory, not from the prompt: an earlier answer held PROMPT and the target's greedy two tokens after
    it, so at PROMPT's end the suffix source proposes those, which the target may or may not draw."""
    alone = target_alone(sampling_pairs["byte-level"])
    echo = echoing_prompt(alone)
    ids = alone.target_tokenizer.encode(PROMPT)
    counts, alpha = sample_two_ngram(alone, ids, algorithm="suffix", memory=FrozenScope(echo[: len(echo) - len(ids)]))
    assert 0.02 < alpha < 0.98, f"acceptance {alpha:.2f}: both the accept and the reject paths must run"
    p = p_value(counts, exact_joint(alone.target, ids))
    assert p > ALPHA, f"suffix from memory: p = {p:.1e}, observed {counts}"


def test_ngram_accepting_its_lookup_unchecked_fails_the_distribution_test(sampling_pairs, monkeypatch):
    """The power of the test above: a rule that keeps the looked-up first token whenever it is among the target's
    top-k (instead of only when it is the target's own draw) over-produces it."""
    real = usd.decoder.exact_match

    def generous(p, candidates, gens):
        if candidates and p[0, candidates[0]] > 0:
            accepted, token, kind = real(p[1:], candidates[1:], gens[1:])
            return accepted + 1, token, kind
        return real(p, candidates, gens)

    monkeypatch.setattr(usd.decoder, "exact_match", generous)
    alone = target_alone(sampling_pairs["byte-level"])
    ids = echoing_prompt(alone)
    counts, _ = sample_two_ngram(alone, ids)
    assert check_fails(counts, exact_joint(alone.target, ids)), "a broken acceptance rule passed the test"


def test_every_drafted_piece_says_what_drafted_it_and_ngram_pieces_where_they_were_copied_from(pairs):
    """Provenance: an ngram piece names the lookup and the position of the token it copied (the same token, there in
    the prompt and answer); a tli piece names tli and no position; the target's own tokens name nothing. The token
    view marks lookups apart and says so on hover, and the wire form keeps both."""
    from app.render import piece_span, piece_title
    from usd.events import Piece

    alone = target_alone(pairs["byte-level"])
    ids = echoing_prompt(alone)
    rounds = list(stream(alone, ids, None, how(algorithm="ngram", k=4, max_new_tokens=MAX_NEW), probe_first=False))[:-1]
    context = list(ids) + [p.target_id for r in rounds for p in r.emitted]
    drafted = [p for r in rounds for p in r.pieces if p.kind in ("accepted", "rejected")]
    assert drafted and all(p.source == "ngram" and context[p.copied_from] == p.target_id for p in drafted)
    assert all(not p.source and p.copied_from is None for r in rounds for p in r.pieces if p not in drafted)
    assert "tok-lookup" in piece_span(drafted[0]) and "copied from position" in piece_title(drafted[0])
    assert Piece.from_dict(drafted[0].as_dict()) == drafted[0]
    pair = pairs["byte-level"]
    tli = [p for r in run(pair, PROMPTS[0], algorithm="tli", k=4, max_new_tokens=MAX_NEW)[0] for p in r.pieces]
    assert any(p.source == "tli" for p in tli) and all(p.copied_from is None for p in tli)
    assert all(p.source == "tli" for p in tli if p.kind in ("accepted", "rejected"))


# --- auto mixing the lookup with the drafter model's algorithms -------------------------------------------------------


def both_prompts(pair, ids: list[int]) -> tuple[list[int], list[int]]:
    """The target's prompt ids and the drafter's tokenization of the same text."""
    return ids, pair.drafter_tokenizer.encode(pair.target_tokenizer.decode(ids))


@pytest.mark.parametrize("key", list(ALGORITHMS))
def test_auto_switching_among_every_source_equals_plain_greedy(pairs, key, auto_switching):
    """auto choosing at random, round by round, among plain decoding, the drafter model's algorithms and the lookup
    (where it finds something: the echoing prompt holds the answer's start) gives plain greedy's answer."""
    pair = pairs[key]
    ids = echoing_prompt(pair)
    *_, plain = stream(pair, ids, None, how(algorithm="none", max_new_tokens=MAX_NEW))
    # a fixed k: the rounds then follow the seeded order alone, not this machine's timings
    events = list(
        stream(pair, *both_prompts(pair, ids), how(algorithm="auto", k=2, max_new_tokens=MAX_NEW), probe_first=False)
    )
    rounds, done = events[:-1], events[-1]
    assert done.target_ids == plain.target_ids and done.text == plain.text
    assert_pieces_are_the_text(pair, rounds, done)
    ran = {r.algorithm for r in rounds if r.drafted}
    assert "ngram" in ran and len(ran) >= 2, f"auto must mix the lookup with the drafter model's algorithms: {ran}"


def test_auto_mixing_the_lookup_and_the_drafter_models_algorithms_is_distributed_as_plain_sampling(
    sampling_pairs, auto_switching
):
    """Unseeded, so that tli (rejection sampling) is among the modes, switching at random with slem, ngram and plain
    decoding: the first two tokens after the echoing prompt are distributed as plain sampling's."""
    pair = sampling_pairs["byte-level"]
    ids = echoing_prompt(pair)
    sources: set = set()
    counts, alpha = sample_two(pair, "auto", 3, prompt=both_prompts(pair, ids), sources=sources)
    assert 0.02 < alpha < 0.98 and {"tli", "slem", "ngram"} <= sources, (alpha, sources)
    p = p_value(counts, exact_joint(pair.target, ids))
    assert p > ALPHA, f"auto mixing tli, slem and ngram: p = {p:.1e}, observed {counts}"


def test_auto_mixing_with_a_lookup_accepted_unchecked_fails_the_distribution_test(
    sampling_pairs, auto_switching, monkeypatch
):
    """The power of the test above: the same mix with ngram's first candidate kept whenever the target's top-k
    holds it (instead of only when it is the target's own draw)."""
    real = usd.decoder.accept

    def generous(logits, draft, mode, rules, position):
        verdict = real(logits, draft, mode, rules, position)
        looked_up = mode == "ngram" and draft.candidates and verdict.accepted == 0
        if looked_up and probabilities(logits, rules.params)[0, draft.candidates[0]] > 0:
            token = draft.candidates[1] if len(draft.candidates) > 1 else verdict.token
            return usd.decoder.Verdict(1, token, verdict.kind)
        return verdict

    monkeypatch.setattr(usd.decoder, "accept", generous)
    pair = sampling_pairs["byte-level"]
    ids = echoing_prompt(pair)
    counts, _ = sample_two(pair, "auto", 3, prompt=both_prompts(pair, ids))
    assert check_fails(counts, exact_joint(pair.target, ids)), "a broken acceptance rule passed the test"
