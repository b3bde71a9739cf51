"""Every generation setting, checked once, here: the Python API, the CLI, `usd bench`, the UI and the server all
take their ranges, defaults and messages from this module.

`GenerationSettings` is the validated whole. It takes what users send as is: typed values from Python, strings from
the command line and the UI, any JSON from API callers ("4", 64.0, "inf", "nan", [5]); empty values mean the default.
A bad value raises ValueError with one message that names the setting, its range and what was given. The `check_*`
functions are the single checks behind it, on typed values; the decode loop and SamplingParams call them directly.
"""

from __future__ import annotations

import contextlib
import math
import reprlib
from itertools import islice
from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator

from .algorithms import NAMES, Algorithm
from .catalog import Precision
from .utf8 import not_text

ALGORITHMS: tuple[str, ...] = NAMES
"""The algorithms' names (usd/algorithms.py holds what each one is)."""
PRECISIONS: tuple[str, ...] = get_args(Precision)
"""The weight precisions a model can load in (the catalog's own list)."""
DRAFT_TOKENS_MAX = 16
TEMPERATURE_MAX = 5.0
TOP_K_MAX = 1 << 20
SEED_MAX = (1 << 63) - 1
MAX_NEW_TOKENS_MAX = 4096
DEFAULT_MAX_NEW_TOKENS = 256
GREEDY_BELOW = 1e-5
"""Temperatures below this decode greedily, as 0 does. At T < 1e-5 a token whose logit trails the best one by 1e-3
or more gets a probability below exp(-100), far under float32's smallest normal number: the distribution is one-hot
to within float32 rounding (only near-ties, which greedy settles by the argmax, keep a second token). Dividing by
such a T gains nothing and, near T = 1e-38, overflows the logits to inf and the probabilities to NaN."""
DrafterRendering = Literal["auto", "own", "stripped"]
DRAFTER_RENDERINGS: tuple[str, ...] = get_args(DrafterRendering)
"""How the drafter sees a conversation (usd/chat.py): its own chat template, the target's text stripped of special
tokens, or auto, which measures both on the pair and keeps the one whose drafts are kept more often."""
STOP_STRINGS_MAX = 16
STOP_STRING_CHARS_MAX = 1000
"""Bounds on the stop strings of one generation: every answer position looks for each of them, so a client must not
be able to make that look as long as it likes."""


# --- the checks, on typed values -------------------------------------------------------------------------------------


def check_algorithm(algorithm) -> Algorithm:
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {short_repr(algorithm)}; choose one of {', '.join(ALGORITHMS)}")
    return Algorithm(algorithm)


def check_draft_tokens(k, allow_zero: bool = False) -> int | str:
    """'auto' or a whole number from 1 to DRAFT_TOKENS_MAX (0, plain decoding, only where the caller allows it: the
    decode loop does, users say algorithm none instead)."""
    if k == "auto":
        return k
    low = 0 if allow_zero else 1
    if not _is_int(k) or not low <= k <= DRAFT_TOKENS_MAX:
        hint = "" if allow_zero else " (to decode without a drafter, use algorithm none)"
        raise ValueError(
            f"draft tokens must be auto or a whole number from {low} to {DRAFT_TOKENS_MAX}, got {short_repr(k)}{hint}"
        )
    return k


def is_greedy(temperature: float) -> bool:
    """Whether this temperature decodes greedily (0, and anything below GREEDY_BELOW)."""
    return temperature < GREEDY_BELOW


def check_temperature(t) -> float:
    if not _is_real(t) or not 0 <= t <= TEMPERATURE_MAX:  # NaN fails every comparison
        raise ValueError(f"temperature must be a number from 0 (greedy) to {TEMPERATURE_MAX:g}, got {short_repr(t)}")
    return float(t)


def check_top_p(p) -> float:
    if not _is_real(p) or not 0 < p <= 1:
        raise ValueError(f"top-p must be a number above 0 and at most 1, got {short_repr(p)}")
    return float(p)


def check_top_k(k) -> int:
    """0 turns top-k off."""
    if not _is_int(k) or not 0 <= k <= TOP_K_MAX:
        raise ValueError(f"top-k must be a whole number from 0 to {TOP_K_MAX:,}, got {short_repr(k)}")
    return k


def check_seed(seed) -> int | None:
    """None: a fresh random seed per generation."""
    if seed is not None and (not _is_int(seed) or not 0 <= seed <= SEED_MAX):
        raise ValueError(f"seed must be a whole number from 0 to {SEED_MAX:,}, got {short_repr(seed)}")
    return seed


def check_max_new_tokens(n) -> int:
    if not _is_int(n) or not 1 <= n <= MAX_NEW_TOKENS_MAX:
        raise ValueError(f"max new tokens must be a whole number from 1 to {MAX_NEW_TOKENS_MAX:,}, got {short_repr(n)}")
    return n


def check_stop_strings(stops) -> tuple[str, ...]:
    """Texts that end the answer where they appear; a single text is one stop string (as OpenAI's `stop` takes it).
    At most STOP_STRINGS_MAX of them, each at most STOP_STRING_CHARS_MAX characters of valid Unicode."""
    if isinstance(stops, str):
        stops = (stops,)
    if not isinstance(stops, list | tuple) or not all(isinstance(s, str) for s in stops):
        raise ValueError(f"stop strings must be a list of texts, got {short_repr(stops)}")
    if len(stops) > STOP_STRINGS_MAX:
        raise ValueError(f"at most {STOP_STRINGS_MAX} stop strings are allowed, got {len(stops):,}")
    for i, s in enumerate(stops):
        if len(s) > STOP_STRING_CHARS_MAX:
            raise ValueError(
                f"a stop string may be at most {STOP_STRING_CHARS_MAX:,} characters long; stop string {i} has "
                f"{len(s):,}"
            )
        problem = not_text(s)
        if problem:
            raise ValueError(f"stop string {i} is not valid text: it holds {problem}")
    return tuple(stops)


