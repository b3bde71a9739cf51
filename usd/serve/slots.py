"""How many generations run at once on the loaded pair, and how many may wait: one `Slots` is shared by everything
that runs the models in a process (the /v1 routes, and in the app its UI events too)."""

from __future__ import annotations

import collections
import contextlib
import threading


class QueueFull(RuntimeError):
    """Every slot is busy and the waiting line is at its limit."""


class Slots:
    """`concurrency` generations at once, first come first served; at most `max_queue` wait. Thread-safe."""

    def __init__(self, concurrency: int = 1, max_queue: int = 16):
        self._cond = threading.Condition()
        self._waiting: collections.deque = collections.deque()
        self.running = 0
        self.configure(concurrency, max_queue)

    def configure(self, concurrency: int, max_queue: int) -> None:
        if concurrency < 1 or max_queue < 0:
            raise ValueError(
                f"concurrency must be at least 1 and max queue at least 0, got {concurrency} and {max_queue}"
            )
        with self._cond:
            self.concurrency, self.max_queue = concurrency, max_queue
            self._cond.notify_all()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def join(self, refuse_when_full: bool = True) -> Ticket:
        """A place in line, taken now (so a full line is refused at once, with QueueFull); `Ticket.wait` then waits
        for the slot. `refuse_when_full=False` joins anyway (the UI's events, which Gradio's own queue bounds)."""
        with self._cond:
            full = self.running >= self.concurrency or self._waiting
            if refuse_when_full and full and len(self._waiting) >= self.max_queue:
                raise QueueFull(
                    f"the server is busy: {self.running} generation(s) running and {len(self._waiting)} "
                    f"waiting, the most it queues; try again shortly"
                )
            ticket = Ticket(self)
            self._waiting.append(ticket)
            return ticket

    @contextlib.contextmanager
    def hold(self, cancel: threading.Event | None = None, refuse_when_full: bool = False):
        """Wait for a slot and hold it for the block; yields False (and holds nothing) when `cancel` was set first."""
        ticket = self.join(refuse_when_full)
        try:
            yield ticket.wait(cancel)
        finally:
            ticket.leave()


class Ticket:
    def __init__(self, slots: Slots):
        self.slots = slots
        self.holding = False
        self.gone = False

    def wait(self, cancel: threading.Event | None = None) -> bool:
        """Block until this ticket is first in line and a slot is free; then hold it. False if `cancel` came first."""
        s = self.slots
        with s._cond:
            while not (s._waiting and s._waiting[0] is self and s.running < s.concurrency):
                if cancel is not None and cancel.is_set():
                    self._drop()
                    return False
                s._cond.wait(timeout=0.1)
            s._waiting.popleft()
            self.gone = True
            s.running += 1
            self.holding = True
            s._cond.notify_all()  # the next in line may fit too (concurrency > 1)
            return True

    def leave(self) -> None:
        """Give the slot back, or the place in line; safe to call more than once."""
        with self.slots._cond:
            if self.holding:
                self.slots.running -= 1
                self.holding = False
            self._drop()
            self.slots._cond.notify_all()

    def _drop(self) -> None:
        if not self.gone:
            self.gone = True
            with contextlib.suppress(ValueError):
                self.slots._waiting.remove(self)
