"""Drafting from memory: the `suffix` source drafts what followed the context's last tokens in the answers this process
gave before (kept per target tokenizer and per scope, bounded in bytes) and earlier in the conversation itself. A user
who asks, in a new conversation, for an earlier answer again with a change gets that answer's spans as drafts, which
the n-gram lookup, blind to other conversations, cannot propose (after SuffixDecoding, arXiv 2411.04975).

Where several earlier texts continue the matched suffix, the continuation most of them share is drafted, token by
token, while the share of occurrences that agree stays high; the draft may run longer the longer the match.

What it proposes depends only on the committed ids and on earlier answers, never on the target's coming tokens, and
is deterministic (q one-hot): exact match keeps the output the target's (docs/design.md §5), as for the n-gram lookup.

Memory is scoped so that no one learns another's text from drafts or their timing: a scope's drafts come from its own
answers only (per visitor session in a Space, per API key on a keyed server, one scope on a local app).
"""

from __future__ import annotations

import re
import threading
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from .drafting import Draft, Start, cut_after_eos

KEY_TOKENS = 3
"""Tokens of the n-grams the index is keyed by: the shortest match that drafts (as the n-gram lookup's N_MIN)."""
MATCH_MAX = 64
"""The longest match measured, in tokens."""
SCAN_MAX = 128
"""Occurrences of a key examined per lookup, newest first: a common n-gram costs a bounded time."""
DRAFT_PER_MATCHED = 1
"""A draft may run up to this many tokens per matched one: a long match is likely to go on the same way, a short one
soon parts (docs/benchmarks.md, "suffix": longer drafts per matched token were kept less and gained less)."""
MIN_SHARE = 0.5
"""A draft stops where fewer than this share of the matched occurrences, multiplied along the draft, agree on it: a
majority."""
DEFAULT_BOUND = 64 << 20
"""Bytes the memory may hold unless told otherwise (`usd serve --suffix-memory`, the app's option)."""
TOKEN_BYTES, ENTRY_BYTES, KEY_BYTES = 4, 8, 232
"""What the memory is charged for a remembered token, an index entry and an index key (an int, its array and its
slot in the dict): estimates at or above what CPython spends on them (tests/test_suffix.py measures)."""
LOCAL = "local"
"""The scope of a single-user app or an unkeyed server: its chats share one memory."""


UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "kb": 10**3, "m": 1 << 20, "mib": 1 << 20, "mb": 10**6}
UNITS |= {"g": 1 << 30, "gib": 1 << 30, "gb": 10**9}


def parse_size(text: str | int) -> int:
    """A memory bound in bytes from '64MiB', '512KB', '1g', '0' (off) or an int; a ValueError that says what to give
    otherwise."""
    found = re.fullmatch(r"\s*(\d+)\s*([a-z]*)\s*", str(text), re.IGNORECASE)
    unit = found.group(2).lower() if found else None
    if found is None or unit not in UNITS:
        raise ValueError(f"suffix memory {text!r} is not a size: give bytes, or a size like 64MiB, 512KB or 0 (off)")
    size = int(found.group(1)) * UNITS[unit]
    if size > 1 << 40:
        raise ValueError(f"suffix memory {text!r} is too large: at most 1TiB (0 turns it off)")
    return size


def _key(a: int, b: int, c: int) -> int:
    """One int for an n-gram (ids of up to 21 bits are exact; a larger id may share a key, which the match, checked
    token by token, then tells apart)."""
    return (a << 42) | (b << 21) | c


@dataclass(frozen=True)
class Occurrence:
    ids: array
    after: int
    """The position in `ids` right after the matched tokens."""
    matched: int


class Texts:
    """Token texts and the index of their KEY_TOKENS-grams: key -> references (text serial << 32 | the position after
    the n-gram), newest last. A text's entries stay until enough are stale to compact the index (`compact`)."""

    def __init__(self):
        self.texts: dict[int, array] = {}
        self.index: dict[int, array] = {}
        self.entries = 0
        self.stale = 0
        self.tokens = 0

    @property
    def nbytes(self) -> int:
        return self.tokens * TOKEN_BYTES + self.entries * ENTRY_BYTES + len(self.index) * KEY_BYTES

    def add(self, serial: int, ids: array) -> None:
        self.texts[serial] = ids
        self.tokens += len(ids)
        self._index(serial, ids, 0)

    def grow(self, serial: int, more: list[int]) -> None:
        """Append to a text (the conversation as it is committed), indexing the n-grams that now have a follower."""
        ids = self.texts[serial]
        start = len(ids)
        ids.extend(more)
        self.tokens += len(more)
        self._index(serial, ids, start)

    def _index(self, serial: int, ids: array, start: int) -> None:
        for after in range(max(KEY_TOKENS, start), len(ids)):
            key = _key(ids[after - 3], ids[after - 2], ids[after - 1])
            refs = self.index.get(key)
            if refs is None:
                refs = self.index[key] = array("q")
            refs.append((serial << 32) | after)
            self.entries += 1

    def drop(self, serial: int) -> None:
        ids = self.texts.pop(serial)
        self.tokens -= len(ids)
        self.stale += max(0, len(ids) - KEY_TOKENS)
        if self.stale * 2 > self.entries:
            self.compact()

    def compact(self) -> None:
        """Rebuild the index from the texts kept: dropped texts' entries and keys go."""
        self.index, self.entries, self.stale = {}, 0, 0
        for serial, ids in self.texts.items():
            self._index(serial, ids, 0)

    def occurrences(self, tail: list[int]) -> list[Occurrence]:
        """Where the last KEY_TOKENS ids of `tail` occurred, each with how many of tail's last ids it matches."""
        if len(tail) < KEY_TOKENS:
            return []
        refs = self.index.get(_key(*tail[-KEY_TOKENS:]))
        if refs is None:
            return []
        found = []
        for ref in reversed(refs[-SCAN_MAX:]):
            ids = self.texts.get(ref >> 32)
            if ids is None:
                continue
            after = ref & 0xFFFFFFFF
            n = 0
            while n < MATCH_MAX and n < len(tail) and after > n and ids[after - n - 1] == tail[-n - 1]:
                n += 1
            if n >= KEY_TOKENS:
                found.append(Occurrence(ids, after, n))
        return found


