"""Logits -> the distribution p the user asked for (temperature, top-k, top-p), and seeded sampling from it.

Greedy decoding is temperature 0 (or below settings.GREEDY_BELOW): p is one-hot at the argmax, so every acceptance
rule below reduces to exact match.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .settings import GenerationSettings, check_temperature, check_top_k, check_top_p, is_greedy


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    """0 = off."""
    top_p: float = 1.0
    """1.0 = off."""
    seed: int | None = None

    def __post_init__(self):
        # the user-facing ranges and messages (settings.GenerationSettings makes these from what users send); the
        # seed may be any integer here (make_generator maps negative ones too), users give 0 to settings.SEED_MAX
        check_temperature(self.temperature)
        check_top_k(self.top_k)
        check_top_p(self.top_p)

    @property
    def greedy(self) -> bool:
        return is_greedy(self.temperature)

    @classmethod
    def of(cls, settings: GenerationSettings) -> SamplingParams:
        """The sampling part of a generation's settings."""
        return cls(temperature=settings.temperature, top_k=settings.top_k, top_p=settings.top_p, seed=settings.seed)


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[..., V] logits -> [..., V] float32 probabilities after the user's settings (one-hot when greedy). Never NaN
    for finite logits at any accepted setting: a temperature that is not greedy is at least settings.GREEDY_BELOW,
    so logits / T stays far inside float32's range, and top-k and top-p always keep the top token."""
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # drop a token when the mass before it already reaches top_p; the top token always stays
        drop_sorted = (cum - sorted_logits.softmax(-1)) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


DRAFTER_STREAM = 0
"""The stream of the drafter's samples and of rejection sampling's uniforms."""
POSITION_STREAM = 1
"""The streams of the target's own draws, one per answer position (see `position_generator`)."""


def make_generator(seed: int | None, *stream: int) -> np.random.Generator:
    """A private random stream. numpy's SeedSequence takes the whole integer seed (torch's CPU generator keeps only
    32 bits of it, so s and s + 2**32 would give one answer) and gives every `stream` key a statistically independent
    stream, so the drafter's samples never reuse the uniforms of the target's own draws. Without a seed it draws
    fresh entropy from the OS, and no global generator (torch's, numpy's, Python's) is read or reseeded."""
    if seed is None:
        return np.random.default_rng()
    entropy = 2 * seed if seed >= 0 else -2 * seed - 1  # any integer, negative ones too, to a distinct one >= 0
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(entropy, spawn_key=stream)))


def position_generator(seed: int, position: int) -> np.random.Generator:
    """The generator for the target's own draw at one answer position. Keying the target's draws by position (not
    by how many draws came before) makes a seeded answer independent of how rounds were cut: plain decoding and
    exact-match verification (slem) give the same text for a seed, whatever k or schedule ran; up to floating point:
    a verify forward over k+1 tokens rounds differently from single steps, so a draw that lands within rounding of
    a boundary between two tokens' cumulative probabilities can pick the neighbour (rare at usual top-k/top-p)."""
    return make_generator(seed, POSITION_STREAM, position)


def sample(p: torch.Tensor, generator: np.random.Generator) -> int:
    """One token id from a [V] distribution, by inverting its CDF at one uniform draw: a single pass over the
    vocabulary, several times cheaper than torch.multinomial on 150k-260k vocabularies."""
    cdf = p.cpu().double().cumsum(0)
    u = generator.random() * float(cdf[-1])
    i = int(torch.searchsorted(cdf, torch.tensor([u], dtype=torch.float64), right=True))
    # rounding can land u on the very end; step back to the last token with mass
    i = min(i, p.shape[0] - 1)
    while float(p[i]) <= 0.0:
        i -= 1
    return i


def uniform(generator: np.random.Generator) -> float:
    return float(generator.random())
