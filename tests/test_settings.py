"""usd.settings: one validated model of the generation settings, the ranges and messages every interface shows."""

from __future__ import annotations

import re
from typing import get_args

import pytest

from usd.catalog import Precision
from usd.sampling import SamplingParams
from usd.settings import (
    ALGORITHMS,
    DEFAULT_MAX_NEW_TOKENS,
    GREEDY_BELOW,
    PRECISIONS,
    SEED_MAX,
    GenerationSettings,
    check_draft_tokens,
)


def test_defaults():
    s = GenerationSettings()
    assert (s.algorithm, s.draft_tokens, s.temperature, s.top_p, s.top_k, s.seed, s.max_new_tokens, s.stop_strings) == (
        "auto",
        "auto",
        0.0,
        1.0,
        0,
        None,
        DEFAULT_MAX_NEW_TOKENS,
        (),
    )
    assert ALGORITHMS == ("auto", "tli", "slem", "standard", "ngram", "suffix", "none")
    assert get_args(Precision) == PRECISIONS


def test_what_users_send_is_read_as_numbers():
    s = GenerationSettings(
        algorithm=" slem ",
        draft_tokens="4",
        temperature="0.7",
        top_p="0.9",
        top_k="20",
        seed=str(SEED_MAX),
        max_new_tokens=64.0,
    )
    assert (s.algorithm, s.draft_tokens, s.temperature, s.top_p, s.top_k, s.seed, s.max_new_tokens) == (
        "slem",
        4,
        0.7,
        0.9,
        20,
        SEED_MAX,
        64,
    )
    blank = GenerationSettings(algorithm="", draft_tokens=None, temperature=" ", seed="", stop_strings=None)
    assert blank == GenerationSettings()


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            {"algorithm": "fast"},
            "unknown algorithm 'fast'; choose one of auto, tli, slem, standard, ngram, suffix, none",
        ),
        (
            {"draft_tokens": 0},
            "draft tokens must be auto or a whole number from 1 to 16, got 0 (to decode without a "
            "drafter, use algorithm none)",
        ),
        ({"temperature": 5.5}, "temperature must be a number from 0 (greedy) to 5, got 5.5"),
        ({"temperature": float("nan")}, "temperature must be a number from 0 (greedy) to 5, got nan"),
        ({"top_p": 1.5}, "top-p must be a number above 0 and at most 1, got 1.5"),
        ({"top_k": 2.5}, "top-k must be a whole number from 0 to 1,048,576, got 2.5"),
        ({"seed": SEED_MAX + 1}, f"seed must be a whole number from 0 to {SEED_MAX:,}, got {SEED_MAX + 1}"),
        ({"max_new_tokens": True}, "max new tokens must be a whole number from 1 to 4,096, got True"),
        ({"stop_strings": [1]}, "stop strings must be a list of texts, got [1]"),
        ({"stop_strings": ["x"] * 17}, "at most 16 stop strings are allowed, got 17"),
        (
            {"stop_strings": ["\n", "ab" * 500_000]},
            "a stop string may be at most 1,000 characters long; stop string 1 has 1,000,000",
        ),
        ({"stop_strings": "a\ud800"}, "stop string 0 is not valid text: it holds a lone surrogate ('\\ud800') at"),
        # a client's value is shown cut short, however long it is
        ({"temperature": "9" * 100_000}, "temperature must be a number from 0 (greedy) to 5, got '99999"),
        ({"temprature": 1}, "unknown setting 'temprature'; the settings are algorithm, draft_tokens, temperature"),
        # several problems: the first, in field order
        ({"max_new_tokens": 0, "temperature": -1}, "temperature must be a number from 0 (greedy) to 5, got -1"),
    ],
)
def test_one_plain_message_per_problem(values, message):
    with pytest.raises(ValueError, match=re.escape(message)) as e:
        GenerationSettings(**values)
    assert "\n" not in str(e.value) and "pydantic" not in str(e.value)


def test_messages_show_a_long_value_cut_short():
    with pytest.raises(ValueError) as e:
        GenerationSettings(temperature="9" * 100_000)
    assert len(str(e.value)) < 300
    with pytest.raises(ValueError) as e:
        GenerationSettings(stop_strings=[[[[[[[[[["deep"]]]]]]]]]] * 100_000)
    assert len(str(e.value)) < 300


def test_temperatures_below_greedy_below_are_greedy():
    assert GREEDY_BELOW == 1e-5
    for t in (0, 1e-40, 9.99e-6):
        assert GenerationSettings(temperature=t).greedy and SamplingParams(temperature=t).greedy
    for t in (1e-5, 0.7):
        assert not GenerationSettings(temperature=t).greedy and not SamplingParams(temperature=t).greedy


def test_the_decode_loop_allows_zero_draft_tokens_users_do_not():
    assert check_draft_tokens(0, allow_zero=True) == 0
    with pytest.raises(ValueError, match=r"from 0 to 16, got 17$"):
        check_draft_tokens(17, allow_zero=True)


def test_replace_checks_again_and_settings_are_frozen():
    s = GenerationSettings(temperature=0.7, seed=1)
    assert s.replace(seed=2, algorithm="none") == GenerationSettings(temperature=0.7, seed=2, algorithm="none")
    with pytest.raises(ValueError, match="seed must be a whole number"):
        s.replace(seed=-1)
    with pytest.raises(ValueError):
        s.seed = 3
    assert GenerationSettings(stop_strings="\n\n").stop_strings == ("\n\n",)


def test_sampling_params_come_from_the_settings_and_share_their_checks():
    assert SamplingParams.of(GenerationSettings(temperature=0.7, top_k=5, top_p=0.9, seed=3)) == SamplingParams(
        temperature=0.7, top_k=5, top_p=0.9, seed=3
    )
    with pytest.raises(ValueError, match=re.escape("top-k must be a whole number from 0 to 1,048,576, got -1")):
        SamplingParams(top_k=-1)
