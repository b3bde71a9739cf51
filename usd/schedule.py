"""Which algorithm and draft length each round uses: the ones a cost model, fed by the rounds so far, expects to emit
the most tokens per second (docs/design.md, "auto").

A round of mode m with draft length k costs k drafter steps, one target forward over k + 1 positions and the loop's
own work, and emits tau(alpha_m, k) = (1 - alpha^(k+1)) / (1 - alpha) tokens on average; a plain step costs one
target step and emits one. So the expected rate is

    rate(m, k) = tau(alpha_m, k) / (k d_m + V(k + 1) + o_m)          plain: 1 / (V(1) + o_none)

with d_m the drafter's step time, V(n) the target's forward time over n positions and o_m the rest of a round, each
a running (decayed) mean of what this machine measured, never an assumption of flat or linear cost: V(n) is read
where measured, interpolated between measured lengths, and extrapolated along the last measured slope beyond them.
Each round takes the (mode, k) of the highest rate; when no k beats plain decoding, auto decodes plainly and only
probes the others now and then, with a growing wait, so where speculation cannot pay it costs almost nothing.

Modes a generation may use: a fixed algorithm keeps its algorithm (its k still follows the model when
`draft_tokens="auto"`); `auto` chooses among plain decoding, the n-gram lookup, and standard, or tli and slem. A
lookup finds a continuation in some rounds only: in the others auto weighs the rest (`next`), and where it finds one
its round costs only the verify (and the lookup, priced as the round's other work), at its own measured alpha. Under
sampling with a seed, auto picks between plain decoding, slem and ngram only: the seed fixes their answer whatever the
schedule does (see `sampling.position_generator`), while tli's rejection-sampling draws depend on where rounds were
cut; for the same reason a seeded tli or standard with adaptive k drafts K_START tokens a round rather than what
timings suggest.
The estimates live in `pair.memory` and carry over to the next generation of the pair.

Choosing a mode or a length from past rounds only (never from the token about to be verified) keeps the output
lossless: every round emits tokens distributed as the target's, whatever it was told to do.
"""

from __future__ import annotations

from .algorithms import PLAIN, Algorithm, Proposal, auto_modes
from .events import Bound
from .record import RoundRecord
from .tally import reference_step
from .theory import best_k, tau

K_START = 4
"""The draft length a mode is first tried at, before anything is known about it (where the costs measured at load are
known, the length that could pay most instead: `Schedule.start_k`)."""
K_MAX = 8
MIN_TRIES = 3
"""Rounds a mode gets before the model judges it."""
PROBE_EVERY = 16
"""A mode that is not the best is still tried after this many rounds; each probe that finds it still losing doubles
its wait (up to PROBE_MAX, or to what PROBE_BUDGET needs), so a pair where speculation never pays costs almost nothing
to keep watching."""
PROBE_MAX = 256
PROBE_BUDGET = 0.01
"""The most of its time auto spends probing a losing mode: a probe that cost more than plain decoding would have (a
drafter catching up on a long context, say) waits until it is this share of the time since, PROBE_MAX or not."""
PROBE_BUDGET_MAX = 1024
"""The longest such wait, in rounds: a probe inflated by a one-off cost (a first call's warm-up) is not trusted more."""
DECAY = 0.85
"""Weight of the past in the running means of the drafter's step and a round's other work: about the last seven
observations count."""
WINDOW = 5
"""Forward times kept per length: the estimate is their median, so forwards slowed by other work on the machine (a UI
update, another process) move it only once most of the recent ones were slowed."""
REALISED_ROUNDS = 8
"""Rounds of a mode in one answer after which what they achieved is checked against plain decoding's speed measured
near them: a mode that realised fewer tokens/s is dropped from the answer (only probed again), whatever the model
predicted. A mode that pays 1.5x falls below plain over 8 rounds in about 3% of answers at alpha 0.6."""
ALPHA_DECAY = 0.97
"""The same for acceptance, counted per tested position: about the last thirty count (fewer make k jump around)."""
MIN_CONFIDENCE = 0.25
"""With adaptive k, stop a draft when the drafter's own top probability falls below this."""


