"""The algorithms, in one table: what each proposes, how its candidates are accepted, what it needs of the pair, and
whether a seed fixes its answer. The decode loop, auto's schedule, the settings, usd suggest, usd bench, the UI and the
server read this table instead of comparing names; adding an algorithm is a row here and its source's module, which
the row names (a factory of `drafting.Source`: the decode loop and the schedule never name a source).

Each `Algorithm` is a `StrEnum` member, so it is also its own name on every wire (events, JSON, the UI's menu) and
compares equal to it; the code asks the member's properties instead (docs/design.md §5 for why each is lossless).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, StrEnum


class Proposal(Enum):
    """How a round's candidates come about."""

    NOTHING = "nothing"
    """No candidates: the round is one plain target step."""
    TOKENS = "tokens"
    """The drafter samples its own tokens, restricted to the vocabulary it shares with the target: each is a target
    id, with the drafter's probability q behind it (drafters.draft_tokens)."""
    STRINGS = "strings"
    """The drafter writes text in its own vocabulary, which the target's tokenizer re-tokenizes; no q survives the
    re-tokenization (drafters.draft_strings)."""
    LOOKUP = "lookup"
    """No model: ids that followed an earlier occurrence of the context's last few ids, in the conversation
    (usd/ngram.py) or in earlier answers too (usd/suffix.py), a deterministic function of what was committed before,
    so q is one-hot. Costs next to nothing a candidate, and finds nothing to propose in some rounds."""


class Acceptance(Enum):
    """How the target decides, under sampling, which candidates stand (greedy: each candidate that is the argmax)."""

    EXACT_MATCH = "exact match"
    """The target draws its own token at each position; a candidate stands while it equals that draw
    (verify.exact_match). Plain sampling is this rule with no candidates."""
    REJECTION = "rejection sampling"
    """Each candidate stands with probability min(1, p / q), and a rejection resamples from the residual
    (verify.rejection_sampling): it needs the q of every candidate."""


@dataclass(frozen=True)
class Spec:
    label: str
    proposes: Proposal | None
    """None: the algorithm does not draft itself, it picks the algorithm of each round (auto)."""
    accepts: Acceptance | None
    one_tokenizer: bool
    """Needs target and drafter to share one tokenizer."""
    drafter_model: bool
    """Drafts with the drafter model (and so needs one loaded)."""
    seed_stable: bool
    """A seed fixes its answer however rounds are cut: its every draw is tied to an answer position
    (sampling.position_generator), not to the order of a round's draws."""
    source: str | None = None
    """The factory of its `drafting.Source`, as "module:function" under usd (`drafting.start_source` imports it when
    an answer starts one, so that this table imports nothing); None: it drafts nothing itself."""
    drafts_from: str = ""
    """What drafts its candidates, in words for the panel."""


class Algorithm(StrEnum):
    AUTO = "auto"
    TLI = "tli"
    SLEM = "slem"
    STANDARD = "standard"
    NGRAM = "ngram"
    SUFFIX = "suffix"
    NONE = "none"

    @property
    def spec(self) -> Spec:
        return SPECS[self]

    @property
    def plain(self) -> bool:
        """Plain decoding: the target alone, through the same loop."""
        return self.spec.proposes is Proposal.NOTHING

    @property
    def chooses(self) -> bool:
        """Picks an algorithm per round instead of drafting itself."""
        return self.spec.proposes is None

    @property
    def needs_drafter(self) -> bool:
        return self.spec.drafter_model

    @property
    def looks_up(self) -> bool:
        """Drafts with no model: each candidate costs next to nothing (auto prices it with c = 0, drafts up to
        schedule.K_MAX_LOOKUP), and some rounds it finds nothing to propose."""
        return self.spec.proposes is Proposal.LOOKUP

    @property
    def uses_drafter(self) -> bool:
        """Drafts with the drafter model, or may (auto)."""
        return self.spec.drafter_model or self.chooses


