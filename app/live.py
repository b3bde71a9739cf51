"""The live views' own update channel: while a generation streams, its live views (token view, stats, chart) are
updated over a server-sent-events route of the app's, not through Gradio's queue.

Every message Gradio streams to the page costs the browser a fixed amount of work (its bookkeeping of the event's
outputs and statuses, Svelte's update), whatever it carries; on a CPU machine that work runs on the cores the engine
decodes on, and a step whose thread it displaces waits for it (docs/benchmarks.md, "The Chat tab against the engine").
A message on this channel costs the page only what it shows: the live view's script (app/views.py LIVE_JS) appends the
new pieces and chart rows. So the views update a few times a second while Gradio sends only the chat's answer, less
often, and each view's first and last value (the last whole, so a page that missed the channel still ends right).

A channel is open for one generation; its route is named by an unguessable token, which only the generation's own
page receives (in its live view's first value). A channel lives in this process: where a generation runs in another
(ZeroGPU), the app opens none and Gradio carries every update, as before."""

from __future__ import annotations

import asyncio
import json
import secrets
import threading
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

ROUTE = "/usd/live/{token}"
KEEPALIVE_S = 15.0
"""A comment line this often on an idle stream, so that proxies keep it open."""


class Channel:
    """One generation's updates, in order, for every page that reads them: each reader gets them all from the first
    (a reconnecting page replays them, which its script skips: they cover what it shows), then each new one."""

    def __init__(self, token: str):
        self.token = token
        self.url = ROUTE.format(token=token).lstrip("/")  # relative: the page's own root, on a Space too
        self._messages: list[str] = []
        self._closed = False
        self._lock = threading.Lock()
        self._wakers: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

    def publish(self, message: dict) -> None:
        with self._lock:
            if self._closed:
                return
            self._messages.append(json.dumps(message))
            self._wake()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._wake()

    def _wake(self) -> None:
        for loop, event in self._wakers:
            loop.call_soon_threadsafe(event.set)

    async def events(self) -> AsyncIterator[str]:
        """The stream a reader gets: every message as an SSE event, then an `end` event once the channel closes."""
        event = asyncio.Event()
        waker = (asyncio.get_running_loop(), event)
        with self._lock:
            self._wakers.append(waker)
        sent = 0
        try:
            while True:
                event.clear()
                with self._lock:
                    new, closed = self._messages[sent:], self._closed
                sent += len(new)
                for message in new:
                    yield f"data: {message}\n\n"
                if closed:
                    yield "event: end\ndata: {}\n\n"
                    return
                if not new:
                    try:
                        await asyncio.wait_for(event.wait(), KEEPALIVE_S)
                    except TimeoutError:
                        yield ": keepalive\n\n"
        finally:
            with self._lock:
                self._wakers.remove(waker)


class Channels:
    """The channels of the generations streaming now, by token, and the route that serves them."""

    def __init__(self):
        self._open: dict[str, Channel] = {}
        self._lock = threading.Lock()

    def open(self) -> Channel:
        channel = Channel(secrets.token_urlsafe(18))
        with self._lock:
            self._open[channel.token] = channel
        return channel

    def close(self, channel: Channel) -> None:
        """The generation ended: its readers get the end, and the route no longer knows its token."""
        with self._lock:
            self._open.pop(channel.token, None)
        channel.close()

    def __len__(self) -> int:
        with self._lock:
            return len(self._open)

    async def serve(self, request: Request) -> Response:
        with self._lock:
            channel = self._open.get(request.path_params["token"])
        if channel is None:  # ended, or never was: 204 tells the page's EventSource not to reconnect
            return Response(status_code=204)
        headers = {"Cache-Control": "no-store", "X-Accel-Buffering": "no"}
        return StreamingResponse(channel.events(), media_type="text/event-stream", headers=headers)

    def route(self) -> Route:
        return Route(ROUTE, self.serve, methods=["GET"])