def tested_positions(accepted: int, drafted: int) -> int:
    """The candidates of a round the verifier tested: all that were accepted, and the first rejected one if any (the
    ones after it were never tested)."""
    return accepted + (1 if accepted < drafted else 0)


def speedup_bound(c: float, v: dict[int, float], ceiling: float = 1.0, k_max: int = K_MAX) -> tuple[int, float]:
    """The most speculation can gain over plain decoding at each draft length, (k + 1) / (k c + v(k)) when every drafted
    token is accepted, or tau(ceiling, k) / (k c + v(k)) when acceptance cannot exceed `ceiling` (tli's alpha ceiling);
    `v`: the measured v(k) (others interpolated, `interpolate`). Returns the best k and its bound: where the bound is
    below 1, no draft length can pay, whatever the acceptance."""
    known = {1 + k: vk for k, vk in v.items()} | {1: 1.0}
    return best_k(ceiling, c, lambda k: interpolate(known, k + 1), range(1, k_max + 1))


def measured_v(costs: dict) -> dict[int, float]:
    """{k: v(k)} of the costs measured at load (usd/costs.py keeps k as a string, for JSON)."""
    return {int(k): vk for k, vk in costs["v"].items()}


def interpolate(known: dict[int, float], n: int) -> float:
    """A forward's time (or cost) over n positions from the lengths measured: the measured value, interpolated between
    measured lengths, extrapolated along the last measured slope beyond them (never assumed flat or linear)."""
    points = sorted(known.items())
    if n in known:
        return known[n]
    below = [(a, t) for a, t in points if a < n]
    above = [(a, t) for a, t in points if a > n]
    if below and above:
        (a, ta), (b, tb) = below[-1], above[0]
        return ta + (tb - ta) * (n - a) / (b - a)
    if len(points) == 1:
        a, ta = points[0]
        return ta * n / a  # one length known: proportional, the cautious guess until another is measured
    (a, ta), (b, tb) = (points[-2], points[-1]) if below else (points[0], points[1])
    slope = max(0.0, (tb - ta) / (b - a))
    return tb + slope * (n - b) if below else max(0.0, ta - slope * (a - n))


def median(xs: list[float]) -> float | None:
    xs = sorted(xs)
    if not xs:
        return None
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2


def _keep_last(window: list, x, n: int = WINDOW) -> None:
    window.append(x)
    del window[:-n]


class Mean:
    """A decayed running mean kept as [sum, weight] in a JSON-friendly list (it lives in pair.memory)."""

    @staticmethod
    def add(cell: list, x: float, decay: float = DECAY) -> None:
        cell[0] = decay * cell[0] + x
        cell[1] = decay * cell[1] + 1.0

    @staticmethod
    def of(cell: list | None) -> float | None:
        return cell[0] / cell[1] if cell and cell[1] > 0 else None


