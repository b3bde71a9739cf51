"""Under sampling, the decoder's output is distributed exactly as plain sampling from the target.

Tiny random models with the real tokenizers of three families: a Qwen target with a SmolLM2 drafter (tli, slem, and
auto switching algorithms between rounds, all at three drafts a round) and with Qwen itself (`standard`); a SmolLM2
target with a Gemma drafter (SentencePiece with byte fallback: tli, slem). Adaptive draft lengths, top-p, other
temperatures and the bonus token are covered on the fast tier's tiny models (test_tiny_decoder.py); the reference
distribution comes from tests/reference_sampling.py, not from the code under test.
For the first two generated tokens we compute the target's exact joint distribution (temperature 1, top-k 4) and run
a chi-square goodness-of-fit test on N independent speculative generations: false-alarm rate 1e-4 per test. Cells
with small expected counts are pooled so the chi-square approximation holds.
"""

from __future__ import annotations

import pytest
import reference_sampling as reference
import torch
from scipy.stats import chisquare
from tiny_pairs import how, tiny_pair

from usd.decoder import stream
from usd.pair import Pair
from usd.sampling import SamplingParams

pytestmark = pytest.mark.real_models

QWEN, SMOL, GEMMA = "qwen2.5-coder-0.5b-instruct", "smollm2-135m-instruct", "gemma-3-270m"
PROMPT = "def add(a, b):\n    return"
N = 1000
ALPHA = 1e-4


def exact_joint(target, ids, params) -> dict[tuple[int, ...], float]:
    """From tests/reference_sampling.py: numpy, not usd.sampling, so a bug there is not in the reference too."""

    @torch.no_grad()
    def next_logits(prefix):
        return target(torch.tensor([prefix])).logits[0, -1].float().numpy()

    settings = {"temperature": params.temperature, "top_k": params.top_k, "top_p": params.top_p}
    return reference.exact_joint(next_logits, ids, frozenset([target.config.eos_token_id]), **settings)


def run(pair, ids, dids, algorithm, k=3):
    counts, drafted, accepted = {}, 0, 0
    for seed in range(N):
        params = SamplingParams(temperature=1.0, top_k=4, seed=seed)
        *_, ev = stream(
            pair, ids, dids, how(algorithm=algorithm, k=k, params=params, max_new_tokens=2), probe_first=False
        )
        key = tuple(ev.target_ids)
        counts[key] = counts.get(key, 0) + 1
        drafted += ev.stats.drafted
        accepted += ev.stats.accepted
    return counts, accepted / max(1, drafted)


def assert_matches(counts, joint):
    assert set(counts) <= set(joint), f"outputs the target cannot produce: {set(counts) - set(joint)}"
    cells = sorted(joint, key=joint.get, reverse=True)
    obs, exp, pool_o, pool_e = [], [], 0, 0.0
    for c in cells:
        e = joint[c] * N
        if e >= 5:
            obs.append(counts.get(c, 0))
            exp.append(e)
        else:
            pool_o += counts.get(c, 0)
            pool_e += e
    if pool_e > 0:
        obs.append(pool_o)
        exp.append(pool_e)
    total = sum(exp)
    exp = [e * sum(obs) / total for e in exp]
    result = chisquare(obs, exp)
    assert result.pvalue > ALPHA, f"observed {obs} expected {[round(e) for e in exp]} (p={result.pvalue:.1e})"


PAIRS = {"qwen+smol": (QWEN, SMOL), "qwen+qwen": (QWEN, QWEN), "smol+gemma": (SMOL, GEMMA)}


@pytest.fixture(scope="module")
def pairs(real_tokenizers):
    out = {}
    for key, (t_name, d_name) in PAIRS.items():
        tt, td = real_tokenizers[t_name], real_tokenizers[d_name]
        # seed 0: acceptance 0.3-0.5 for every case here (seed 1 left qwen+smol near 0.07, seed 2 near 0.02)
        target, drafter = tiny_pair(tt, td, seed=0)
        out[key] = (Pair(target, tt, drafter, td), tt.encode(PROMPT), td.encode(PROMPT))
    return out


@pytest.mark.parametrize(
    ("key", "algorithm", "k"),
    [
        ("qwen+smol", "tli", 3),
        ("qwen+smol", "slem", 3),
        ("qwen+smol", "auto", 3),
        ("qwen+qwen", "standard", 3),
        ("smol+gemma", "tli", 3),
        ("smol+gemma", "slem", 3),
    ],
)
def test_first_two_tokens_distributed_as_plain_sampling(pairs, key, algorithm, k, request):
    pair, ids, dids = pairs[key]
    if algorithm == "auto":
        # Seeded, auto keeps to plain and slem (whose answer the seed fixes). Unseeded it also switches to tli, and
        # that is the case to prove: seeds here only make the test repeatable.
        request.getfixturevalue("auto_switching")
    joint = exact_joint(pair.target, ids, SamplingParams(temperature=1.0, top_k=4))
    counts, alpha = run(pair, ids, dids, algorithm, k)
    assert 0.02 < alpha < 0.98, f"acceptance {alpha:.2f}: the test must exercise both accept and reject paths"
    assert_matches(counts, joint)
    if algorithm == "auto":  # it must really have switched between what it can do
        assert {"none", "tli", "slem"} <= set(pair.memory.schedule.modes)


def test_plain_sampling_through_the_loop_matches_too(pairs):
    pair, ids, dids = pairs["qwen+smol"]
    joint = exact_joint(pair.target, ids, SamplingParams(temperature=1.0, top_k=4))
    counts, _ = run(pair, ids, dids, "none")
    assert_matches(counts, joint)


def test_auto_mixing_the_lookup_and_the_drafter_models_algorithms_matches_too(pairs, auto_switching):
    """auto switching at random among plain decoding, tli, slem and ngram on a prompt that echoes itself (PROMPT,
    the target's greedy two tokens, PROMPT again: the lookup finds what followed PROMPT the first time), unseeded."""
    pair, ids, _ = pairs["qwen+smol"]
    with torch.no_grad():
        greedy = pair.target.generate(torch.tensor([ids]), max_new_tokens=2, do_sample=False)[0, len(ids) :].tolist()
    echo = ids + greedy + ids
    dids = pair.drafter_tokenizer.encode(pair.target_tokenizer.decode(echo))
    joint = exact_joint(pair.target, echo, SamplingParams(temperature=1.0, top_k=4))
    counts, alpha = run(pair, echo, dids, "auto", 3)
    assert 0.02 < alpha < 0.98, f"acceptance {alpha:.2f}: the test must exercise both accept and reject paths"
    assert_matches(counts, joint)
    assert {"none", "tli", "slem", "ngram"} <= set(pair.memory.schedule.modes)