def check_drafter_rendering(rendering) -> str:
    if rendering not in DRAFTER_RENDERINGS:
        raise ValueError(
            f"drafter rendering must be one of {', '.join(DRAFTER_RENDERINGS)}, got {short_repr(rendering)}"
        )
    return rendering


def short_repr(x) -> str:
    """`x` as shown in a message: its repr, cut short (a client's value can be megabytes, or nested thousands of
    levels deep)."""
    return _SHORT.repr(x)


class _ShortRepr(reprlib.Repr):
    def repr_dict(self, x, level):
        """A dict in its own order, as repr shows it (reprlib sorts the keys)."""
        if not x:
            return "{}"
        if level <= 0:
            return "{...}"
        pieces = [f"{self.repr1(k, level - 1)}: {self.repr1(v, level - 1)}" for k, v in islice(x.items(), self.maxdict)]
        return "{" + ", ".join(pieces) + (", ..." if len(x) > self.maxdict else "") + "}"


_SHORT = _ShortRepr()
_SHORT.maxstring = _SHORT.maxother = 200


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


# --- what users send, read as numbers --------------------------------------------------------------------------------


def _as_real(x):
    """A string that reads as a finite number, as a float; anything else unchanged, for the check to judge and to
    show as given ('nan', 'abc', {})."""
    if isinstance(x, str):
        with contextlib.suppress(ValueError):
            f = float(x)
            if math.isfinite(f):
                return f
    return x


def _as_whole(x):
    """`x` as an int when it is a whole number, else unchanged. Digit strings convert exactly (a 19-digit seed must
    not be rounded through a float); whole floats, as the UI's number widgets send them (64.0), are fine too."""
    if isinstance(x, str):
        with contextlib.suppress(ValueError):
            return int(x)
    f = _as_real(x)
    if isinstance(f, float) and math.isfinite(f) and f.is_integer():
        return int(f)
    return x


def _blank(name: str, x) -> bool:
    """No value given: None or an empty text (blank text too, except for stop strings, where spaces are a value)."""
    if isinstance(x, str):
        return x == "" if name == "stop_strings" else not x.strip()
    return x is None


# --- the validated whole ---------------------------------------------------------------------------------------------


class GenerationSettings(BaseModel):
    """How to generate: what the API's `stream`, `usd generate`, the app and the server all take.

    Build it with `GenerationSettings(...)` (not `model_validate`): a bad value raises ValueError with the message of
    the first bad setting, in field order."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    algorithm: Algorithm = Algorithm.AUTO
    draft_tokens: int | Literal["auto"] = "auto"
    """Draft length per round, or auto to adapt it."""
    temperature: float = 0.0
    """0 = greedy."""
    top_p: float = 1.0
    """1 = off."""
    top_k: int = 0
    """0 = off."""
    seed: int | None = None
    """None = a fresh random seed each time."""
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    stop_strings: tuple[str, ...] = ()
    drafter_rendering: DrafterRendering = "auto"
    """How the drafter sees a conversation (DRAFTER_RENDERINGS)."""

    def __init__(self, **values):
        try:
            super().__init__(**values)
        except ValidationError as e:
            raise ValueError(_first_problem(e)) from None

    def replace(self, **changes) -> GenerationSettings:
        """A copy with `changes`, checked like the original."""
        return GenerationSettings(**{**self.model_dump(), **changes})

    @property
    def greedy(self) -> bool:
        return is_greedy(self.temperature)

    @model_validator(mode="before")
    @classmethod
    def _blank_means_default(cls, values):
        """An empty widget, an empty text field or None: the setting's default."""
        if isinstance(values, dict):
            return {name: value for name, value in values.items() if not _blank(name, value)}
        return values

    @field_validator("algorithm", mode="before")
    @classmethod
    def _algorithm(cls, v):
        return check_algorithm(str(v).strip())

    @field_validator("draft_tokens", mode="before")
    @classmethod
    def _draft_tokens(cls, v):
        if isinstance(v, str) and v.strip() == "auto":
            return "auto"
        return check_draft_tokens(_as_whole(v))

    @field_validator("temperature", mode="before")
    @classmethod
    def _temperature(cls, v):
        return check_temperature(_as_real(v))

    @field_validator("top_p", mode="before")
    @classmethod
    def _top_p(cls, v):
        return check_top_p(_as_real(v))

    @field_validator("top_k", mode="before")
    @classmethod
    def _top_k(cls, v):
        return check_top_k(_as_whole(v))

    @field_validator("seed", mode="before")
    @classmethod
    def _seed(cls, v):
        return check_seed(_as_whole(v))

    @field_validator("max_new_tokens", mode="before")
    @classmethod
    def _max_new_tokens(cls, v):
        return check_max_new_tokens(_as_whole(v))

    @field_validator("stop_strings", mode="before")
    @classmethod
    def _stop_strings(cls, v):
        return check_stop_strings(v)

    @field_validator("drafter_rendering", mode="before")
    @classmethod
    def _drafter_rendering(cls, v):
        return check_drafter_rendering(v.strip() if isinstance(v, str) else v)


def _first_problem(error: ValidationError) -> str:
    """The first problem as one sentence: our checks' own message, or the name of a setting that does not exist."""
    first = error.errors()[0]
    if first["type"] == "value_error":
        return str(first["ctx"]["error"])
    name = ".".join(str(part) for part in first["loc"])
    if first["type"] == "extra_forbidden":
        return f"unknown setting {name!r}; the settings are {', '.join(GenerationSettings.model_fields)}"
    return f"{name}: {first['msg']}"
