"""One request's generation: it waits for a slot and runs `usd.stream` on a thread of its own, and hands each event
to the request's event loop. The decode loop never waits on the network; a client that goes away cancels it."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import TYPE_CHECKING

from usd import api, suggest
from usd.errors import Failed
from usd.events import Finished, Round
from usd.settings import GenerationSettings

if TYPE_CHECKING:
    from .service import Service
    from .slots import Ticket


class ClientGone(Exception):
    """The client disconnected before its answer was complete; its generation has been cancelled."""


_END = object()
POLL_S = 0.25
"""How often a request waiting for its first event (in line, or prefilling) checks that its client is still there."""


class Job:
    def __init__(self, service: Service, name: str, inputs: dict, settings: GenerationSettings):
        self.service, self.name, self.inputs, self.settings = service, name, inputs, settings
        self.prompt_tokens: int | None = None
        self.cancel = threading.Event()
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()
        self._getter: asyncio.Future | None = None
        self._ticket: Ticket | None = None

    def start(self) -> None:
        """Take a place in line now (QueueFull when the line is full) and start the worker, which waits for a slot."""
        self._ticket = self.service.slots.join(refuse_when_full=True)
        threading.Thread(target=self._work, name="usd-serve-job", daemon=True).start()

    def _work(self) -> None:
        ticket = self._ticket
        assert ticket is not None  # start() takes it before starting this worker
        try:
            self._check_prompt()
            if ticket.wait(self.cancel):
                self.service.wrap(self._generate)()
        except BaseException as e:  # handed to the request, which answers with it
            self._put(Failed(e))
        finally:
            ticket.leave()
            self._put(_END)

    def _check_prompt(self) -> None:
        """The prompt against the loaded pair's context, before the request waits in line for nothing. It runs here,
        on the request's own thread, holding its place in line: tokenizing a long prompt would stall every other
        request on the event loop, and the line's limit bounds how many are tokenized at once."""
        pair = self.service.loaded(self.name)
        if pair is not None:
            self.prompt_tokens = api.count_prompt(
                pair, self.settings, self.inputs.get("prompt"), self.inputs.get("messages")
            )

    def _generate(self) -> None:
        pair = self.service.pair(self.name)
        if self.prompt_tokens is None:
            self.prompt_tokens = api.count_prompt(
                pair, self.settings, self.inputs.get("prompt"), self.inputs.get("messages")
            )
        scope = self.service.memory_scope
        events = api.stream(pair, **self.inputs, settings=self.settings, cancel=self.cancel, scope=scope)
        for event in suggest.recording(pair, events, greedy=self.settings.greedy):
            self._put(event)

    def _count(self, pair) -> int:
        return api.count_prompt(pair, self.settings, self.inputs.get("prompt"), self.inputs.get("messages"))

    def _put(self, item) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the event loop has closed (the server is shutting down): nobody is listening
            self.cancel.set()

    async def next(self, request=None) -> Round | Finished:
        """The next event; the engine's error if it failed. With `request`, a client that disconnects while this
        waits cancels the generation (ClientGone). While streaming, the response itself notices a disconnect."""
        while True:
            if self._getter is None:
                self._getter = asyncio.ensure_future(self._queue.get())
            done, _ = await asyncio.wait({self._getter}, timeout=POLL_S if request is not None else None)
            if done:
                item, self._getter = self._getter.result(), None
                break
            if await request.is_disconnected():
                self.stop()
                raise ClientGone()
        if isinstance(item, Failed):
            raise item.error
        if item is _END:
            raise RuntimeError("the generation ended without its final event")
        return item

    def stop(self) -> None:
        """Cancel the generation (the worker frees its slot within a round) and stop waiting for it."""
        self.cancel.set()
        if self._getter is not None:
            with contextlib.suppress(Exception):
                self._getter.cancel()
            self._getter = None