class CostModel:
    """What this machine measured for this pair: V(n), and per mode the drafter step, overhead and acceptance.

    A forward's time is compared only with plain steps measured near it: each verify is kept with its ratio to the
    plain step of that moment (the median of the last WINDOW), and V(n) is that ratio times the plain step now; the
    drafter's step likewise. So other work that slows the machine for a while slows the estimates of plain and
    speculative rounds alike, instead of making whichever was measured in the quiet look cheap."""

    def __init__(self, memory: dict, step_at_load: float | None = None):
        self.memory = memory
        self.step_at_load = step_at_load
        """The target's step timed at load (usd/costs.py): the reference until MIN_PLAIN_STEPS steps are measured."""
        self.steps = memory.setdefault("steps", [])  # seconds of the last WINDOW forwards over one position
        self.verify = memory.setdefault("verify", {})  # str(n) -> the last WINDOW [seconds, seconds / step then]
        self.modes = memory.setdefault("modes", {})  # mode -> {"draft", "c", "other", "hits", "rounds"}
        memory.setdefault("observed", 0)  # rounds observed into this memory, by any generation of the pair
        self._as_of: int | None = None
        """The `observed` count the two caches below hold for: a round's choice asks for V and each mode's best k
        dozens of times, and the medians behind them change only when a round is observed."""
        self._known: tuple[float | None, dict[int, float]] | None = None
        self._best_k: dict[tuple[str, int], tuple[int, float | None]] = {}

    def _mode(self, mode: str) -> dict:
        cells = ("draft", "c", "other", "hits")
        return self.modes.setdefault(mode, {**{c: [0.0, 0.0] for c in cells}, "rounds": 0})

    def step(self) -> float | None:
        """The target's single step: the median of the recent ones (the one timed at load while there are few: a
        first step slowed by other work made every verify after it look cheap)."""
        return reference_step(self.steps, median, self.step_at_load)

    def observe(self, r: RoundRecord) -> None:
        """A forward that fed no position (round 0's plain one) tells nothing of V."""
        step = self.step()  # the plain steps measured before this round: its reference
        self.memory["observed"] += 1
        fed = r.positions_fed
        if fed == 1:
            _keep_last(self.steps, r.verify_s)
        elif fed:
            _keep_last(self.verify.setdefault(str(fed), []), [r.verify_s, r.verify_s / step if step else None])
        m = self._mode(r.algorithm)
        m["rounds"] += 1
        # a draft with no model steps (a lookup) is priced as the round's other work: it costs what it took
        Mean.add(m["other"], r.other_s + (r.draft_s if not r.draft_steps else 0.0))
        for _ in range(r.draft_steps):
            Mean.add(m["draft"], r.draft_s / r.draft_steps)
            if step:
                Mean.add(m["c"], r.draft_s / r.draft_steps / step)
        for i in range(tested_positions(r.accepted, r.drafted)):  # acceptance as the verifier saw it
            Mean.add(m["hits"], 1.0 if i < r.accepted else 0.0, ALPHA_DECAY)

    def rounds(self, mode: str) -> int:
        return self.modes.get(mode, {}).get("rounds", 0)

    def alpha(self, mode: str) -> float | None:
        return Mean.of(self.modes.get(mode, {}).get("hits"))

    def V(self, n: int) -> float | None:
        """The target's forward over n positions: its ratio to the plain step measured near it, times the plain step
        now (`interpolate`d between measured lengths); in absolute seconds while no plain step has been measured (a
        fixed algorithm that never decodes plainly)."""
        step, known = self._lengths()
        if step is not None:
            return step * interpolate(known, n)
        return interpolate(known, n) if known else None

    def _fresh(self) -> None:
        """Drop the caches once another round has been observed into the memory."""
        if self._as_of != self.memory["observed"]:
            self._as_of, self._known, self._best_k = self.memory["observed"], None, {}

    def _lengths(self) -> tuple[float | None, dict[int, float]]:
        """The plain step and V's measured lengths: ratios to the step (with 1: 1.0), or seconds without a step."""
        self._fresh()
        if self._known is None:
            step = self.step()
            if step is not None:
                cells_of = self.verify.items()
                ratios = {int(key): median([r for _, r in cells if r is not None]) for key, cells in cells_of}
                known = {n_pos: r for n_pos, r in ratios.items() if r is not None} | {1: 1.0}
            else:
                absolute = {int(key): median([t for t, _ in cells]) for key, cells in self.verify.items() if cells}
                known = {n_pos: t for n_pos, t in absolute.items() if t is not None}
            self._known = (step, known)
        return self._known

    def draft_step(self, mode: str) -> float:
        """The drafter's step in seconds: its ratio to the plain steps near it, times the plain step now."""
        m, step = self.modes[mode], self.step()
        c = Mean.of(m["c"])
        return c * step if c is not None and step else (Mean.of(m["draft"]) or 0.0)

    def round_cost(self, mode: str, k: int) -> float | None:
        verify = self.V(k + 1)
        m = self.modes.get(mode)
        if verify is None or m is None:
            return None
        return k * self.draft_step(mode) + verify + (Mean.of(m["other"]) or 0.0)

    def rate(self, mode: str, k: int) -> float | None:
        """Expected emitted tokens per second of (mode, k); plain decoding's k is 0."""
        if Algorithm(mode).plain:
            cost = self.round_cost(mode, 0)
            return 1.0 / cost if cost else None
        alpha, cost = self.alpha(mode), self.round_cost(mode, k)
        return tau(alpha, k) / cost if alpha is not None and cost else None

    def best_k(self, mode: str, k_max: int = K_MAX) -> tuple[int, float | None]:
        self._fresh()
        if (mode, k_max) not in self._best_k:
            self._best_k[(mode, k_max)] = self._best_of(mode, k_max)
        return self._best_k[(mode, k_max)]

    def _best_of(self, mode: str, k_max: int) -> tuple[int, float | None]:
        rates = [(self.rate(mode, k), k) for k in range(1, k_max + 1)]
        known = [(r, k) for r, k in rates if r is not None]
        if not known:
            return K_START, None
        rate, k = max(known, key=lambda rk: (rk[0], -rk[1]))  # the shorter draft on a tie
        return k, rate

    def expected_speedup(self, mode: str, k: int) -> float | None:
        plain, rate = self.rate(PLAIN, 0), self.rate(mode, k)
        return rate / plain if plain and rate else None


