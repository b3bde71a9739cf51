"""The /v1 routes (FastAPI): GET /v1/models, POST /v1/chat/completions and POST /v1/completions, plain or streamed
as server-sent events. `usd serve` runs them on their own; the app adds them to its Gradio server, on its one pair."""

from __future__ import annotations

import functools
import json
import logging
import secrets
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from fastapi.sse import EventSourceResponse, format_sse_event
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from usd import api, chat
from usd.errors import InternalError
from usd.events import Finished, Round
from usd.loading import LoadError
from usd.settings import GenerationSettings

from . import protocol as p
from .jobs import ClientGone, Job
from .limits import BodyLimit
from .service import Service
from .slots import QueueFull

log = logging.getLogger("usd.serve")


bearer = HTTPBearer(auto_error=False, description="the server's API key, when it has one")
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]


def _openai_errors(route):
    """Errors leave as OpenAI's error object with the right status, never as a traceback."""

    @functools.wraps(route)
    async def wrapped(*args, **kwargs):
        try:
            return await route(*args, **kwargs)
        except p.APIError as e:
            return JSONResponse(e.body(), status_code=e.status)
        except ClientGone:
            return JSONResponse(p.APIError(400, "the client disconnected").body(), status_code=400)
        except Exception as e:
            log.exception("request failed")
            e = engine_error(e)
            return JSONResponse(e.body(), status_code=e.status)

    return wrapped


def engine_error(e: BaseException) -> p.APIError:
    """An error from the engine as the client should see it."""
    if isinstance(e, p.APIError):
        return e
    if isinstance(e, api.ContextLengthError):
        return p.bad_request(str(e), "messages", "context_length_exceeded")
    if isinstance(e, chat.PromptError):
        return p.bad_request(str(e), "messages")
    if isinstance(e, QueueFull):
        return p.APIError(429, str(e), None, "queue_full")
    if isinstance(e, LoadError):
        return p.APIError(503, f"the model could not be loaded: {e}", "model", "model_not_loaded")
    if isinstance(e, ValueError):  # the engine's other input checks (e.g. an algorithm this pair cannot run)
        return p.bad_request(str(e))
    if isinstance(e, InternalError):
        return p.APIError(500, f"internal error (a bug in the engine, please report it): {e}", None, "internal_error")
    return p.APIError(500, f"internal error: {type(e).__name__}: {e}", None, "internal_error")


def create_router(service: Service) -> APIRouter:
    router = APIRouter(prefix="/v1", tags=["OpenAI-compatible"])

    def check_key(credentials: HTTPAuthorizationCredentials | None) -> None:
        if service.api_key is None:
            return
        if credentials is None:
            raise p.APIError(401, "missing API key: send it as 'Authorization: Bearer KEY'", None, "invalid_api_key")
        if not secrets.compare_digest(credentials.credentials.encode(), service.api_key.encode()):
            raise p.APIError(401, "incorrect API key", None, "invalid_api_key")

    @router.get("/models")
    @_openai_errors
    async def list_models(credentials: Credentials):
        check_key(credentials)
        return JSONResponse({"object": "list", "data": service.models()})

    @router.post("/chat/completions")
    @_openai_errors
    async def chat_completions(request: Request, credentials: Credentials):
        check_key(credentials)
        return await complete(service, request, chat_api=True)

    @router.post("/completions")
    @_openai_errors
    async def completions(request: Request, credentials: Credentials):
        check_key(credentials)
        return await complete(service, request, chat_api=False)

    # last: whatever else is asked under /v1 gets OpenAI's error shape, not the web framework's {"detail": ...}
    @router.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"], include_in_schema=False)
    async def unknown(path: str, request: Request):
        e = unknown_route(request.method, request.url.path)
        return JSONResponse(e.body(), status_code=e.status)

    return router


ROUTES = {"/v1/models": "GET", "/v1/chat/completions": "POST", "/v1/completions": "POST"}
"""The OpenAI-compatible routes and the method each takes."""


def unknown_route(method: str, path: str) -> p.APIError:
    """The error for a request no route answers: 405 for a known route with another method, else 404."""
    allowed = ROUTES.get(path.rstrip("/"))
    if allowed is not None and allowed != method:
        return p.APIError(405, f"{method} {path} is not allowed; use {allowed} {path}", None, "method_not_allowed")
    routes = ", ".join(f"{m} {r}" for r, m in ROUTES.items())
    return p.APIError(404, f"there is no route {method} {path} here; this server answers {routes}", None, "not_found")


