"""HTTP and SSE helpers shared by the client plugins: event streams, request bodies, disconnects."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from typing import Any, TypeVar

import orjson
from pydantic import BaseModel, ValidationError
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import plugin_api
from config import field_problems

logger = logging.getLogger("agent_mcp.http")

# ── Event streams ───────────────────────────────────────────────────────────────────────────

SSE_PING_SECONDS = 15


def last_event_id(request: Request) -> int | None:
    """The `Last-Event-ID` header (or `last_event_id` query parameter) as an int, if valid."""
    raw = request.headers.get("last-event-id") or request.query_params.get("last_event_id")
    try:
        return int(raw) if raw else None
    except ValueError:
        return None


def _json(data: Any) -> str:
    """An event's data as JSON text (UTF-8 as it is): orjson, a few times cheaper for every event of every
    stream; `json` for what orjson cannot write (an integer beyond 64 bits)."""
    try:
        return orjson.dumps(data).decode()
    except TypeError:
        return json.dumps(data, ensure_ascii=False)


def event_stream(ctx: plugin_api.PluginContext, client_id: str, after: int | None,
                 turn: str | None = None) -> EventSourceResponse:
    """An SSE response with every event of a session: `id:` lines, JSON data, keepalive comments.

    With `turn`, only that request's events are sent and the response ends after its last one.
    """

    async def events() -> AsyncIterator[ServerSentEvent]:
        try:
            async with contextlib.aclosing(ctx.hub.subscribe(client_id, after)) as subscription:
                async for ev in subscription:
                    if turn is not None and ev.turn != turn:
                        continue
                    yield ServerSentEvent(data=_json(ev.data), event=ev.name, id=str(ev.id))
                    if turn is not None and plugin_api.ends_turn(ev):
                        return
        except plugin_api.SessionError as exc:  # the shared store went away: an error event and one log line
            logger.warning("event stream of %s ended early: %s", client_id, exc)
            yield ServerSentEvent(data=json.dumps({"message": f"the event stream was cut short: {exc}"},
                                                  ensure_ascii=False), event="error")

    return _Stream(
        ctx,
        events(),
        ping=SSE_PING_SECONDS,
        sep="\n",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        shutdown_event=ctx.stopping(),
    )


def feed_stream(ctx: plugin_api.PluginContext,
                feed: AsyncGenerator[tuple[str, dict[str, Any]], None]) -> EventSourceResponse:
    """An SSE response of (event name, JSON data) pairs, such as the approver feed (approvals.py), with
    keepalive comments; it ends when the server stops."""

    async def events() -> AsyncIterator[ServerSentEvent]:
        try:
            async with contextlib.aclosing(feed) as items:
                async for name, data in items:
                    yield ServerSentEvent(data=_json(data), event=name)
        except plugin_api.SessionError as exc:
            logger.warning("feed stream ended early: %s", exc)
            yield ServerSentEvent(data=json.dumps({"message": f"the stream was cut short: {exc}"}), event="error")

    return _Stream(ctx, events(), ping=SSE_PING_SECONDS, sep="\n",
                   headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}, shutdown_event=ctx.stopping())


class _Stream(EventSourceResponse):
    """An SSE response the runtime counts until it is complete: a stopping server ends the streams (hub.close)
    and waits for them before it lets sse-starlette's shutdown watcher cut what is left (a cut response is
    logged by uvicorn as an ERROR)."""

    def __init__(self, ctx: plugin_api.PluginContext, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._ctx = ctx

    async def _send_with_timeout(self, send: Send, message: Message) -> None:
        """Without a send timeout (ours have none), the send itself: sse_starlette's cancel scope around every
        event timed nothing (issue 31: a 32-token shell turn 3.63 → 3.40 and 3.30 → 3.20 ms, two runs)."""
        if self.send_timeout is None:
            await send(message)
        else:
            await super()._send_with_timeout(send, message)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._ctx.stream_opened()
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._ctx.stream_closed()


# ── Request bodies and disconnects ──────────────────────────────────────────────────────────

#: Client ids a client plugin accepts from callers (ids also appear in logs and file names).
CLIENT_ID_PATTERN = r"^[A-Za-z0-9._:@-]{1,128}$"
#: The longest message text a client plugin accepts, in characters.
MAX_TEXT = 200_000
#: The largest JSON request body read, in bytes (a MAX_TEXT message with every character escaped fits).
MAX_BODY = 8 * MAX_TEXT
#: The deepest nesting of arrays and objects a JSON request body may have (chat bodies need about 5).
#: Deeper values would later break json.dumps, repr and copies of the history with a RecursionError.
MAX_JSON_DEPTH = 64

#: What a lone surrogate can look like in a JSON body: an escape of one, or its (invalid) UTF-8 bytes,
#: which json.loads lets through. A body without either cannot hold one (a cheap test before the walk).
_MAYBE_SURROGATE = re.compile(rb"\\u[dD][89abcdefABCDEF]|\xed[\xa0-\xbf]")
M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")


class BadRequest(Exception):
    """A request a client plugin refuses; `status` is the HTTP status, the message says what to fix."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


