"""Acceptance rules on hand-built p and q. Each statistical test draws N rounds and runs a chi-square goodness-of-fit
test against the target's own distribution with a false-alarm rate of 1e-4 per test; a broken rule (say, resampling
from p instead of the residual) shifts the output by far more than that test can miss at these sample sizes."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from usd.errors import InternalError
from usd.sampling import SamplingParams, make_generator, probabilities, sample
from usd.verify import exact_match, greedy_match, rejection_sampling

ALPHA = 1e-4
N = 20_000


def dist(*xs) -> torch.Tensor:
    t = torch.tensor(xs, dtype=torch.float32)
    return t / t.sum()


def assert_same_distribution(counts: torch.Tensor, p: torch.Tensor):
    counts = counts.double()
    p = p.double()
    assert counts[p == 0].sum() == 0, f"sampled tokens the target gives probability 0: {counts.tolist()}"
    support = p > 0
    expected = p[support] / p[support].sum() * counts.sum()
    if support.sum() == 1:
        return
    result = chisquare(counts[support].numpy(), expected.numpy())
    assert result.pvalue > ALPHA, f"counts {counts.tolist()} vs expected {expected.tolist()} (p={result.pvalue:.2e})"


CASES = {
    "p equals q": (dist(1, 2, 3, 4), dist(1, 2, 3, 4)),
    "disjoint supports": (dist(1, 1, 0, 0), dist(0, 0, 1, 1)),
    "one-hot q": (dist(4, 3, 2, 1), dist(0, 0, 1, 0)),
    "q zero where p positive": (dist(1, 1, 1, 1), dist(1, 1, 0, 0)),
    "p zero where q positive": (dist(0, 1, 1, 2), dist(3, 1, 1, 0)),
    "peaked p, flat q": (dist(20, 1, 1, 1), dist(1, 1, 1, 1)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_rejection_sampling_first_token_is_distributed_as_p(case):
    p0, q0 = CASES[case]
    p_next = dist(1, 1, 1, 1)
    g = make_generator(1234)
    counts = torch.zeros(4)
    kinds = set()
    for _ in range(N):
        d = sample(q0, g)
        accepted, token, kind = rejection_sampling(torch.stack([p0, p_next]), q0[None], [d], g)
        first = d if accepted == 1 else token
        counts[first] += 1
        kinds.add(kind)
    assert_same_distribution(counts, p0)


def test_rejection_sampling_two_positions_joint_distribution():
    """k = 2 where the second position's p depends on the first token: the first two tokens of the answer (this
    round, or the next one after an early rejection) are jointly distributed as p0(x) * P1[x](y)."""
    p0 = dist(3, 1, 2)
    P1 = [dist(1, 0, 3), dist(2, 2, 1), dist(0, 1, 1)]
    q0 = dist(1, 1, 1)
    Q1 = [dist(1, 2, 0), dist(1, 0, 0), dist(1, 1, 1)]
    p_after = dist(1, 1, 1)
    g = make_generator(7)
    counts = torch.zeros(9)
    for _ in range(N):
        d0 = sample(q0, g)
        d1 = sample(Q1[d0], g)
        p = torch.stack([p0, P1[d0], p_after])
        q = torch.stack([q0, Q1[d0]])
        accepted, token, _ = rejection_sampling(p, q, [d0, d1], g)
        emitted = [d0, d1][:accepted] + [token]
        if len(emitted) == 1:  # the next round starts from the resampled token with plain sampling
            emitted.append(sample(P1[emitted[0]], g))
        counts[emitted[0] * 3 + emitted[1]] += 1
    expected = torch.stack([p0[x] * P1[x] for x in range(3)]).flatten()
    assert_same_distribution(counts, expected)


def test_rejection_sampling_bonus_after_full_acceptance():
    p = torch.stack([dist(1, 0, 0), dist(1, 2, 3)])
    q = dist(1, 0, 0)[None]
    g = make_generator(3)
    counts = torch.zeros(3)
    for _ in range(N // 2):
        accepted, token, kind = rejection_sampling(p, q, [0], g)
        assert (accepted, kind) == (1, "bonus")
        counts[token] += 1
    assert_same_distribution(counts, p[1])


def test_rejection_sampling_refuses_impossible_candidate():
    with pytest.raises(InternalError, match="q = 0"):
        rejection_sampling(torch.stack([dist(1, 1), dist(1, 1)]), dist(1, 0)[None], [1], make_generator(0))


@pytest.mark.parametrize("case", list(CASES))
def test_exact_match_first_token_is_distributed_as_p(case):
    """SLEM under sampling: the candidate may come from anywhere (here from q); the output is still p."""
    p0, q0 = CASES[case]
    g = make_generator(99)
    counts = torch.zeros(4)
    for _ in range(N):
        d = sample(q0, g)
        accepted, token, _ = exact_match(torch.stack([p0, dist(1, 1, 1, 1)]), [d], [g, g])
        counts[d if accepted else token] += 1
    assert_same_distribution(counts, p0)


def test_exact_match_with_a_fixed_wrong_candidate_still_gives_p():
    p0 = dist(1, 2, 3)
    g = make_generator(5)
    counts = torch.zeros(3)
    for _ in range(N):
        accepted, token, _ = exact_match(torch.stack([p0, dist(1, 1, 1)]), [2], [g, g])
        counts[2 if accepted else token] += 1
    assert_same_distribution(counts, p0)


def test_greedy_match():
    assert greedy_match([5, 6, 7, 8], [5, 6, 7]) == (3, 8, "bonus")
    assert greedy_match([5, 6, 7, 8], [5, 9, 7]) == (1, 6, "resampled")
    assert greedy_match([5], []) == (0, 5, "bonus")


def test_probabilities_greedy_top_k_top_p():
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0])
    assert probabilities(logits, SamplingParams()).tolist() == [1.0, 0.0, 0.0, 0.0]
    p = probabilities(logits, SamplingParams(temperature=1.0, top_k=2))
    assert p[2] == 0 and p[3] == 0 and torch.isclose(p[:2].sum(), torch.tensor(1.0))
    full = logits.softmax(-1)
    p = probabilities(logits, SamplingParams(temperature=1.0, top_p=float(full[0]) + 1e-3))
    assert p[0] > 0 and p[1] > 0 and p[2] == 0  # keeps the smallest prefix reaching top_p
    p = probabilities(logits, SamplingParams(temperature=0.5))
    assert torch.allclose(p, (logits / 0.5).softmax(-1))
    with pytest.raises(ValueError, match=r"top-p must be a number above 0 and at most 1, got 0\.0"):
        SamplingParams(temperature=1.0, top_p=0.0)