async def complete(service: Service, request: Request, chat_api: bool):
    body = await request.body()  # at most protocol.MAX_BODY_BYTES: limits.BodyLimit refuses more unread
    # Reading it and checking it is the request's own work: on a worker thread, the event loop stays free for others
    req, settings, inputs = await run_in_threadpool(read_request, body, chat_api)
    name = service.resolve(req.model)
    job = Job(service, name, inputs, settings)
    try:
        job.start()
    except QueueFull as e:
        raise engine_error(e) from None
    spec = req.speculative or p.Speculative()
    shape = p.Shape(chat=chat_api, model=name)
    try:
        first = await job.next(request)  # errors (the prompt, the pair) still get their status before any stream
    except ClientGone:
        raise
    except Exception as e:
        job.stop()
        raise engine_error(e) from None
    except BaseException:  # the request itself was cancelled
        job.stop()
        raise
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return EventSourceResponse(
            stream(job, first, shape, settings.stop_strings, spec.pieces, include_usage),
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    try:
        event, counts = first, p.Counts()
        while not isinstance(event, Finished):
            counts.add(event)
            event = await job.next(request)
    except ClientGone:
        raise
    except Exception as e:
        raise engine_error(e) from None
    finally:
        job.stop()
    text = await run_in_threadpool(p.trimmed, event.text, settings.stop_strings)
    assert job.prompt_tokens is not None  # the job counts the prompt before it generates anything
    return JSONResponse(shape.response(text, event, job.prompt_tokens, p.speculative_stats(event.stats, counts)))


def read_request(body: bytes, chat_api: bool) -> tuple[p.ChatRequest | p.CompletionRequest, GenerationSettings, dict]:
    """The request body read and checked: the request, its settings, and api.stream's keyword arguments (the chat's
    messages or the completion's prompt). Every problem is a 400 that says what to change."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise p.bad_request("the request body is not valid JSON") from None
    except RecursionError:
        raise p.bad_request("the request body nests arrays or objects too deeply to read") from None
    try:
        req = p.parse(p.ChatRequest, data) if chat_api else p.parse(p.CompletionRequest, data)
        settings = p.settings_of(req)
        inputs: dict[str, Any] = (
            {"messages": p.chat_messages(req)}
            if isinstance(req, p.ChatRequest)
            else {"prompt": p.completion_prompt(req)}
        )
    except RecursionError:  # a deeply nested value where the request has room for any JSON (metadata, content)
        raise p.bad_request("the request nests arrays or objects too deeply") from None
    return req, settings, inputs


def _sse(data) -> bytes:
    return format_sse_event(data_str=json.dumps(data, ensure_ascii=False))


async def stream(
    job: Job, first, shape: p.Shape, stops: tuple[str, ...], pieces: bool, include_usage: bool
) -> AsyncIterator[bytes]:
    """The SSE body: a chunk per round (with its pieces and the stats so far when asked), the final chunk with the
    finish reason and the speculative stats, the usage chunk when asked, then [DONE]. A client that disconnects
    cancels the body, and with it the generation."""
    trim, counts, sent = p.StopTrim(stops), p.Counts(), ""
    try:
        if shape.chat:
            yield _sse(shape.chunk(role=True))
        event = first
        while not isinstance(event, Finished):
            assert isinstance(event, Round)
            counts.add(event)
            text = "".join(piece.text for piece in event.emitted)
            if stops:  # off the event loop, as every per-request check
                text = await run_in_threadpool(trim.feed, text)
            sent += text
            if pieces:
                extra = {
                    "pieces": [x.as_dict() for x in event.pieces],
                    "round": event.index,
                    "k": event.k,
                    "expected_speedup": event.expected_speedup,
                    "algorithm": event.algorithm,
                    "declined": event.declined,
                }
                spec = {**(p.speculative_stats(event.stats, counts) if event.stats else {}), **extra}
                yield _sse(shape.chunk(text, spec=spec))
            elif text:
                yield _sse(shape.chunk(text))
            event = await job.next()
        final = await run_in_threadpool(p.trimmed, event.text, stops)  # whatever the rounds held back comes now
        if final.startswith(sent) and len(final) > len(sent):
            yield _sse(shape.chunk(final[len(sent) :]))
        reason = p.finish_reason(event.stats.stop_reason)
        yield _sse(shape.chunk(None if shape.chat else "", reason, spec=p.speculative_stats(event.stats, counts)))
        if include_usage:
            yield _sse(shape.usage_chunk(job.prompt_tokens or 0, len(event.target_ids)))
    except Exception as e:  # an engine failure mid-stream: OpenAI's error object as the last event
        log.exception("stream failed")
        yield _sse(engine_error(e).body())
    finally:
        job.stop()
    yield format_sse_event(data_str="[DONE]")


def create_app(service: Service) -> FastAPI:
    """A FastAPI app with just the /v1 routes (what `usd serve` runs), bodies limited (`limits.BodyLimit`), every
    error in OpenAI's shape. With an API key it has no /docs, /redoc or /openapi.json: a server that wants a key does
    not describe itself to visitors without one."""
    docs = service.api_key is None
    app = FastAPI(
        title="usd serve",
        description="OpenAI-compatible server for universal speculative decoding",
        version="0.1.0",
        docs_url="/docs" if docs else None,
        redoc_url="/redoc" if docs else None,
        openapi_url="/openapi.json" if docs else None,
    )
    app.include_router(create_router(service))
    app.add_middleware(BodyLimit)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        e = (
            unknown_route(request.method, request.url.path)
            if exc.status_code in (404, 405)
            else p.APIError(exc.status_code, str(exc.detail))
        )
        return JSONResponse(e.body(), status_code=e.status)

    return app