_TOO_DEEP = (f"request body is nested too deeply: at most {MAX_JSON_DEPTH} levels of arrays and objects "
             "are accepted")


def _nested_deeper(value: Any, limit: int) -> bool:
    """Whether parsed JSON nests arrays/objects more than `limit` levels deep (iterative: no recursion)."""
    stack: list[tuple[Any, int]] = [(value, 1)] if isinstance(value, dict | list) else []
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node
        if depth > limit:
            return True
        stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list))
    return False


async def read_json(request: Request, model: type[M], max_bytes: int = MAX_BODY) -> M:
    """The request body as `model`; BadRequest (400, or 413 when over `max_bytes`) says what is wrong."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise BadRequest(413, f"request body is {declared} bytes; the limit is {max_bytes}")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise BadRequest(413, f"request body is over {max_bytes} bytes; the limit is {max_bytes}")
            chunks.append(chunk)
    except ClientDisconnect:  # one line, never a traceback: nobody is left to answer
        client = request.client.host if request.client else "?"
        logger.info("%s %s from %s: the client went away before its body was complete (%d of %s bytes)",
                    request.method, request.url.path, client, size, declared or "?")
        raise BadRequest(400, "the request body ended before it was complete; send the whole body") from None
    body = b"".join(chunks)
    try:
        raw = json.loads(body)
    except RecursionError:  # json.loads gives up (fast) at the interpreter's recursion limit
        raise BadRequest(400, _TOO_DEEP) from None
    except ValueError:
        raise BadRequest(400, "request body must be JSON") from None
    # Fewer brackets than the limit cannot nest deeper than it: most bodies skip the walk.
    if body.count(b"[") + body.count(b"{") > MAX_JSON_DEPTH and _nested_deeper(raw, MAX_JSON_DEPTH):
        raise BadRequest(400, _TOO_DEEP)
    if _MAYBE_SURROGATE.search(body):
        try:  # a surrogate pair is one character and encodes; a lone surrogate does not
            json.dumps(raw, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise BadRequest(400, "request body has invalid Unicode: a lone surrogate (\\ud800-\\udfff) in a "
                                  "string; send text as valid UTF-8") from None
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        problems = field_problems(exc, "body")
        raise BadRequest(400, f"invalid request: {problems}") from None


class WholeBody:
    """`app` (one whose own body reading we do not control, such as the MCP SDK's) behind a reader
    that takes the whole request body first: a body cut short is one log line and a 400, one over
    `max_bytes` a 413, never the app's 500 and traceback; the app then reads the body from memory.
    Its `routes` are the app's, so a Mount of it lists them like a Mount of the app."""

    def __init__(self, app: ASGIApp, max_bytes: int = MAX_BODY):
        self.app, self.max_bytes = app, max_bytes

    @property
    def routes(self) -> list[Any]:
        return list(getattr(self.app, "routes", []))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                client = (scope.get("client") or ("?",))[0]
                logger.info("%s %s from %s: the client went away before its body was complete (%d bytes)",
                            scope.get("method"), scope.get("path"), client, size)
                await JSONResponse({"error": "the request body ended before it was complete; send the whole "
                                             "body"}, status_code=400)(scope, receive, send)
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await JSONResponse({"error": f"request body is over {self.max_bytes} bytes; the limit is "
                                             f"{self.max_bytes}"}, status_code=413)(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        whole: list[Message] = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replay() -> Message:
            return whole.pop() if whole else await receive()

        await self.app(scope, replay, send)


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """`work`'s result, or None when the HTTP client disconnects first (then `work` is cancelled)."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    gone = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                await task
    return task.result() if not task.cancelled() else None
