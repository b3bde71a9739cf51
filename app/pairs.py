"""The loaded pair behind the UI: what a pair would cost before loading it, loading and switching, and the plain
decoding baselines measured on it. One pair serves every browser tab; loads are serialised."""

from __future__ import annotations

import gc
import threading
from dataclasses import dataclass

from usd.catalog import Catalog, ModelEntry
from usd.loading import GiB, LoadError, LoadPlan, entry_for, load_tokenizer, plan_load
from usd.store import local_path

from .space import space_models


class SpaceModeError(LoadError):
    """Space mode allows only the catalog models the Space serves."""


NO_DRAFTER = "(no drafter model)"
"""The Pair tab's drafter choice that loads the target alone: `ngram` drafts by looking up the conversation, and
`auto` weighs it beside plain decoding."""


@dataclass(frozen=True)
class Choice:
    target: str
    drafter: str


class Pairs:
    def __init__(
        self, catalog: Catalog, space_mode: bool = False, device: str | None = None, precision: str | None = None
    ):
        self.catalog = catalog
        self.space_mode = space_mode
        self.allowed = space_models(catalog) if space_mode else catalog.names()
        """The catalog models offered in the Pair tab; in Space mode also the only ones that load."""
        self.device = device
        self.precision = precision
        self.pair = None
        self.loaded: Choice | None = None
        self._load_lock = threading.Lock()
        self._tokenizers: dict[str, object] = {}
        self._overlaps: dict[tuple[str, str], dict] = {}
        self.baselines: dict[tuple, float] = {}
        """(target, drafter) -> plain decoding tokens/s measured on the loaded pair (compare view, plain chat)."""

    # --- choosing ----------------------------------------------------------------------------------------------

    def entry(self, spec: str, role: str) -> ModelEntry:
        spec = (spec or "").strip()
        if not spec:
            raise LoadError(f"no {role} chosen: pick one from the list")
        served = ", ".join(self.allowed)
        try:
            entry = entry_for(spec, self.catalog, allow_unlisted=not self.space_mode)
        except LoadError as e:
            if self.space_mode:
                raise SpaceModeError(
                    f"unknown {role} {spec!r}: this Space serves only its catalog models ({served})"
                ) from None
            raise LoadError(f"unknown {role}: {e}") from None
        if self.space_mode and entry.name not in self.allowed:  # refused before anything is fetched
            raise SpaceModeError(f"{role} {spec!r} is not served by this Space; it serves only {served}")
        return entry

    def drafter_entry(self, spec: str) -> ModelEntry | None:
        """The drafter's entry, or None for NO_DRAFTER."""
        return None if (spec or "").strip() == NO_DRAFTER else self.entry(spec, "drafter")

    def preview(self, target: str, drafter: str) -> str:
        """What loading this pair means, before loading it: precision on this device, memory, overlap, ceiling."""
        try:
            t, d = self.entry(target, "target"), self.drafter_entry(drafter)
        except LoadError as e:
            return f"⚠ {e}"
        lines = []
        total = 0
        for role, e in (("target", t), ("drafter", d)):
            if e is None:
                continue
            plan = plan_load(e, self.device, self.precision)
            total += plan.estimate_bytes
            ready = _readiness(e, plan)
            lines.append(
                f"- **{role}** `{e.name}`: {plan.precision} on {plan.device}, about "
                f"{plan.estimate_bytes / GiB:.2f} GiB ({ready}). {plan.note}"
            )
        avail = plan.available_bytes
        room = f" of {avail / GiB:.1f} GiB free" if avail is not None else ""
        lines.append(f"- **memory**: about {total / GiB:.2f} GiB for {'both' if d else 'the target'}{room}.")
        lines.append(self._overlap_line(t, d) if d else NO_DRAFTER_LINE)
        return "\n".join(lines)

    def _tokenizer(self, entry: ModelEntry):
        if entry.name not in self._tokenizers:
            path = local_path(entry)
            if path is None:
                return None  # not fetched yet: no download just for a preview
            self._tokenizers[entry.name] = load_tokenizer(entry, path)
        return self._tokenizers[entry.name]

    def _overlap_line(self, t: ModelEntry, d: ModelEntry) -> str:
        try:
            tt, dt = self._tokenizer(t), self._tokenizer(d)
        except (OSError, ValueError) as e:
            return f"- **vocabulary**: cannot read a tokenizer ({e})"
        if tt is None or dt is None:
            return "- **vocabulary**: overlap and alpha ceiling are shown once both models are fetched (load the pair)."
        if (t.name, d.name) not in self._overlaps:  # aligning two 150k vocabularies takes a second or two
            self._overlaps[(t.name, d.name)] = overlap_numbers(tt, dt)
        o = self._overlaps[(t.name, d.name)]
        if o["same_tokenizer"]:
            return "- **vocabulary**: identical tokenizers, so `standard` speculative decoding applies (ceiling 100%)."
        return (
            f"- **vocabulary**: {o['shared']:,} shared tokens ({o['shared_pct_target']:.1f}% of the target's "
            f"{o['target_vocab']:,}, {o['shared_pct_drafter']:.1f}% of the drafter's {o['drafter_vocab']:,}). "
            f"**Alpha ceiling for tli: {o['alpha_ceiling_tli']:.0%}**: the share of the target's tokens, on sample "
            f"code and prose, that the drafter can spell at all; `slem` drafts free text and is not bound by it."
        )

    # --- loading -----------------------------------------------------------------------------------------------

    def load(self, target: str, drafter: str, log=print):
        """Load (fetching if needed) and switch to this pair. On failure the previous pair stays loaded and usable."""
        from usd import api

        t, d = self.entry(target, "target"), self.drafter_entry(drafter)
        with self._load_lock:
            choice = Choice(t.name, d.name if d else NO_DRAFTER)
            if self.pair is not None and self.loaded == choice:
                return self.pair
            new = api.load_pair(
                target.strip(),
                drafter.strip() if d else False,
                catalog=self.catalog,
                device=self.device,
                precision=self.precision,
                log=log,
            )
            self._know_overlap(t, d, new)  # before the switch: should it fail, the previous pair stays
            # Dropping the last reference frees the old models; a generation still running on them keeps its own
            # reference, finishes, and then lets go.
            self.pair, self.loaded = new, choice
            del new
            _free_memory()
            return self.pair

    def _know_overlap(self, t: ModelEntry, d: ModelEntry | None, pair) -> None:
        """The loaded pair's overlap line from its own tokenizers and alignment, worked out now: the page asks for it
        as it opens, and reading two tokenizers again then took the cores from the first answer."""
        if d is None:
            return
        tt, dt = pair.target_tokenizer, pair.drafter_tokenizer
        self._tokenizers[t.name], self._tokenizers[d.name] = tt, dt
        self._overlaps[(t.name, d.name)] = overlap_numbers(tt, dt, pair.overlap(), pair.same_tokenizer)

    def current(self):
        if self.pair is None:
            raise LoadError("no pair is loaded: choose a target and a drafter in the Pair tab and press Load")
        return self.pair

    def describe(self) -> str:
        if self.loaded is None:
            return "No pair loaded."
        if self.loaded.drafter == NO_DRAFTER:
            return f"Loaded: target `{self.loaded.target}` · no drafter model (ngram and plain decoding)"
        return f"Loaded: target `{self.loaded.target}` · drafter `{self.loaded.drafter}`"

    def key(self) -> tuple:
        return (self.loaded.target, self.loaded.drafter) if self.loaded else ()


