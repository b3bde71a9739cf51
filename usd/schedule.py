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
`draft_tokens="auto"`); `auto` chooses among plain decoding, the lookups (`Algorithm.looks_up`), and standard, or tli
and slem. A lookup finds a continuation in some rounds only: in the others auto weighs the rest (`next` is told which
sources can propose), and where it finds one its round costs only the verify (and the lookup, priced as the round's
other work), at its own measured alpha. Under sampling with a seed, auto picks among plain decoding, slem and the
lookups only: the seed fixes their answer whatever the
schedule does (see `sampling.position_generator`), while tli's rejection-sampling draws depend on where rounds were
cut; for the same reason a seeded tli or standard with adaptive k drafts K_START tokens a round rather than what
timings suggest.
The estimates live in `pair.memory` and carry over to the next generation of the pair.

Choosing a mode or a length from past rounds only (never from the token about to be verified) keeps the output
lossless: every round emits tokens distributed as the target's, whatever it was told to do.
"""

from __future__ import annotations

from collections.abc import Collection

from . import settings
from .algorithms import DRAFTING, PLAIN, Algorithm, auto_modes
from .drafters import CATCH_UP_MIN
from .events import Bound, Source, SourceState
from .memory import Learned, LoadCosts, ModeStats
from .record import RoundRecord
from .tally import MIN_PLAIN_STEPS, reference_step
from .theory import best_k, tau

K_START = 4
"""The draft length a mode is first tried at, before anything is known about it (where the costs measured at load are
known, the length that could pay most instead: `Schedule.start_k`)."""
K_MAX = 8
"""The longest draft of a drafter model (each of its tokens costs a drafter step)."""
K_MAX_LOOKUP = 16
"""The longest draft of the lookup, whose drafts cost next to nothing: a copied span whole, where the verify is flat
(a llama.cpp with exact rows verifies up to 16 tokens in one call); the cost model chooses shorter ones where it is
not."""
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
PROBE_SHARE = 0.02
"""The most of an answer's expected time (its max new tokens at plain decoding's speed, or the tokens so far where
more) that auto lets speculation lose in it: a round that might lose (a source not yet judged, or judged to lose, or
a lookup not yet judged by its acceptance in this answer) runs only while its worst case, added to what speculative
rounds lost in this answer so far (`Schedule.lost_s`: a mode's gains pay for its own misses), stays within it."""
DEFAULT_ANSWER_TOKENS = 128
"""The answer length the probing budget assumes before the pair has given any answer (then: the typical length of
its answers so far, never more than the max new tokens asked for)."""
LENGTH_BUCKET = 512
"""Cache lengths whose costs are kept apart: under 512 positions, then each doubling (`length_bucket`)."""
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
ALPHA_PRIOR = 0.5
ALPHA_PRIOR_WEIGHT = 2.0
"""The acceptance a mode is assumed to have before it is tested, and how many tested positions that assumption weighs
(`CostModel.alpha`)."""
MIN_CONFIDENCE = 0.25
"""With adaptive k, stop a draft when the drafter's own top probability falls below this."""


def tested_positions(accepted: int, drafted: int) -> int:
    """The candidates of a round the verifier tested: all that were accepted, and the first rejected one if any (the
    ones after it were never tested)."""
    return accepted + (1 if accepted < drafted else 0)


def k_max_of(mode: Algorithm) -> int:
    """The longest draft of a mode."""
    return K_MAX_LOOKUP if mode.looks_up else K_MAX


def speedup_bound(c: float, v: dict[int, float], ceiling: float = 1.0, k_max: int = K_MAX) -> tuple[int, float]:
    """The most speculation can gain over plain decoding at each draft length, (k + 1) / (k c + v(k)) when every drafted
    token is accepted, or tau(ceiling, k) / (k c + v(k)) when acceptance cannot exceed `ceiling` (tli's alpha ceiling);
    `v`: the measured v(k) (others interpolated, `interpolate`). Returns the best k and its bound: where the bound is
    below 1, no draft length can pay, whatever the acceptance."""
    known = {1 + k: vk for k, vk in v.items()} | {1: 1.0}
    return best_k(ceiling, c, lambda k: interpolate(known, k + 1), range(1, k_max + 1))


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


def length_bucket(context: int) -> str:
    """The cache lengths whose costs are kept together: under LENGTH_BUCKET positions, then each doubling of it (a
    forward's attention grows with the cache, and flash attention changes kernels past 512 cells)."""
    return str((context // LENGTH_BUCKET).bit_length())


def _nearest(buckets, bucket: str) -> str:
    return min(buckets, key=lambda b: (abs(int(b) - int(bucket)), int(b)))


class CostModel:
    """What this machine measured for this pair: V(n) per cache length, the drafter's catching up, and per mode the
    drafter step, overhead and acceptance; the costs measured at load (`prior`) stand in for what the loop has not
    measured yet.

    A forward's time is compared only with plain steps measured near it: each verify is kept with its ratio to the
    plain step of that moment (the median of the last WINDOW at that cache length), and V(n) is that ratio times the
    plain step now; the drafter's step likewise. So other work that slows the machine for a while slows the estimates
    of plain and speculative rounds alike, instead of making whichever was measured in the quiet look cheap."""

    def __init__(self, memory: Learned, prior: LoadCosts | None = None):
        self.memory = memory
        self.prior = prior
        """The costs timed at load (usd/costs.py), a prior only: each is used until the loop has measured its own."""
        self.step_at_load: float | None = prior.step_s if prior else None
        """The reference step until MIN_PLAIN_STEPS steps are measured."""
        self.bucket = length_bucket(0)
        """The cache length what the model is asked about is priced at (`at`)."""
        self._as_of: tuple[int, str] | None = None
        """The `observed` count and bucket the caches below hold for: a round's choice asks for V, round costs and
        each mode's best k dozens of times, and the medians behind them change only when a round is observed."""
        self._known: tuple[float | None, dict[int, float]] | None = None
        self._best_k: dict[tuple[str, int], tuple[int, float | None]] = {}
        self._costs: dict[tuple[str, int, int], float | None] = {}

    def at(self, context: int) -> None:
        """Price what is asked next at a target cache of `context` positions."""
        self.bucket = length_bucket(context)

    def step(self) -> float | None:
        """The target's single step at this cache length: the median of the recent ones there, or at the nearest
        length with enough (the one timed at load while there are few: a first step slowed by other work made every
        verify after it look cheap)."""
        return self._lengths()[0]

    def _step(self, bucket: str) -> float | None:
        known = self.memory.steps
        enough = [b for b, xs in known.items() if len(xs) >= MIN_PLAIN_STEPS]
        steps = known.get(bucket, []) if bucket in enough or not enough else known[_nearest(enough, bucket)]
        return reference_step(steps, median, self.step_at_load)

    def observe(self, r: RoundRecord) -> None:
        """A forward that fed no position (round 0's plain one) tells nothing of V."""
        bucket = length_bucket(r.context)
        step = self._step(bucket)  # the plain steps measured before this round: its reference
        self.memory.observed += 1
        fed = r.positions_fed
        if fed == 1:
            _keep_last(self.memory.steps.setdefault(bucket, []), r.verify_s)
        elif fed:
            cells = self.memory.verify.setdefault(bucket, {}).setdefault(str(fed), [])
            _keep_last(cells, [r.verify_s, r.verify_s / step if step else None])
        if r.setup_tokens and step:
            Mean.add(self.memory.feed, r.setup_s / r.setup_tokens / step)
        m = self.memory.mode(r.algorithm)
        m.rounds += 1
        # a draft with no model steps (a lookup) is priced as the round's other work: it costs what it took
        Mean.add(m.other, r.other_s + (r.draft_s if not r.draft_steps else 0.0))
        for _ in range(r.draft_steps):
            Mean.add(m.draft, r.draft_s / r.draft_steps)
            if step:
                Mean.add(m.c, r.draft_s / r.draft_steps / step)
        for i in range(tested_positions(r.accepted, r.drafted)):  # acceptance as the verifier saw it
            Mean.add(m.hits, 1.0 if i < r.accepted else 0.0, ALPHA_DECAY)

    def _stats(self, mode: Algorithm) -> ModeStats:
        """The mode's measurements, empty where it has none (not kept: a mode asked about is not one observed)."""
        return self.memory.modes.get(mode) or ModeStats()

    def rounds(self, mode: Algorithm) -> int:
        return self._stats(mode).rounds

    def alpha(self, mode: Algorithm) -> float | None:
        """The mode's acceptance per tested position, recent positions weighted up (ALPHA_DECAY), starting from
        ALPHA_PRIOR_WEIGHT positions of ALPHA_PRIOR that fade as the tested ones do: three candidates kept at k = 1 are
        no promise that eight would be, while a mode tested over many positions reads as measured."""
        hits = self._stats(mode).hits
        if hits[1] <= 0:
            return None
        # the cell's weight is sum(ALPHA_DECAY^i) over the tested positions, so the prior's faded weight follows from it
        faded = ALPHA_PRIOR_WEIGHT * max(0.0, 1.0 - hits[1] * (1.0 - ALPHA_DECAY))
        return (hits[0] + ALPHA_PRIOR * faded) / (hits[1] + faded)

    def V(self, n: int) -> float | None:
        """The target's forward over n positions: its ratio to the plain step measured near it, times the plain step
        now (`interpolate`d between measured lengths); in absolute seconds while no plain step has been measured (a
        fixed algorithm that never decodes plainly)."""
        step, known = self._lengths()
        if step is not None:
            return step * interpolate(known, n)
        return interpolate(known, n) if known else None

    def verify_costs(self) -> dict[int, float] | None:
        """v(k), V(k + 1) over the step, for k = 1..K_MAX_LOOKUP as the model reads them now (None without a step)."""
        step, known = self._lengths()
        return {k: interpolate(known, k + 1) for k in range(1, K_MAX_LOOKUP + 1)} if step is not None else None

    def drafter_c(self) -> float | None:
        """The drafter's step over the target's as the loop measured it (the cheapest of its modes), if it has."""
        measured = [c for m in DRAFTING if (c := Mean.of(self._stats(m).c))]
        return min(measured) if measured else None

    def _fresh(self) -> None:
        """Drop the caches once another round has been observed into the memory, or another length is asked about."""
        key = (self.memory.observed, self.bucket)
        if self._as_of != key:
            self._as_of, self._known, self._best_k, self._costs = key, None, {}, {}

    def _lengths(self) -> tuple[float | None, dict[int, float]]:
        """The plain step and V's known lengths: ratios to the step (with 1: 1.0), the loop's where it measured them
        and the load's, scaled by what the loop found of them, elsewhere; or seconds without a step."""
        self._fresh()
        if self._known is None:
            step = self._step(self.bucket)
            if step is not None:
                measured = self._ratios()
                known = {**self._prior_ratios(measured), **measured, 1: 1.0}
            else:
                absolute = {int(n): median([t for t, _ in cells]) for n, cells in self._cells().items() if cells}
                known = {n_pos: t for n_pos, t in absolute.items() if t is not None}
            self._known = (step, known)
        return self._known

    def _cells(self) -> dict[str, list]:
        """The verifies measured at this cache length, or at the nearest length where any were."""
        verify = self.memory.verify
        measured = [b for b, by_n in verify.items() if any(by_n.values())]
        if not measured:
            return {}
        return verify[self.bucket if self.bucket in measured else _nearest(measured, self.bucket)]

    def _ratios(self) -> dict[int, float]:
        ratios = {int(n): median([r for _, r in cells if r is not None]) for n, cells in self._cells().items()}
        return {n: r for n, r in ratios.items() if r is not None}

    def _prior_ratios(self, measured: dict[int, float]) -> dict[int, float]:
        """The load's V(n) over the step, scaled by how the loop's measurements of the same lengths compare."""
        prior = {1 + k: vk for k, vk in self.prior.v.items()} if self.prior else {}
        shared = [measured[n] / prior[n] for n in measured if n in prior]
        scale = sum(shared) / len(shared) if shared else 1.0
        return {n: vn * scale for n, vn in prior.items()}

    def draft_step(self, mode: Algorithm) -> float:
        """The drafter's step in seconds: its ratio to the plain steps near it (the load's c until the loop measured
        one), times the plain step now."""
        m, step = self._stats(mode), self.step()
        c = Mean.of(m.c)
        if c is None and mode.needs_drafter and self.prior:
            c = self.prior.c
        return c * step if c is not None and step else (Mean.of(m.draft) or 0.0)

    def catch_up(self, pending: int) -> float:
        """Seconds the drafter takes to feed the `pending` positions it lacks before it drafts (none up to
        CATCH_UP_MIN, which its first step feeds): per position as the loop measured it, else as timed at load."""
        rate, step = Mean.of(self.memory.feed) or (self.prior.feed if self.prior else None), self.step()
        return (pending - 1) * rate * step if pending > CATCH_UP_MIN and rate and step else 0.0

    def round_cost(self, mode: Algorithm, k: int, pending: int = 0) -> float | None:
        """A round's expected seconds; with `pending`, the drafter's catching up on that many positions first."""
        self._fresh()
        key = (mode, k, pending if pending > CATCH_UP_MIN else 0)
        if key not in self._costs:
            self._costs[key] = self._round_cost(mode, k, pending)
        return self._costs[key]

    def _round_cost(self, mode: Algorithm, k: int, pending: int) -> float | None:
        verify = self.V(k + 1)
        if verify is None:
            return None
        other = Mean.of(self._stats(mode).other) or 0.0
        catch_up = self.catch_up(pending) if mode.needs_drafter else 0.0
        return k * self.draft_step(mode) + verify + other + catch_up

    def rate(self, mode: Algorithm, k: int, alpha: float | None = None) -> float | None:
        """Expected emitted tokens per second of (mode, k) once the drafter is in step, at the mode's acceptance (or
        `alpha`); plain decoding's k is 0."""
        if mode.plain:
            cost = self.round_cost(mode, 0)
            return 1.0 / cost if cost else None
        alpha, cost = alpha if alpha is not None else self.alpha(mode), self.round_cost(mode, k)
        return tau(alpha, k) / cost if alpha is not None and cost else None

    def best_k(self, mode: Algorithm, k_max: int = K_MAX) -> tuple[int, float | None]:
        self._fresh()
        if (mode, k_max) not in self._best_k:
            self._best_k[(mode, k_max)] = self._best_of(mode, k_max)
        return self._best_k[(mode, k_max)]

    def best_k_at(self, mode: Algorithm, alpha: float, k_max: int) -> int:
        """The best k of a mode at the acceptance `alpha` (a lookup's in the current answer)."""
        return self._best_of(mode, k_max, alpha)[0]

    def _best_of(self, mode: Algorithm, k_max: int, alpha: float | None = None) -> tuple[int, float | None]:
        rates = [(self.rate(mode, k, alpha), k) for k in range(1, k_max + 1)]
        known = [(r, k) for r, k in rates if r is not None]
        if not known:
            return K_START, None
        rate, k = max(known, key=lambda rk: (rk[0], -rk[1]))  # the shorter draft on a tie
        return k, rate

    def expected_speedup(self, mode: Algorithm, k: int) -> float | None:
        plain, rate = self.rate(PLAIN, 0), self.rate(mode, k)
        return rate / plain if plain and rate else None


class Schedule:
    def __init__(
        self,
        pair,
        algorithm: Algorithm,
        k: int | str,
        probe_first: bool = True,
        seeded_sampling: bool = False,
        lookup: bool = False,
        answer_tokens: int = settings.MAX_NEW_TOKENS_MAX,
    ):
        """`lookup`: auto may draft by n-gram lookup (the generation keeps the index). `answer_tokens`: the most the
        answer may take (max new tokens), which bounds the length auto's probing budget expects."""
        self.algorithm = algorithm
        self.modes = [algorithm]
        if algorithm.chooses:
            self.modes = auto_modes(pair.same_tokenizer, seeded_sampling, pair.drafter is not None, lookup)
        self.weighed = list(self.modes)
        """The modes auto weighs, those the bound leaves out included (the panel says why each is off)."""
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
        memory = pair.memory.schedule
        self.model = CostModel(memory, pair.memory.costs)
        self.gap, self.since, self.setup_s = memory.gap, memory.since, memory.setup_s
        for m in self.modes:
            self.since.setdefault(m, 0)
        self.answer_tokens = self._expected_length(memory, answer_tokens)
        """The answer's expected length: what sizes its probing budget (a max new tokens of thousands is no reason to
        probe more in an answer that, like the pair's earlier ones, ends after a few dozen)."""
        self.emitted = 0
        self.net_s: dict[Algorithm, float] = {}
        """Per speculating mode, what its rounds in this answer took beyond plain decoding measured near them, their
        catching up included, net of what they gained, never below minus one budget (`lost_s`)."""
        self.pending = 0
        """Positions the drafter lacks before the coming round (`next`): what it would catch up on to draft."""
        self.recent: dict[str, list[float]] = {}
        """Per speculating mode, a running mean of what its latest rounds in this answer took beyond plain decoding
        (negative: they gained)."""
        self.realised: dict[str, list[float]] = {}
        """This answer's rounds of each speculating mode: [their seconds, what plain decoding, measured near each,
        would have taken for their tokens, how many]."""
        self.tested_here: dict[Algorithm, tuple[int, int]] = {}
        """Per speculating mode, (accepted, tested) over the candidates its rounds in this answer drafted."""
        self.dropped: set[str] = set()
        """Modes that realised less than plain decoding in this answer: not run again in it."""
        self.left_out: dict[Algorithm, float] = {}
        """Modes the bound leaves out, with the most they could gain here (below 1)."""
        self.start_k = self._start_lengths(pair)
        """The draft length each mode is tried at before the model judges it."""
        self.bound = self._bound(pair) if algorithm.chooses else None
        """auto only: when no draft length of the drafter model can pay on this machine (`speedup_bound` below 1, from
        the c and v(k) the loop measured, or those measured at load before it has, usd/costs.py), the best of those
        bounds; auto then never drafts with the model (it decodes plainly from the first round where no lookup is
        weighed either)."""
        self.expected_speedup: float | None = None
        """What the model expects of the round just chosen, against plain decoding (None until it can tell)."""
        self.declined: tuple[str, int, float] | None = None
        """When auto chose a plain step although it could speculate: the best speculating (mode, k) it weighed and
        the speedup it expected of it (below 1 where speculation does not pay on this machine)."""

    @staticmethod
    def _expected_length(memory: Learned, max_new_tokens: int) -> float:
        """The typical length of the pair's answers (a running mean, the last one folded in now), or
        DEFAULT_ANSWER_TOKENS before any, at most `max_new_tokens`."""
        last, memory.last_answer = memory.last_answer, 0
        if last:
            Mean.add(memory.answer_tokens, last)
        return min(max_new_tokens, Mean.of(memory.answer_tokens) or DEFAULT_ANSWER_TOKENS)

    def _costs_now(self, costs: LoadCosts) -> tuple[float, dict[int, float], str]:
        """c and v(k) as the loop measured them in earlier answers of the pair (in this process or, kept in the cost
        cache, an earlier one), the load's where it has not; and which of the two c is."""
        c, v = self.model.drafter_c(), self.model.verify_costs() or costs.v
        return (costs.c, v, "at load") if c is None else (c, v, "while decoding")

    def _bound(self, pair) -> Bound | None:
        """What speculation can gain here at most (`speedup_bound`); modes that cannot pay are left out (tli when its
        alpha ceiling rules it out; the lookup, whose draft costs next to nothing, only where even a free draft cannot
        pay). The drafter model's bound when it cannot pay, else None (also where nothing was measured: then every
        mode is probed)."""
        costs = pair.memory.costs
        if not costs:
            return None
        c, v, measured = self._costs_now(costs)
        free = speedup_bound(0.0, v, k_max=K_MAX_LOOKUP)[1]
        if free < 1:
            self._leave_out([m for m in self.modes if m.looks_up], free)
        k, speedup = speedup_bound(c, v)
        if speedup < 1:
            self._leave_out([m for m in self.modes if m.needs_drafter], speedup)
            return Bound(k, speedup, c, interpolate({1 + kk: vk for kk, vk in v.items()} | {1: 1.0}, k + 1), measured)
        ceiling = costs.tli_ceiling
        capped = speedup_bound(c, v, ceiling)[1] if ceiling is not None else 1.0
        if Algorithm.TLI in self.modes and capped < 1:
            self._leave_out([Algorithm.TLI], capped)
        return None

    def _leave_out(self, modes: list[Algorithm], bound: float) -> None:
        for m in modes:
            self.modes.remove(m)
            self.left_out[m] = bound

    def _start_lengths(self, pair) -> dict[Algorithm, int]:
        """Where the costs were measured (at load, or by the loop since), each mode's first draft length is the one
        its bound is best at (for the lookup, with c = 0): on a machine where verifying many tokens costs many steps,
        the trials that judge a mode are not spent at a length it could never pay at. Otherwise K_START."""
        costs = pair.memory.costs
        if not costs:
            return {}
        c, v, _ = self._costs_now(costs)
        c_of = {m: 0.0 if m.looks_up else c for m in self.modes if not m.plain}
        return {m: speedup_bound(c_m, v, k_max=k_max_of(m))[0] for m, c_m in c_of.items()}

    def k_for(self, mode: Algorithm) -> int:
        if mode.plain:
            return 0
        if self.k_fixed is not None:
            return self.k_fixed
        here = self._lookup_alpha(mode)
        if here is not None:  # auto's lookup, judged by its acceptance in this answer: the k it pays most at
            return self.model.best_k_at(mode, here, k_max_of(mode))
        if self.model.rounds(mode) >= MIN_TRIES:
            return self.model.best_k(mode, k_max_of(mode))[0]
        return self.start_k.get(mode, K_START)

    def per_token(self, mode: Algorithm) -> float:
        """Expected seconds per emitted token of a mode at its best k (inf while it is unknown)."""
        rate = self.model.rate(mode, self.k_for(mode), self._lookup_alpha(mode))
        return 1.0 / rate if rate else float("inf")

    def _lookup_alpha(self, mode: Algorithm) -> float | None:
        """auto's lookup's acceptance in this answer, once judged there (`alpha_here`); None for the other modes."""
        return self.alpha_here(mode) if mode.looks_up and self.algorithm.chooses else None

    def _untried(self, mode: Algorithm) -> bool:
        """Whether the mode still needs trials before it is judged: MIN_TRIES rounds on the pair, and for auto's
        lookup also enough tested candidates in this answer (whether this answer repeats earlier text is found out
        only by trying, within the budget)."""
        untested = mode.looks_up and self.algorithm.chooses and self.alpha_here(mode) is None
        return self.model.rounds(mode) < MIN_TRIES or untested

    def next(
        self, available: Collection[Algorithm] | None = None, pending: int = 0, context: int = 0
    ) -> tuple[Algorithm, int]:
        """(algorithm, k) for the coming round; (PLAIN, 0) is a plain target step. `available`: the modes whose source
        can propose now (None: all); the others are not candidates this round (a lookup that finds nothing to
        continue: a fixed ngram decodes plainly). `pending`: the positions the drafter lacks (what it would catch up
        on first); `context`: the target's cache length. Deciding from the committed ids alone keeps the round
        lossless."""
        self.model.at(context)
        self.pending = pending
        modes = [m for m in self.modes if m.plain or available is None or m in available]
        if (self.probe_first and not self.probed) or not modes:
            mode = PLAIN
        else:
            mode = modes[0] if len(modes) == 1 else self._choose(modes)
        k = self._fit(mode) if self.algorithm.chooses else self.k_for(mode)
        if k == 0:
            mode = PLAIN
        self.expected_speedup = 1.0 if mode.plain else self.model.expected_speedup(mode, k)
        self.declined = self._best_speculation(modes) if mode.plain and len(modes) > 1 else None
        return mode, k

    def budget_s(self) -> float:
        """What speculation may lose in this answer: PROBE_SHARE of its expected time at plain decoding's speed."""
        return PROBE_SHARE * max(self.answer_tokens, self.emitted) * self.per_token(PLAIN)

    @property
    def lost_s(self) -> float:
        """What speculation lost in this answer: the net losses of the modes that lost (one mode's gains do not pay
        for another's probes, `_room`)."""
        return sum(max(0.0, net) for net in self.net_s.values())

    def _room(self, mode: Algorithm) -> float:
        """What a round of `mode` that may lose can still lose in this answer: the budget less what speculation lost
        so far, plus what the mode's own rounds gained here. Its gains pay for its own misses, not another's: a lookup
        that copied, then missed once and is priced at its worst case again goes on (a ledger floored at 0, which
        counted no gain, ended it for the rest of an answer that copies), and is not shut out by the other lookup's
        probes. Whatever it spends, the answer's losses stay within one budget."""
        return self.budget_s() - self.lost_s + max(0.0, -self.net_s.get(mode, 0.0))

    def _excess(self, mode: Algorithm, k: int) -> float | None:
        """What a round of (mode, k) would take beyond plain decoding of the tokens it emits, the drafter's catching
        up included: as expected where the mode is judged, in its worst case (no draft kept) where it is not yet. A
        lookup is judged in each answer afresh, by its acceptance there (`alpha_here`): whether it is right depends on
        whether this answer repeats earlier text, which its acceptance in other answers does not tell (an answer in
        another language or script after many that copied code)."""
        plain, cost = self.per_token(PLAIN), self.model.round_cost(mode, k, self.pending)
        if plain == float("inf") or cost is None:
            return None
        if mode.looks_up:
            alpha = self.alpha_here(mode)
        else:
            alpha = self.model.alpha(mode) if self.model.rounds(mode) >= MIN_TRIES else None
        return cost - (tau(alpha, k) if alpha is not None else 1.0) * plain

    def alpha_here(self, mode: Algorithm) -> float | None:
        """The mode's acceptance in this answer, once it tested MIN_TRIES positions here: its tested positions, with
        ALPHA_PRIOR_WEIGHT more at its acceptance in earlier answers (ALPHA_PRIOR before any). Its time in this
        answer would not do: a copied span that ends inside a long draft makes one round lose several steps' worth
        while the lookup stays right (the next span copies again); its acceptance says whether it is."""
        hits, tested = self.tested_here.get(mode, (0, 0))
        if tested < MIN_TRIES:
            return None
        earlier = self.model.alpha(mode)
        prior = earlier if earlier is not None else ALPHA_PRIOR
        return (hits + ALPHA_PRIOR_WEIGHT * prior) / (tested + ALPHA_PRIOR_WEIGHT)

    def _gained_here(self, mode: Algorithm) -> bool:
        """Whether the mode's latest rounds in this answer took less than plain decoding would have."""
        return (Mean.of(self.recent.get(mode)) or 0.0) < 0

    def _fit(self, mode: Algorithm) -> int:
        """auto's draft length for `mode` this round: its k, or the longest shorter one whose round the probing
        budget allows (0: none). A round expected to gain may run, and one that may lose only while its excess fits
        the mode's `_room`. Once that is spent, a mode whose latest rounds in this answer gained goes on (the model may
        lag a change), and a lookup only at a length that this answer's acceptance expects to gain: its rounds there
        judge it, where a drafter model's acceptance over earlier answers might lag a change."""
        if mode.plain or mode in self.dropped:
            return 0
        room = self._room(mode)
        if room <= 0:
            if self._gained_here(mode):
                return self.k_for(mode)
            if not mode.looks_up:
                return 0
        for k in range(self.k_for(mode), 0, -1):
            excess = self._excess(mode, k)
            if excess <= max(room, 0.0) if excess is not None else room > 0:
                return k
        return 0

    def _best_speculation(self, modes: list[Algorithm]) -> tuple[str, int, float] | None:
        options = [(m, self.k_for(m)) for m in modes if not m.plain]
        rated = [(m, k, self.model.expected_speedup(m, k)) for m, k in options]
        known = [(m, k, x) for m, k, x in rated if x is not None]
        return max(known, key=lambda option: option[2]) if known else None

    def _choose(self, modes: list[Algorithm]) -> Algorithm:
        modes = [m for m in modes if m.plain or self._fit(m) > 0]
        untried = [m for m in modes if not m.plain and self._untried(m)]
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
        """What the round cost and kept. Its setup (a drafter's prefill or catching up) is kept out of the rates, but
        counts in what probing its algorithm cost and in what the answer's speculation lost."""
        mode = r.algorithm
        self.round += 1
        self.probed = self.probed or (mode.plain and r.positions_fed != 0)
        for m in self.modes:
            self.since[m] = 0 if m == mode else self.since[m] + 1
        plain = self.per_token(PLAIN)  # before this round's times count: what plain decoding costs near it
        self.model.observe(r)
        self.emitted += r.emitted
        self.model.memory.last_answer = self.emitted
        if not mode.plain:
            hits, tested = self.tested_here.get(mode, (0, 0))
            self.tested_here[mode] = (hits + r.accepted, tested + tested_positions(r.accepted, r.drafted))
        if not mode.plain and len(self.modes) > 1 and plain != float("inf"):
            excess = r.seconds + r.setup_s - r.emitted * plain
            self.net_s[mode] = max(-self.budget_s(), self.net_s.get(mode, 0.0) + excess)
            Mean.add(self.recent.setdefault(mode, [0.0, 0.0]), excess)
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

    def _check_realised(self, mode: Algorithm, seconds: float, emitted: int, plain_per_token: float) -> None:
        """Drop `mode` from the rest of this answer once its rounds here took longer than plain decoding would have
        for the same tokens (plain decoding's speed measured near them), over REALISED_ROUNDS rounds or by more than
        the whole probing budget (unless it is a lookup still right here, `_right_here`), whatever the model
        predicted."""
        cell = self.realised.setdefault(mode, [0.0, 0.0, 0])
        cell[0] += seconds
        cell[1] += emitted * plain_per_token
        cell[2] += 1
        lost = cell[0] - cell[1]
        if (cell[2] >= REALISED_ROUNDS and lost > 0) or (lost > self.budget_s() and not self._right_here(mode)):
            self.dropped.add(mode)

    def _right_here(self, mode: Algorithm) -> bool:
        """A lookup whose acceptance in this answer expects one of its rounds to gain: one long draft that missed
        after rounds that copied is no evidence that it stopped being right (its next rounds are shorter)."""
        if not mode.looks_up:
            return False
        excess = (self._excess(mode, k) for k in range(1, self.k_for(mode) + 1))
        return any(e is not None and e <= 0 for e in excess)

    def realised_speedup(self, mode: Algorithm) -> float | None:
        """What the mode's rounds in this answer achieved against plain decoding measured near them."""
        cell = self.realised.get(mode)
        return cell[1] / cell[0] if cell and cell[0] > 0 else None

    def sources(self, chosen: Algorithm, available: Collection[Algorithm]) -> tuple[Source, ...]:
        """Each source auto weighs, after it chose `chosen` for a round: which one runs, and why each other is off."""
        return tuple(self._source(m, chosen, m in available) for m in self.weighed if not m.plain)

    def _source(self, m: Algorithm, chosen: Algorithm, found: bool) -> Source:
        realised, expected = self.realised_speedup(m), self.model.expected_speedup(m, self.k_for(m))
        if m == chosen:
            return Source(m, SourceState.IN_USE, realised if realised is not None else expected)
        if m in self.left_out:
            return Source(m, SourceState.CANNOT_PAY, self.left_out[m])
        if m in self.dropped:
            return Source(m, SourceState.DROPPED, realised)
        if not found:
            return Source(m, SourceState.NO_MATCH, expected)
        if self._fit(m) == 0:
            return Source(m, SourceState.BUDGET, expected)
        if self._untried(m):
            return Source(m, SourceState.UNTRIED)
        return Source(m, SourceState.LOSES if expected is not None and expected < 1 else SourceState.SLOWER, expected)

    def _rounds_to_amortise(self, seconds: float, emitted: int) -> int:
        """Plain rounds after which a round that took `seconds` for `emitted` tokens cost PROBE_BUDGET of the time."""
        plain = self.per_token(PLAIN)
        if plain == float("inf"):
            return 0
        excess = seconds - emitted * plain
        return min(PROBE_BUDGET_MAX, max(0, int(excess / (PROBE_BUDGET * plain))))