_TOKENS, _STRINGS, _LOOKUP, _NOTHING = Proposal.TOKENS, Proposal.STRINGS, Proposal.LOOKUP, Proposal.NOTHING
_REJECT, _MATCH = Acceptance.REJECTION, Acceptance.EXACT_MATCH
_MODEL = "the drafter model"
SPECS: dict[Algorithm, Spec] = {
    # algorithm: Spec(label, proposes, accepts, one_tokenizer, drafter_model, seed_stable, source, drafts_from)
    Algorithm.AUTO: Spec("auto: the fastest of the others, chosen per round", None, None, False, False, False),
    Algorithm.TLI: Spec(
        "token-level intersection (tli)", _TOKENS, _REJECT, False, True, False, "drafters:tokens", _MODEL
    ),
    Algorithm.SLEM: Spec(
        "string-level exact match (slem)", _STRINGS, _MATCH, False, True, True, "drafters:strings", _MODEL
    ),
    Algorithm.STANDARD: Spec(
        "standard speculative decoding", _TOKENS, _REJECT, True, True, False, "drafters:tokens", _MODEL
    ),
    Algorithm.NGRAM: Spec(
        "n-gram lookup over the conversation (no drafter model)",
        *(_LOOKUP, _MATCH, False, False, True, "ngram:NgramSource", "n-gram lookup, no model"),
    ),
    Algorithm.SUFFIX: Spec(
        "suffix: earlier answers and the conversation (no drafter model)",
        *(_LOOKUP, _MATCH, False, False, True, "suffix:SuffixSource", "earlier answers and the conversation, no model"),
    ),
    Algorithm.NONE: Spec("plain decoding (the target alone)", _NOTHING, _MATCH, False, False, True),
}

NAMES: tuple[str, ...] = tuple(Algorithm)
"""Every name a user may ask for, auto first."""
PLAIN = Algorithm.NONE
DRAFTING: tuple[Algorithm, ...] = tuple(a for a in Algorithm if a.needs_drafter)
"""The algorithms that draft with a drafter model."""
LOOKING_UP: tuple[Algorithm, ...] = tuple(a for a in Algorithm if a.looks_up)
"""The algorithms that draft by looking up earlier text, with no model (all seed-stable: exact match)."""


def auto_modes(
    same_tokenizer: bool, seeded_sampling: bool, drafter: bool = True, lookup: bool = False
) -> list[Algorithm]:
    """What auto weighs each round: plain decoding, the drafting algorithms that suit the pair (with a `drafter`
    model loaded), and, with `lookup`, the lookups (n-gram and suffix). Of the drafter's algorithms: on a pair of one
    tokenizer those that need it (the drafter's whole vocabulary is shared), on another pair the rest. Under sampling
    with a seed only the seed-stable ones, so that the same seed gives the same text whatever auto chose."""
    if not drafter:
        drafting: list[Algorithm] = []
    elif seeded_sampling:
        drafting = [a for a in DRAFTING if a.spec.seed_stable]
    else:
        drafting = [a for a in DRAFTING if a.spec.one_tokenizer == same_tokenizer]
    return [PLAIN, *drafting, *(LOOKING_UP if lookup else ())]


def runnable(algorithm: Algorithm, has_drafter: bool, same_tokenizer: bool) -> str | None:
    """Why the algorithm cannot run on this pair, in words for the user, or None when it can."""
    if algorithm.needs_drafter and not has_drafter:
        return (
            f"algorithm {algorithm.value!r} needs a drafter model; load one, or use 'ngram' or 'suffix' (no model) "
            "or 'none'"
        )
    if algorithm.spec.one_tokenizer and not same_tokenizer:
        others = ", ".join(a.value for a in DRAFTING if not a.spec.one_tokenizer)
        return f"{algorithm.value!r} needs identical tokenizers; this pair differs, use {others} or auto"
    return None
