"""Which llama.cpp kernels compute each position: the rule the llama.cpp runner's losslessness rests on.

Lossless needs a position's logits to be the same bits whenever it is evaluated: alone (plain decoding, a drafter
step), inside a verify batch, or again after a rollback or after another generation displaced it from the cache.
llama.cpp's CPU backend picks kernels by batch size, and some sum in another order than the one-row kernels
(`checks.batch_invariance` measures how far a batch moves a position's logits; docs/benchmarks.md has the numbers).

- Attention: without flash attention, KQ and KQV are matmuls against the f16 cache, which llamafile's tinyBLAS serves
  for two queries or more and vec_dot for one; with flash attention and an f16 V cache, one query over 512 cached
  positions or more takes a split-KV kernel and 64 queries or more a tiled one. So the model's contexts run flash
  attention with a bf16 V cache beside the f16 K cache (`model.py`), which keeps every batch on the one-row kernel
  (it skips masked positions, so the cache's padding does not matter either).
- tinyBLAS also serves Q8_0/Q5_0 weights at two rows or more; on the CPUs measured it gives vec_dot's bits. Should
  another CPU differ, tests/test_llamacpp.py says so, and -DGGML_LLAMAFILE=OFF in CMAKE_ARGS is the fix.
- The matmuls remain, in two families of kernels, each giving a row the same bits in any batch it serves, but the two
  summing in different orders:
  * repacked weights (llama.cpp's default "extra buffer types", and ours: interleaved Q4_0 and Q4_K on AVX2, not
    Q6_K there) multiply a batch of GEMM_ROWS (4) rows or more in whole groups of 4 (gemm) and the rest row by row
    (gemv); the matrices not repacked take the plain-weight kernels below, by batch size;
  * plain weights (`repacked_weights=False`) take the tiled K-quant matmul at PREFILL_MIN_ROWS (8) rows or more
    and vec_dot below.
  `Batching` holds each layout's geometry: the largest row batch, and the multiple a prefill batch comes in.
- With usd-chat's exact-rows patch (patches/llama-cpp-python-exact-rows.patch, which ./dev.sh builds), a product of 2
  to binding.EXACT_ROWS rows gives each row the bits of the one-row kernels: the tiled and llamafile matmuls are left
  out at those sizes, repacked Q4_K weights take a gemv that unpacks each interleaved block once for all the rows (on
  AVX-512, two column groups a vector), Q6_K a vec_dot that does the same (on AVX-512, two of its steps a
  vector), other types vec_dot row by row. Then a row batch is up to EXACT_ROWS rows whatever the layout, and the
  prefill kernels begin above it (`Batching.for_weights`). The first model a process loads checks it
  (`model.LlamaCppModel._check_rows`); rows that differ put the process back on the rule above, and the load line
  says so.
- Where the CPU has AMX, a model's twin (twin.py) computes every call on the prefill kernels on its AMX tiles, whose
  rows get the same bits in any batch; the choice below of what each position is computed on is the same.

So each position gets a `Kernel` once, and keeps it:
- ROW: the row kernels (row batches of at most 3 rows with repacked weights, 7 with plain ones, EXACT_ROWS with the
  patch);
- PREFILL: the prefill kernels, in whole gemm groups within batches of at least PREFILL_MIN_ROWS;
- TAIL: the rows of a prefill batch after its last whole gemm group (repacked weights only: gemv for the repacked
  matrices, the prefill kernels for the others).
`Batching.kernels` is the rule that chooses them; `Batching.calls` cuts positions into llama_decode calls that honour
them; `Batching.refeed_from` says where feeding must start to compute a position on its kernels again. A context
records each position's kernel and the cache records what computed what it holds, so a context reuses only cached
positions its own kernels computed (`context.py`).

The contract: every position computed under `Batching.kernels`' choice, in the calls `Batching.calls` cuts, gets the
same bits whenever it is computed; and a prompt's kernels depend on the prompt alone, never on what the cache or an
earlier turn held, so plain decoding and every algorithm compute every position of every turn on the same kernels.
tests/test_llamacpp.py checks that each family's batch gap is exactly 0.0 on the real models, that a prompt's logits do
not depend on what the cache held, and that a chat's turn gets the same bits whatever ran the turns before.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from enum import IntEnum

from ...errors import InternalError

N_BATCH = 512
"""The most tokens per llama_decode call: llama_batch_init sizes its arrays for this many (a longer call writes past
them)."""
PREFILL_MIN_ROWS = 8
"""llama.cpp's tiled K-quant matmul takes batches of this many rows or more (ggml-cpu/tiled/tiled.cpp) and sums in
another order than the row kernels below it."""
GEMM_ROWS = 4
"""Repacked weights multiply a batch of 4 rows or more in groups of this many (gemm), the rest row by row (gemv)."""


class Kernel(IntEnum):
    """What computes a position (the module docstring)."""

    ROW = 0
    PREFILL = 1
    TAIL = 2


ROW, PREFILL, TAIL = Kernel.ROW, Kernel.PREFILL, Kernel.TAIL


@dataclass(frozen=True)
class Batching:
    """The llama_decode calls that give a position the same bits in any of them, for one weight layout: at most
    `row_batch` rows on the row kernels; on the prefill kernels at least `prefill_min`, in multiples of `multiple`."""

    row_batch: int
    multiple: int
    prefill_min: int = PREFILL_MIN_ROWS
    exact_rows: bool = False
    """The row batches are the exact-rows patch's (one call verifies up to `row_batch` tokens)."""

    @staticmethod
    def for_weights(repacked: bool, exact_rows: int = 0) -> Batching:
        """The layout's batching; with `exact_rows` (a llama.cpp whose products of 2 to that many rows give each row
        its one-row bits: binding.exact_rows) every call of up to that many rows is on the row kernels, and the
        prefill kernels begin above it."""
        if exact_rows > 1:
            multiple = GEMM_ROWS if repacked else 1
            # the smallest prefill batch above the row batches that is whole groups (a refeed starts that far back)
            smallest = -(-(exact_rows + 1) // multiple) * multiple
            return Batching(exact_rows, multiple, max(PREFILL_MIN_ROWS, smallest), True)
        # repacked: gemv below GEMM_ROWS rows, whole gemm groups above; plain: vec_dot below the tiled matmul's floor
        return Batching(GEMM_ROWS - 1, GEMM_ROWS) if repacked else Batching(PREFILL_MIN_ROWS - 1, 1)

    @property
    def key(self) -> str:
        """The rule in a word, for keys of what was measured under it."""
        return f"exact-rows-{self.row_batch}" if self.exact_rows else f"row-batch-{self.row_batch}"

    @property
    def rule(self) -> str:
        """The rule in words, for the load line."""
        if self.exact_rows:
            return f"exact rows: a verify of up to {self.row_batch} tokens in one call, each weight read once"
        return f"a verify in calls of at most {self.row_batch} tokens"

    def kernels(self, known: list[Kernel], n: int, read: int) -> list[Kernel]:
        """The rule: what computes each of n positions, given the kernels of the first len(known) (a position keeps
        its kernels for good), when the logits of the last `read` are wanted.

        - A prompt (nothing known yet): one prefill run, its last token included, as llama.cpp's own generate reads a
          prompt: whole gemm groups (PREFILL), then the rows left (TAIL); on the row kernels if too short for a
          prefill batch. It depends on n alone.
        - After it: the positions read on the row kernels (a verify, a plain step, a drafter's step); those before
          them that are not read (a drafter catching up on the answer; the target never has such) on the prefill
          kernels, joining a prefill run the known positions end with, as far as whole prefill batches reach; the
          rest on the row kernels."""
        if not known:
            gemm = self.prefill_run(n)
            return [PREFILL] * gemm + [TAIL] * (n - gemm) if gemm else [ROW] * n
        undecided = n - len(known)
        if undecided <= 0:
            return known
        unread = max(0, n - read - len(known))
        run = _trailing_prefill(known)
        more = max(0, self.prefill_run(run + unread) - run)
        return known + [PREFILL] * more + [ROW] * (undecided - more)

    def prefill_run(self, n: int) -> int:
        """The most of n positions one run on the prefill kernels can take (0: too few for a prefill batch)."""
        n -= n % self.multiple
        return n if n >= self.prefill_min else 0

    def whole_runs(self, kernels: list[Kernel]) -> list[Kernel]:
        """`kernels` cut back to the last position a prefill batch can compute again (a trailing prefill run that a
        rollback cut short is decided afresh). TAIL rows, however many of them are left, follow whole gemm groups of
        at least PREFILL_MIN_ROWS: a batch of those and them gives their bits again."""
        if kernels and kernels[-1] == TAIL:
            return kernels
        run = _trailing_prefill(kernels)
        return kernels[: len(kernels) - run + self.prefill_run(run)]

    def refeed_from(self, kernels: list[Kernel], start: int) -> int:
        """Where feeding must start for the positions from `start` on to be computed on their kernels: `start`, or
        earlier when it cuts into a prefill run, from where a prefill batch that ends with the run's gemm groups (and
        takes all the TAIL rows after them) starts."""
        if start >= len(kernels) or kernels[start] == ROW:
            return start
        while kernels[start] == TAIL and kernels[start - 1] == TAIL:
            start -= 1  # the TAIL rows are those a batch leaves after its gemm groups: all of them or none
        end = start
        while end < len(kernels) and kernels[end] == PREFILL:
            end += 1
        return end - max(self.prefill_min, -(-(end - start) // self.multiple) * self.multiple)

    def calls(self, kinds: list[Kernel]) -> list[tuple[int, int]]:
        """[start, end) of each llama_decode call: a run on the row kernels in batches of at most `row_batch`; a
        prefill run (PREFILL rows, then any TAIL rows) as `prefill_sizes` cuts it."""
        out, start = [], 0
        for family, counts in _family_runs(kinds):
            if family == ROW:
                sizes = _near_equal(counts[ROW], -(-counts[ROW] // self.row_batch))
            else:
                sizes = self.prefill_sizes(counts[PREFILL], counts[TAIL])
            for size in sizes:
                out.append((start, start + size))
                start += size
        return out

    def prefill_sizes(self, gemm: int, tail: int) -> list[int]:
        """The llama_decode calls of a prefill run of `gemm` PREFILL rows and then `tail` TAIL rows: as few as
        N_BATCH allows, near-equal, each but the last in whole gemm groups, the last taking the TAIL rows. Every call
        has at least PREFILL_MIN_ROWS rows (the prefill kernels' floor), as a run of at least that many split into
        parts of about N_BATCH / 2 or more does."""
        if not gemm or self.prefill_run(gemm) != gemm or tail >= self.multiple:
            raise InternalError(
                f"a prefill run of {gemm} + {tail} positions (prefill batches take {self.prefill_min} or more, in "
                f"whole groups of {self.multiple} but for fewer TAIL rows)"
            )
        parts = -(-(gemm + tail) // N_BATCH)
        # the larger parts first: the last, which takes the TAIL rows, is one of the smaller, and so still fits
        sizes = [self.multiple * units for units in _near_equal(gemm // self.multiple, parts)]
        sizes[-1] += tail
        return sizes


def _trailing_prefill(kernels: list[Kernel]) -> int:
    """How many positions at the end of `kernels` the prefill kernels computed in whole gemm groups (a run that more
    positions may join: none after a TAIL, which ends its batch)."""
    n = 0
    while n < len(kernels) and kernels[-1 - n] == PREFILL:
        n += 1
    return n


def _near_equal(total: int, parts: int) -> list[int]:
    """`total` split into `parts` sizes that differ by at most one, the larger first."""
    base, extra = divmod(total, parts)
    return [base + (i < extra) for i in range(parts)]


def _family_runs(kinds: list[Kernel]) -> list[tuple[Kernel, dict[Kernel, int]]]:
    """`kinds` as the runs llama_decode calls compute, in order: (ROW, {ROW: n}) for a run of row kinds, and
    (PREFILL, {PREFILL: g, TAIL: t}) for PREFILL rows and the TAIL rows that close them."""
    runs: list[tuple[Kernel, dict[Kernel, int]]] = []
    for kind, group in itertools.groupby(kinds):
        call = ROW if kind == ROW else PREFILL
        last = runs[-1] if runs else None
        joins = last is not None and last[0] == call and (call == ROW or (kind == TAIL and not last[1][TAIL]))
        if not joins:
            runs.append((call, {ROW: 0} if call == ROW else {PREFILL: 0, TAIL: 0}))
        runs[-1][1][ROW if call == ROW else Kernel(kind)] += len(list(group))
    return runs