NO_DRAFTER_LINE = (
    "- **drafter**: none. `ngram` drafts by looking up the conversation (what the answer repeats of it is verified "
    "at a verify's cost, no model step) and `auto` weighs it beside plain decoding; tli, slem and standard need a "
    "drafter model."
)


def _readiness(entry: ModelEntry, plan: LoadPlan) -> str:
    """Whether loading `entry` as `plan` says has anything to fetch or convert first, in words."""
    if local_path(entry) is None:
        return "will be fetched on load"
    if plan.converted and local_path(entry, converted=True) is None:
        return "fetched; converted to float32 for transformers at its first load"
    return "ready"


def _free_memory() -> None:
    gc.collect()
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def overlap_numbers(target_tokenizer, drafter_tokenizer, overlap=None, same_tokenizer: bool | None = None) -> dict:
    """`usd overlap`'s numbers, alpha ceiling included, and whether the two tokenizers are one (`overlap` and
    `same_tokenizer`: what a loaded pair knows already)."""
    from usd.vocab import overlap_report, same_vocabulary

    report = overlap_report(target_tokenizer, drafter_tokenizer, overlap=overlap)
    if same_tokenizer is None:
        same_tokenizer = same_vocabulary(target_tokenizer, drafter_tokenizer)
    report["same_tokenizer"] = same_tokenizer
    return report
