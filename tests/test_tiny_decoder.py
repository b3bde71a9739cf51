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

import pytest
import tiny_tokenizers as tiny
import torch
from scipy.stats import chisquare
from tiny_pairs import tiny_pair

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


def build_pairs(sharpness: float) -> dict[str, Pair]:
    t = tiny.target()
    drafters = {"byte-level": tiny.drafter_byte_level(), "sentencepiece": tiny.drafter_sentencepiece(), "same": t}
    out = {}
    for key, d in drafters.items():
        target, drafter = tiny_pair(t, d, seed=0, sharpness=sharpness)
        for m in (target, drafter):  # generate() stops at the tokenizer's eos, as a real checkpoint's config says
            m.generation_config.eos_token_id = m.config.eos_token_id
            m.generation_config.pad_token_id = m.config.eos_token_id
        out[key] = Pair(target, t, drafter, d, "tiny-target", f"tiny-{key}")
    return out


@pytest.fixture(scope="module")
def pairs():
    """Peaked models (tiny_pair's default sharpness): wide margins between the best two tokens, as greedy needs."""
    return build_pairs(60.0)


@pytest.fixture(scope="module")
def sampling_pairs():
    """Flatter models: the first two tokens spread over all sixteen top-4 cells, and every drafter here has its
    drafts accepted 20-50% of the time on PROMPT (sharpness 60 left half the cells below five expected counts)."""
    return build_pairs(10.0)


def run(pair, prompt, **kwargs) -> tuple[list[Round], Finished]:
    ids, dids = pair.target_tokenizer.encode(prompt), pair.drafter_tokenizer.encode(prompt)
    events = list(stream(pair, ids, dids, **kwargs))
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
            # round 0 drafts too: its verify's first row is the prompt's kept logits (pair.LastLogits); and where an
            # answer turns to bare bytes at once, it is the one round slem can draft in
            rounds, done = run(pair, prompt, algorithm=algorithm, k=k, max_new_tokens=MAX_NEW, probe_first=False)
            what = f"{algorithm} k={k} on {prompt!r}"
            assert done.target_ids == plain.target_ids and done.text == plain.text, f"{what}: not plain greedy's"
            assert done.stats.stop_reason == plain.stats.stop_reason
            assert_pieces_are_the_text(pair, rounds, done)
            if algorithm != "auto":
                assert all(r.algorithm in ("none", algorithm) for r in rounds)
                assert done.stats.drafted > 0, f"{what}: nothing was drafted"


@pytest.mark.parametrize(("algorithm", "k"), [("none", None), ("tli", 3)])
def test_the_prompt_is_fed_in_one_forward_and_never_again(pairs, algorithm, k):
    """As plain tools read a prompt: whole, its last position's logits choosing the first token; round 0 reads them
    again from the context (pair.LastLogits), so a plain round 0 feeds nothing and a verify only its drafts."""
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


def test_round_0_is_neither_a_step_nor_a_verify_of_its_k_in_the_stats():
    """Round 0 feeds one position less than its kind (the prompt's last came with the prompt): a plain one nothing, a
    drafting one only its drafts. Counted, it would make the step look free and c and v huge."""
    from usd.tally import Tally

    tally = Tally("tli")
    tally.record("none", 0, 0, 0, 0.0, 0.001, fed=0)
    tally.record("tli", 3, 1, 3, 0.3, 0.12, fed=3)
    tally.record("none", 0, 0, 0, 0.0, 0.1, fed=1)
    tally.record("tli", 3, 3, 3, 0.3, 0.2, fed=4)
    stats = tally.stats(8, None, 0.0, None)
    assert stats.step_s == pytest.approx(0.1)
    assert (stats.c, stats.v, stats.mean_k) == (pytest.approx(1.0), pytest.approx(2.0), 3.0)


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
PARAMS = SamplingParams(temperature=1.0, top_k=4)


@torch.no_grad()
def exact_joint(target, ids) -> dict[tuple[int, int], float]:
    p1 = probabilities(target(torch.tensor([ids])).logits[0, -1], PARAMS)
    joint = {}
    for x in p1.nonzero().flatten().tolist():
        p2 = probabilities(target(torch.tensor([ids + [x]])).logits[0, -1], PARAMS)
        for y in p2.nonzero().flatten().tolist():
            joint[(x, y)] = float(p1[x] * p2[y])
    return joint


def sample_two(pair, algorithm, k=3) -> tuple[dict, float]:
    ids, dids = pair.target_tokenizer.encode(PROMPT), pair.drafter_tokenizer.encode(PROMPT)
    counts, drafted, accepted = {}, 0, 0
    for seed in range(N):
        params = SamplingParams(temperature=1.0, top_k=4, seed=seed)
        *_, done = stream(pair, ids, dids, algorithm=algorithm, k=k, params=params, max_new_tokens=2, probe_first=False)
        counts[done.target_ids] = counts.get(done.target_ids, 0) + 1
        drafted += done.stats.drafted
        accepted += done.stats.accepted
    return counts, accepted / max(1, drafted)


def p_value(counts, joint) -> float:
    """Chi-square goodness of fit; cells expected fewer than 5 times are pooled. Outputs the target cannot produce
    fail at once."""
    assert set(counts) <= set(joint), f"outputs the target cannot produce: {set(counts) - set(joint)}"
    obs, exp, pool_o, pool_e = [], [], 0, 0.0
    for cell in sorted(joint, key=joint.get, reverse=True):
        e = joint[cell] * N
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


@pytest.mark.parametrize(
    ("key", "algorithm"),
    [
        ("byte-level", "tli"),
        ("byte-level", "slem"),
        ("byte-level", "auto"),
        ("sentencepiece", "tli"),
        ("sentencepiece", "slem"),
        ("same", "standard"),
        ("byte-level", "none"),
    ],
)
def test_first_two_tokens_distributed_as_plain_sampling(sampling_pairs, key, algorithm, request):
    pair = sampling_pairs[key]
    if algorithm == "auto":  # switching between plain, tli and slem; the seeds only make it repeatable
        request.getfixturevalue("auto_switching")
    joint = exact_joint(pair.target, pair.target_tokenizer.encode(PROMPT))
    counts, alpha = sample_two(pair, algorithm)
    if algorithm != "none":
        assert 0.02 < alpha < 0.98, f"acceptance {alpha:.2f}: both the accept and the reject paths must run"
    p = p_value(counts, joint)
    assert p > ALPHA, f"{algorithm} on {key}: p = {p:.1e}, observed {counts}"
    if algorithm == "auto":
        assert {"none", "tli", "slem"} <= set(pair.memory["schedule"]["modes"])


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
