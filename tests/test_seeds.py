"""Random streams: one seed gives independent streams for the drafter and for every answer position, every integer
is a distinct seed, and an unseeded run leaves the host program's global generators alone."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from tiny_pairs import how
from transformers import LlamaConfig, LlamaForCausalLM

from usd.decoder import stream
from usd.pair import Pair
from usd.sampling import DRAFTER_STREAM, SamplingParams, make_generator, position_generator

SEEDS = [0, 1, 7, 2**32, 2**32 + 7, 2**64 + 3, -1, -(2**40)]


def draws(g, n: int = 4) -> list[float]:
    return [float(g.random()) for _ in range(n)]


@pytest.mark.parametrize("seed", SEEDS)
def test_the_drafter_stream_and_the_position_streams_are_distinct(seed):
    drafter = draws(make_generator(seed, DRAFTER_STREAM))
    positions = [draws(position_generator(seed, i)) for i in range(8)]
    assert all(drafter != p for p in positions)
    assert len({tuple(p) for p in positions}) == len(positions)
    assert draws(make_generator(seed, DRAFTER_STREAM)) == drafter  # and a seed still fixes them


def test_every_integer_is_its_own_seed():
    """torch's CPU generator keeps 32 bits of a seed: s and s + 2**32 used to give one answer."""
    streams = [tuple(draws(position_generator(s, 0))) for s in SEEDS] + [tuple(draws(make_generator(s))) for s in SEEDS]
    assert len(set(streams)) == len(streams)


class _Tok:
    """Just enough of a tokenizer for the decode loop with ids only (no drafter, plain sampling)."""

    eos_token_id = None

    @property
    def added_tokens_decoder(self):
        return {}

    def __len__(self):
        return 64

    def get_vocab(self):
        return {f"t{i}": i for i in range(64)}

    def decode(self, ids, skip_special_tokens=False):
        return " ".join(f"t{i}" for i in ids)


def _pair() -> Pair:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=128,
        eos_token_id=None,
    )
    return Pair(LlamaForCausalLM(cfg).eval(), _Tok())


def _sample_ids(pair: Pair, seed: int | None) -> tuple[int, ...]:
    events = list(
        stream(
            pair,
            [1, 2, 3],
            None,
            how(algorithm="none", params=SamplingParams(temperature=1.5, seed=seed), max_new_tokens=12),
            probe_first=False,
        )
    )
    return events[-1].target_ids


def test_seeds_that_differ_by_two_to_the_32_give_different_answers():
    pair = _pair()
    assert _sample_ids(pair, 5) == _sample_ids(pair, 5)
    assert _sample_ids(pair, 5) != _sample_ids(pair, 5 + 2**32)


def test_an_unseeded_run_leaves_the_global_generators_alone():
    """A host program's own torch.manual_seed (and numpy's and Python's seeds) must stay reproducible."""

    def host_draws():
        return torch.rand(3).tolist(), np.random.rand(3).tolist(), [random.random() for _ in range(3)]

    def seed_all():
        torch.manual_seed(123)
        np.random.seed(123)
        random.seed(123)

    pair = _pair()
    seed_all()
    expected = host_draws()
    seed_all()
    _sample_ids(pair, None)
    assert host_draws() == expected