class SuffixMemory:
    """The answers this process gave, per (target tokenizer, scope), within `bound` bytes in all: the oldest answer,
    whatever its scope, goes first. Thread-safe (a server's generations remember and look up at once)."""

    def __init__(self, bound: int = DEFAULT_BOUND):
        self.bound = bound
        self.scopes: dict[tuple[str, str], Texts] = {}
        self.order: OrderedDict[int, tuple[str, str]] = OrderedDict()
        self.serial = 0
        self.nbytes = 0
        """The scopes' bytes in all, kept as texts come and go: a server's memory may hold thousands of scopes, too
        many to sum at every eviction step."""
        self.lock = threading.Lock()

    def resize(self, bound: int) -> None:
        with self.lock:
            self.bound = bound
            self._evict()

    def scope(self, tokenizer: str, scope: str) -> Scope:
        return Scope(self, (tokenizer, scope))

    def remember(self, where: tuple[str, str], ids: list[int]) -> None:
        cost = len(ids) * (TOKEN_BYTES + ENTRY_BYTES + KEY_BYTES)
        if len(ids) <= KEY_TOKENS or cost > self.bound:
            return
        with self.lock:
            self.serial += 1
            texts = self.scopes.setdefault(where, Texts())
            before = texts.nbytes
            texts.add(self.serial, array("i", ids))
            self.nbytes += texts.nbytes - before
            self.order[self.serial] = where
            self._evict()

    def _evict(self) -> None:
        while self.order and self.nbytes > self.bound:
            serial, where = self.order.popitem(last=False)
            texts = self.scopes[where]
            before = texts.nbytes
            texts.drop(serial)
            self.nbytes += texts.nbytes - before
            if not texts.texts:
                del self.scopes[where]

    def occurrences(self, where: tuple[str, str], tail: list[int]) -> list[Occurrence]:
        with self.lock:
            texts = self.scopes.get(where)
            return texts.occurrences(tail) if texts is not None else []


@dataclass(frozen=True)
class Scope:
    """One scope's view of the memory: what a generation looks up in and adds its answer to."""

    memory: SuffixMemory
    where: tuple[str, str]

    def remember(self, ids: list[int]) -> None:
        self.memory.remember(self.where, list(ids))

    def occurrences(self, tail: list[int]) -> list[Occurrence]:
        return self.memory.occurrences(self.where, tail)


MEMORY = SuffixMemory()
"""This process's memory: the server's, the app's and the bench's answers (each in its own scopes)."""


def continuation(found: list[Occurrence], k: int) -> list[int]:
    """The draft from the occurrences of the longest match: at each position the token most of them go on with, while
    the share that agree, multiplied along the draft, stays at least MIN_SHARE; at most DRAFT_PER_MATCHED tokens per
    matched one."""
    if not found:
        return []
    longest = max(o.matched for o in found)
    group = [o for o in found if o.matched == longest]
    limit = min(k, DRAFT_PER_MATCHED * longest)
    draft: list[int] = []
    confidence = 1.0
    while len(draft) < limit:
        j = len(draft)
        counts: dict[int, int] = {}
        for o in group:
            if o.after + j < len(o.ids):
                t = o.ids[o.after + j]
                counts[t] = counts.get(t, 0) + 1
        if not counts:
            break
        token, count = max(counts.items(), key=lambda tc: tc[1])  # on a tie, the newest occurrence's
        confidence *= count / sum(counts.values())
        if confidence < MIN_SHARE:
            break
        draft.append(token)
        group = [o for o in group if o.after + j < len(o.ids) and o.ids[o.after + j] == token]
    return draft


class SuffixSource:
    """suffix's source: the continuation of the context's last tokens that earlier answers in this scope and the
    conversation so far agree on (`continuation`)."""

    CONVERSATION = 0

    def __init__(self, start: Start):
        self.memory: Scope | None = start.memory
        self.eos = start.rules.eos
        self.context = list(start.prompt_ids)
        self.conversation = Texts()
        self.conversation.add(self.CONVERSATION, array("i", start.prompt_ids))
        self.found: tuple[int, list[Occurrence]] = (-1, [])
        """The occurrences of the context's suffix, for the context's length: looked up once a round."""

    def _found(self) -> list[Occurrence]:
        if self.found[0] != len(self.context):
            tail = self.context[-MATCH_MAX:]
            found = self.conversation.occurrences(tail)
            found += self.memory.occurrences(tail) if self.memory is not None else []
            self.found = (len(self.context), found)
        return self.found[1]

    def available(self) -> bool:
        return bool(self._found())

    def room(self) -> int:
        return 1 << 30

    def pending(self) -> int:
        return 0

    def propose(self, k: int) -> Draft:
        candidates = cut_after_eos(continuation(self._found(), k), self.eos)
        return Draft(candidates, [], [() for _ in candidates], 0)

    def commit(self, emitted: list[int]) -> None:
        self.context.extend(emitted)
        self.conversation.grow(self.CONVERSATION, emitted)
