"""What one request may ask of the server before any route runs: a body of at most `protocol.MAX_BODY_BYTES`.
`BodyLimit` wraps a whole ASGI app (`usd serve`'s, and the app's Gradio server with its /v1 routes), so no route
reads more than that into memory, whatever it does with the body."""

from __future__ import annotations

import json

from . import protocol as p


class BodyLimit:
    """Refuse a request whose body is over `limit` bytes with a 413 in OpenAI's error shape: before reading any of it
    when it declares its length (Content-Length, which the HTTP server then holds it to), and as soon as it passes
    the limit when it does not (chunked)."""

    def __init__(self, app, limit: int = p.MAX_BODY_BYTES):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None:
            if declared > self.limit:
                await _respond(send, p.too_large(self.limit, declared))
            else:
                await self.app(scope, receive, send)
            return
        received, refused, started = 0, False, False

        async def counting_receive():
            nonlocal received, refused
            message = await receive()
            if message["type"] == "http.request" and not refused:
                received += len(message.get("body", b""))
                if received > self.limit:
                    refused = True
                    if not started:
                        await _respond(send, p.too_large(self.limit))
                    return {"type": "http.disconnect"}  # the route stops reading; what it answers is dropped
            return message

        async def guarded_send(message):
            nonlocal started
            if refused:
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        await self.app(scope, counting_receive, guarded_send)


def _content_length(scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the HTTP server refuses a malformed length itself
    return None


async def _respond(send, error: p.APIError) -> None:
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    # the body is not read: close the connection after the answer, instead of reading what is left of it
    headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