class Schedule:
    def __init__(
        self,
        pair,
        algorithm: str,
        k: int | str,
        probe_first: bool = True,
        seeded_sampling: bool = False,
        lookup: bool = False,
    ):
        """`lookup`: auto may draft by n-gram lookup (the generation keeps the index)."""
        self.algorithm = algorithm = Algorithm(algorithm)
        self.modes = [algorithm]
        if algorithm.chooses:
            self.modes = auto_modes(pair.same_tokenizer, seeded_sampling, pair.drafter is not None, lookup)
        self.adaptive_k = k == "auto"
        self.k_fixed = None if self.adaptive_k else int(k)
        if self.adaptive_k and seeded_sampling and not algorithm.spec.seed_stable and not algorithm.chooses:
            # Rejection sampling's draws depend on where rounds are cut, and the model's k on wall-clock times: a
            # seed must still fix the sample, so these draft a fixed length (the confidence stop stays: it depends
            # on the drafter's logits only).
            self.k_fixed = K_START
        self.min_confidence = MIN_CONFIDENCE if self.adaptive_k else 0.0
        self.probe_first = probe_first
        self.probed = False
        """A plain round has fed a position: its time is the step behind c and v (round 0 feeds none, see decoder)."""
        self.round = 0
        memory = pair.memory.setdefault("schedule", {})
        self.model = CostModel(memory, (pair.memory.get("costs") or {}).get("step_s"))
        self.gap = memory.setdefault("gap", {})  # mode -> rounds to wait before probing it again
        # rounds since each mode last ran, counted across generations: a probe costs a drafter prefill and catch-up,
        # so restarting the count per generation would probe in every answer
        self.since = memory.setdefault("since", {})
        for m in self.modes:
            self.since.setdefault(m, 0)
        self.setup_s = memory.setdefault("setup_s", {})  # mode -> setup seconds its next wait has yet to pay off
        self.realised: dict[str, list[float]] = {}
        """This answer's rounds of each speculating mode: [their seconds, what plain decoding, measured near each,
        would have taken for their tokens, how many]."""
        self.dropped: set[str] = set()
        """Modes that realised less than plain decoding in this answer: never the best again in it, only probed."""
        self.start_k = self._start_lengths(pair)
        """The draft length each mode is tried at before the model judges it."""
        self.bound = self._bound(pair) if algorithm.chooses else None
        """auto only: when no draft length of the drafter model can pay on this machine (`speedup_bound` below 1, from
        the c and v(k) measured at load, usd/costs.py), the best of those bounds; auto then never drafts with the
        model (it decodes plainly from the first round where no lookup is weighed either)."""
        self.expected_speedup: float | None = None
        """What the model expects of the round just chosen, against plain decoding (None until it can tell)."""
        self.declined: tuple[str, int, float] | None = None
        """When auto chose a plain step although it could speculate: the best speculating (mode, k) it weighed and
        the speedup it expected of it (below 1 where speculation does not pay on this machine)."""

    def _bound(self, pair) -> Bound | None:
        """What speculation can gain here at most (`speedup_bound`), from the c and v(k) measured at load; modes that
        cannot pay are left out (tli when its alpha ceiling rules it out; the lookup, whose draft costs next to
        nothing, only where even a free draft cannot pay). The drafter model's bound when it cannot pay, else None
        (also where nothing was measured: then every mode is probed)."""
        costs = pair.memory.get("costs")
        if not costs:
            return None
        c, v = costs["c"], measured_v(costs)
        if speedup_bound(0.0, v)[1] < 1:
            self.modes = [m for m in self.modes if m.spec.proposes is not Proposal.LOOKUP]
        k, speedup = speedup_bound(c, v)
        if speedup < 1:
            self.modes = [m for m in self.modes if not m.needs_drafter]
            return Bound(k, speedup, c, interpolate({1 + kk: vk for kk, vk in v.items()} | {1: 1.0}, k + 1))
        ceiling = costs.get("tli_ceiling")
        if Algorithm.TLI in self.modes and ceiling is not None and speedup_bound(c, v, ceiling)[1] < 1:
            self.modes.remove(Algorithm.TLI)
        return None

    def _start_lengths(self, pair) -> dict[Algorithm, int]:
        """Where the costs were measured at load, each mode's first draft length is the one its bound is best at (for
        the lookup, with c = 0): on a machine where verifying many tokens costs many steps, the trials that judge a
        mode are not spent at a length it could never pay at. Otherwise K_START."""
        costs = pair.memory.get("costs")
        if not costs:
            return {}
        v = measured_v(costs)
        c_of = {m: 0.0 if m.spec.proposes is Proposal.LOOKUP else costs["c"] for m in self.modes if not m.plain}
        return {m: speedup_bound(c, v)[0] for m, c in c_of.items()}

    def k_for(self, mode: Algorithm) -> int:
        if mode.plain:
            return 0
        if self.k_fixed is not None:
            return self.k_fixed
        if self.model.rounds(mode) >= MIN_TRIES:
            return self.model.best_k(mode)[0]
        return self.start_k.get(mode, K_START)

    def per_token(self, mode: Algorithm) -> float:
        """Expected seconds per emitted token of a mode at its best k (inf while it is unknown)."""
        rate = self.model.rate(mode, self.k_for(mode))
        return 1.0 / rate if rate else float("inf")

    def next(self, found: bool = True) -> tuple[Algorithm, int]:
        """(algorithm, k) for the coming round; (PLAIN, 0) is a plain target step. `found`: whether a lookup finds a
        continuation of the committed ids now; where it finds none the lookup is not a candidate this round (a fixed
        ngram decodes plainly). Deciding from the committed ids alone keeps the round lossless."""
        modes = [m for m in self.modes if found or m.spec.proposes is not Proposal.LOOKUP]
        if (self.probe_first and not self.probed) or not modes:
            mode = PLAIN
        else:
            mode = modes[0] if len(modes) == 1 else self._choose(modes)
        k = self.k_for(mode)
        self.expected_speedup = 1.0 if mode.plain else self.model.expected_speedup(mode, k)
        self.declined = self._best_speculation(modes) if mode.plain and len(modes) > 1 else None
        return mode, k

    def _best_speculation(self, modes: list[Algorithm]) -> tuple[str, int, float] | None:
        options = [(m, self.k_for(m)) for m in modes if not m.plain]
        rated = [(m, k, self.model.expected_speedup(m, k)) for m, k in options]
        known = [(m, k, x) for m, k, x in rated if x is not None]
        return max(known, key=lambda option: option[2]) if known else None

    def _choose(self, modes: list[Algorithm]) -> Algorithm:
        untried = [m for m in modes if self.model.rounds(m) < MIN_TRIES]
        if untried:
            # in turn with plain steps, so that every trial is judged against plain steps measured next to it
            rotation = list(dict.fromkeys([*untried, *(m for m in modes if m.plain)]))
            return max(rotation, key=lambda m: self.since[m])
        best = self._best(modes)
        overdue = [m for m in modes if m != best and self.since[m] >= self.gap.get(m, PROBE_EVERY)]
        return max(overdue, key=lambda m: self.since[m]) if overdue else best

    def _best(self, modes: list[Algorithm] | None = None) -> Algorithm:
        """The mode of the least expected time per token, leaving out those this answer dropped."""
        kept = [m for m in modes or self.modes if m not in self.dropped]
        return min(kept, key=self.per_token)

    def observe(self, r: RoundRecord) -> None:
        """What the round cost and kept. Its setup (a drafter's prefill) is kept out of the rates, but counts in what
        probing its algorithm cost."""
        mode = r.algorithm
        self.round += 1
        self.probed = self.probed or (mode.plain and r.positions_fed != 0)
        for m in self.modes:
            self.since[m] = 0 if m == mode else self.since[m] + 1
        plain = self.per_token(PLAIN)  # before this round's times count: what plain decoding costs near it
        self.model.observe(r)
        if not mode.plain and len(self.modes) > 1:
            self._check_realised(mode, r.seconds, r.emitted, plain)
        if r.setup_s:
            self.setup_s[mode] = self.setup_s.get(mode, 0.0) + r.setup_s  # paid off at its next wait, once judged
        # a fixed algorithm's rounds tell auto too (the memory is the pair's) when that mode is next worth probing
        rivals = [PLAIN, *(m for m in self.modes if not m.plain)]
        if len(rivals) > 1 and self.model.rounds(mode) >= MIN_TRIES:
            best = self._best(rivals)
            if mode == best:
                self.gap[mode] = PROBE_EVERY
                self.setup_s.pop(mode, None)
            else:
                wait = self.gap.get(mode, PROBE_EVERY // 2)
                longer = 2 * wait if wait < PROBE_MAX else wait  # never shorter while it keeps losing
                spent = r.seconds + self.setup_s.pop(mode, 0.0)
                self.gap[mode] = max(longer, self._rounds_to_amortise(spent, r.emitted))

    def _check_realised(self, mode: str, seconds: float, emitted: int, plain_per_token: float) -> None:
        """Drop `mode` from this answer once its rounds here took longer than plain decoding would have for the same
        tokens, plain decoding's speed measured near them (taken back if later probes make up for it)."""
        if plain_per_token == float("inf"):
            return
        cell = self.realised.setdefault(mode, [0.0, 0.0, 0])
        cell[0] += seconds
        cell[1] += emitted * plain_per_token
        cell[2] += 1
        if cell[2] >= REALISED_ROUNDS:
            if cell[0] > cell[1]:
                self.dropped.add(mode)
            else:
                self.dropped.discard(mode)

    def _rounds_to_amortise(self, seconds: float, emitted: int) -> int:
        """Plain rounds after which a round that took `seconds` for `emitted` tokens cost PROBE_BUDGET of the time."""
        plain = self.per_token(PLAIN)
        if plain == float("inf"):
            return 0
        excess = seconds - emitted * plain
        return min(PROBE_BUDGET_MAX, max(0, int(excess / (PROBE_BUDGET * plain))))
