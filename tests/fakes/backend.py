"""Shared machinery for the fake LLM backends: scripted replies, request recording, a threaded server.

A fake is a real HTTP server on 127.0.0.1 (uvicorn + Starlette in a background thread with its own event
loop), so unmodified client libraries reach it through a base URL. Tests script the next replies with
`backend.script(...)` and inspect `backend.requests` afterwards; with an empty script the fake echoes the last
user message, which keeps manual demos and benchmarks working without any script.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import threading
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Self

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import BaseRoute

from tests.fakes.cli import StopSignals
from tests.fakes.server import ThreadedServer

# ---------------------------------------------------------------------------------------------------------
# Scripted replies
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolCall:
    """One function call the fake model makes; `id` None lets each protocol pick its own default."""

    name: str
    args: dict[str, Any]
    id: str | None = None
    #: The arguments exactly as sent, instead of `args` as JSON (OpenAI only): broken JSON, for instance.
    raw_args: str | None = None


@dataclass(frozen=True)
class TextReply:
    """A text answer: streamed as `chunks`, non-streamed as their concatenation."""

    chunks: tuple[str, ...]
    delay: float = 0.0
    hold: threading.Event | None = field(default=None, compare=False)

    @property
    def content(self) -> str:
        """The whole answer text."""
        return "".join(self.chunks)


@dataclass(frozen=True)
class ToolCallsReply:
    """One or more (parallel) function calls, optionally preceded by some text."""

    calls: tuple[ToolCall, ...]
    text_before: str | None = None
    #: Answer only once the test sets this event (the turn waits on its model meanwhile).
    hold: threading.Event | None = field(default=None, compare=False)


@dataclass(frozen=True)
class ErrorReply:
    """An HTTP error with the provider's JSON error body, sent instead of any output."""

    status: int
    message: str


@dataclass(frozen=True)
class HangReply:
    """Accept the request, send nothing for `seconds` (or until the backend stops), then send the default reply."""

    seconds: float


@dataclass(frozen=True)
class MalformedReply:
    """A stream that sends one valid text chunk, then a line of invalid JSON, then ends."""


@dataclass(frozen=True)
class CutReply:
    """A stream that sends the pieces of `reply` and ends without its end: no finish reason, no usage, no
    `[DONE]`. `abrupt`: the connection is dropped before the body's end (no closing HTTP chunk), as a backend
    that died; else the body ends cleanly, as a proxy that gave up. Non-streamed: the JSON body cut in half."""

    reply: TextReply | ToolCallsReply
    abrupt: bool = False
    #: The piece with the finish reason is sent before the cut (only what follows it is lost: usage, `[DONE]`).
    finished: bool = False
    #: Cut only once the test sets this event (it saw the pieces arrive: a dropped connection loses what it
    #: had not read yet).
    hold: threading.Event | None = field(default=None, compare=False)


@dataclass(frozen=True)
class RepeatReply:
    """A small local model's habit: while tools are offered, make the conversation's last tool call again
    (native, or the same text); once a request offers none, answer from the last tool result."""


Reply = TextReply | ToolCallsReply | ErrorReply | HangReply | MalformedReply | CutReply | RepeatReply
"""Any scripted reply; build one with the constructors below."""


def text(*chunks: str, delay: float = 0.0, hold: threading.Event | None = None) -> TextReply:
    """A text reply streamed as `chunks` (sleeping `delay` s between them); with `hold`, the stream sends the
    first chunk and then waits until the test sets the event before sending the rest."""
    if not chunks:
        raise ValueError("text() needs at least one chunk")
    if hold is not None and len(chunks) < 2:
        raise ValueError("text(hold=...) needs at least two chunks: the hold comes after the first")
    return TextReply(tuple(chunks), delay, hold)


def tokens(count: int, token: str = "tok ") -> TextReply:
    """A text reply of `count` identical chunks with no delay (benchmark load)."""
    return TextReply((token,) * count)


def tool_call(
    name: str, args: dict[str, Any], call_id: str | None = None, text_before: str | None = None,
    hold: threading.Event | None = None,
) -> ToolCallsReply:
    """A reply making a single function call `name(**args)`; with `hold`, sent once the test sets the event."""
    return ToolCallsReply((ToolCall(name, args, call_id),), text_before, hold)


def tool_calls(
    calls: Iterable[ToolCall | tuple[str, dict[str, Any]]], text_before: str | None = None
) -> ToolCallsReply:
    """A reply making parallel function calls, given as `ToolCall`s or `(name, args)` pairs."""
    built = tuple(c if isinstance(c, ToolCall) else ToolCall(*c) for c in calls)
    if not built:
        raise ValueError("tool_calls() needs at least one call")
    return ToolCallsReply(built, text_before)


def error(status: int, message: str) -> ErrorReply:
    """An HTTP `status` error response carrying `message` in the provider's error shape."""
    return ErrorReply(status, message)


def hang(seconds: float) -> HangReply:
    """A reply that sends nothing for `seconds` (to trigger client timeouts)."""
    return HangReply(seconds)


def malformed() -> MalformedReply:
    """A stream that breaks after one valid chunk (non-streamed: a 200 with an invalid JSON body)."""
    return MalformedReply()


def cut(*chunks: str, abrupt: bool = False, reply: TextReply | ToolCallsReply | None = None,
        finished: bool = False, hold: threading.Event | None = None) -> CutReply:
    """A stream of `chunks` (or of `reply`'s pieces) that ends without its finish reason (see CutReply); with
    `finished`, cut right after the finish reason instead; with `hold`, cut once the test sets it."""
    if (reply is None) == (not chunks):
        raise ValueError("cut() needs either text chunks or reply=")
    return CutReply(reply or text(*chunks), abrupt, finished, hold)


def repeat() -> RepeatReply:
    """See RepeatReply: the same call again after its result, an answer only when no tools are offered."""
    return RepeatReply()


def fenced_call(name: str, args: dict[str, Any], lang: str = "json", before: str = "", after: str = "") -> TextReply:
    """A call written as text in a fenced block (```json by default), the way small models write them,
    with optional prose around it; streamed in pieces that split the fence."""
    call = json.dumps({"name": name, "arguments": args})
    return text(*(p for p in (before, "``", f"`{lang}\n{call[:10]}", f"{call[10:]}\n```", after) if p))


def broken_call(name: str, raw_args: str = '{"city": "Par') -> ToolCallsReply:
    """A native function call whose arguments are not valid JSON (OpenAI only)."""
    return ToolCallsReply((ToolCall(name, {}, raw_args=raw_args),))


def words(sentence: str) -> list[str]:
    """Split `sentence` into word chunks that keep their trailing whitespace ("a b" -> ["a ", "b"])."""
    return re.findall(r"\S+\s*|\s+", sentence) or [""]


def new_id(prefix: str) -> str:
    """A short random identifier such as `call_1f2e3d4c5b6a`."""
    return f"{prefix}{uuid.uuid4().hex[:12]}"


# ---------------------------------------------------------------------------------------------------------
# Recording
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RecordedRequest:
    """One request the fake received; `json` is None when the body was not valid JSON."""

    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    json: Any
    last_user_text: str


ReplyFactory = Callable[[RecordedRequest], Reply]
"""Builds the reply for a request when the script is empty."""


def echo_reply(request: RecordedRequest) -> Reply:
    """The default reply: "echo: <last user message>" streamed word by word."""
    return text(*words("echo: " + request.last_user_text))


DEMO_HELP = """\
Messages starting with one of these words are scripts; anything else is echoed back:
  CALL <tool> <json arguments>   call that tool (then say what it returned)  CALL get_system_info {}
  SLOW <text>                    stream <text> one word every 0.3 s            SLOW one two three four
  FAIL <status> <message>        answer with that HTTP error                   FAIL 503 overloaded
  HANG <seconds>                 send nothing for that long (try a timeout)    HANG 200
  REPEAT <tool> <json arguments> call it, then again after every result while tools are offered
  FENCE <tool> <json arguments>  write the call as text in a ```json block     FENCE get_system_info {}
  BROKEN <tool>                  call it with arguments that are not JSON      BROKEN get_system_info"""


def _tool_result(body: Any) -> str | None:
    """The tool result a request ends with (OpenAI `role: tool`, Gemini `functionResponse`), if any."""
    if not isinstance(body, dict):
        return None
    messages = body.get("messages") or []
    if messages and messages[-1].get("role") == "tool":
        return str(messages[-1].get("content", ""))
    parts = (body.get("contents") or [{}])[-1].get("parts") or []
    found = [p["functionResponse"].get("response") for p in parts if isinstance(p, dict) and "functionResponse" in p]
    return json.dumps(found[0]) if found else None


def _offers_tools(body: Any) -> bool:
    """Whether a request offers tools: through the API, or described in its system prompt for text calls."""
    if not isinstance(body, dict):
        return False
    if body.get("tools"):
        return True
    system = next((m.get("content") for m in body.get("messages") or [] if m.get("role") == "system"), "")
    return isinstance(system, str) and "<tool_code>" in system


def _first_result_in(body: Any) -> str | None:
    """The first tool result after the turn's question in an OpenAI request: a `tool` message or a
    `[Tool result for …]` text (the result a model got first, not what was said about repeats later)."""
    messages = body.get("messages") or [] if isinstance(body, dict) else []
    start = max((i for i, m in enumerate(messages) if m.get("role") == "user"
                 and not str(m.get("content")).startswith("[Tool result for ")), default=0)
    for message in messages[start:]:
        content = message.get("content")
        if message.get("role") == "tool":
            return str(content or "")
        if isinstance(content, str) and "[Tool result for " in content:
            return content.split("[Tool result for ", 1)[1].partition("]:\n")[2].split("\n\n")[0]
        if isinstance(content, str) and "What the tools returned:\n[" in content:  # agent-mcp's final request
            return content.split("What the tools returned:\n[", 1)[1].partition("]:\n")[2].split("\n\n")[0]
    return None


def repeat_reply(request: RecordedRequest) -> Reply | None:
    """RepeatReply resolved for `request`; None when the conversation holds no call to repeat."""
    body = request.json if isinstance(request.json, dict) else {}
    if not _offers_tools(body):
        result = _first_result_in(body)
        return None if result is None else text(*words(f"The tool returned: {result[:300]}"))
    for message in reversed(body.get("messages") or []):
        if message.get("role") == "user" and "[Tool result for " not in str(message.get("content")):
            return None  # the turn's question: no call of this turn before it
        if message.get("role") != "assistant":
            continue
        if message.get("tool_calls"):
            return ToolCallsReply(tuple(ToolCall(c["function"]["name"], json.loads(c["function"]["arguments"] or "{}"))
                                        for c in message["tool_calls"]))
        if message.get("content"):
            return text(message["content"])
    return None


def demo_reply(request: RecordedRequest) -> Reply:
    """Replies a person can script from a chat window (DEMO_HELP), for trying gates, tools and streaming."""
    verb, _, rest = request.last_user_text.strip().partition(" ")
    if verb == "REPEAT" and (again := repeat_reply(request)) is not None:
        return again
    result = _tool_result(request.json)
    if result is not None:
        return text(*words(f"The tool returned: {result[:300]}"))
    try:
        if verb in ("CALL", "REPEAT", "FENCE"):
            name, _, raw = rest.strip().partition(" ")
            args = json.loads(raw or "{}")
            return fenced_call(name, args) if verb == "FENCE" else tool_call(name, args)
        if verb == "BROKEN":
            return broken_call(rest.strip())
        if verb == "SLOW":
            return text(*words(rest or "slowly, one word at a time"), delay=0.3)
        if verb == "FAIL":
            status, _, message = rest.strip().partition(" ")
            return error(int(status), message or "failing on purpose")
        if verb == "HANG":
            return hang(float(rest))
    except ValueError as exc:
        return text(*words(f"cannot read that script line ({exc}).\n{DEMO_HELP}"))
    return echo_reply(request)


# ---------------------------------------------------------------------------------------------------------
# Server
# ---------------------------------------------------------------------------------------------------------


class FakeBackend(ThreadedServer):
    """Base of the fake LLM servers: a FIFO reply script, recorded requests and a background uvicorn thread.

    Subclasses provide `routes()`, `extract_last_user_text()`, `wants_stream()`, `render_json()`,
    `render_stream()` and `error_body()`; their chat routes point at `handle()`.
    """

    def __init__(self, port: int = 0, default_reply: ReplyFactory = echo_reply) -> None:
        super().__init__(port)
        self.default_reply = default_reply
        self._lock = threading.Lock()
        self._script: deque[Reply] = deque()
        self._requests: list[RecordedRequest] = []

    # -- test-facing API ----------------------------------------------------------------------------------

    def script(self, *replies: Reply) -> Self:
        """Queue `replies`; each request consumes the oldest one (FIFO)."""
        with self._lock:
            self._script.extend(replies)
        return self

    @property
    def pending(self) -> int:
        """How many scripted replies have not been consumed yet."""
        with self._lock:
            return len(self._script)

    @property
    def requests(self) -> list[RecordedRequest]:
        """A snapshot of the requests received so far, oldest first."""
        with self._lock:
            return list(self._requests)

    def reset(self) -> None:
        """Forget the remaining script and the recorded requests."""
        with self._lock:
            self._script.clear()
            self._requests.clear()

    @property
    def base_url(self) -> str:
        """The base URL to give the provider's client library."""
        return self.url

    # -- protocol hooks (subclasses) ----------------------------------------------------------------------

    def app(self) -> Starlette:
        """The protocol's routes as one Starlette app."""
        return Starlette(routes=self.routes())

    def routes(self) -> Sequence[BaseRoute]:
        """The Starlette routes of this protocol."""
        raise NotImplementedError

    def extract_last_user_text(self, body: Any) -> str:
        """The text of the last user message in a request body ("" if none)."""
        raise NotImplementedError

    def wants_stream(self, request: RecordedRequest) -> bool:
        """Whether `request` asks for a streamed (SSE) answer."""
        raise NotImplementedError

    def error_body(self, reply: ErrorReply) -> dict[str, Any]:
        """The provider's JSON error body for `reply`."""
        raise NotImplementedError

    def finishes(self, payload: str) -> bool:
        """Whether the streamed `payload` carries the model's finish reason."""
        raise NotImplementedError

    def render_json(self, reply: TextReply | ToolCallsReply, request: RecordedRequest) -> dict[str, Any]:
        """The non-streamed response body for `reply`."""
        raise NotImplementedError

    def render_stream(
        self, reply: TextReply | ToolCallsReply, request: RecordedRequest, end: bool = True
    ) -> AsyncIterator[str]:
        """The SSE `data:` payloads (already serialised) for a streamed `reply`; without its end (finish
        reason, usage, `[DONE]`) when `end` is false."""
        raise NotImplementedError

    # -- shared request handling --------------------------------------------------------------------------

    async def handle(self, request: Request) -> Response:
        """Record `request`, take the next reply and answer it as JSON or as an SSE stream."""
        recorded = await self._record(request)
        with self._lock:
            reply = self._script.popleft() if self._script else None
        if isinstance(reply, RepeatReply):
            reply = repeat_reply(recorded)
        if reply is None:
            reply = self.default_reply(recorded)
        if isinstance(reply, HangReply):
            await self._wait_stop(reply.seconds)
            silent, reply = reply.seconds, self.default_reply(recorded)
            if isinstance(reply, HangReply):  # a person's `HANG n` line again: say what happened, never hang twice
                reply = text(*words(f"(sent nothing for {silent:g} s, less than the model's llm_call_timeout, so "
                                    "the turn went on: HANG more seconds than that timeout to see it end the turn)"))
        if isinstance(reply, ToolCallsReply) and reply.hold is not None:
            await self._wait_hold(reply.hold)
        if isinstance(reply, ErrorReply):
            return JSONResponse(self.error_body(reply), status_code=reply.status)
        if isinstance(reply, CutReply) and reply.abrupt:
            return _Dropped(self._sse(reply, recorded) if self.wants_stream(recorded) else
                            _half(json.dumps(self.render_json(reply.reply, recorded))),
                            "text/event-stream" if self.wants_stream(recorded) else "application/json")
        if self.wants_stream(recorded):
            return StreamingResponse(self._sse(reply, recorded), media_type="text/event-stream")
        if isinstance(reply, MalformedReply):
            return Response('{"this is": not json', media_type="application/json")
        if isinstance(reply, CutReply):
            return Response(await anext(_half(json.dumps(self.render_json(reply.reply, recorded)))),
                            media_type="application/json")
        return JSONResponse(self.render_json(reply, recorded))

    async def pace(self, reply: TextReply, index: int) -> None:
        """Wait before sending chunk `index` of `reply`: the `hold` after the first chunk, then `delay`."""
        if index == 1 and reply.hold is not None:
            await self._wait_hold(reply.hold)
        if index > 0 and reply.delay:
            await self._wait_stop(reply.delay)

    async def _sse(self, reply: Reply, recorded: RecordedRequest) -> AsyncIterator[str]:
        if isinstance(reply, MalformedReply):
            events = self.render_stream(text("partial ", "answer"), recorded)
            yield f"data: {await anext(events)}\n\n"
            await events.aclose()
            yield "data: {this is not json\n\n"
            return
        if isinstance(reply, CutReply):
            async for payload in self.render_stream(reply.reply, recorded, end=reply.finished):
                yield f"data: {payload}\n\n"
                if reply.finished and self.finishes(payload):
                    break
            if reply.hold is not None:
                await self._wait_hold(reply.hold)
            return
        assert isinstance(reply, TextReply | ToolCallsReply)
        async for payload in self.render_stream(reply, recorded):
            yield f"data: {payload}\n\n"

    async def _record(self, request: Request) -> RecordedRequest:
        raw = await request.body()
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = None
        recorded = RecordedRequest(
            method=request.method,
            path=request.url.path,
            query=dict(request.query_params),
            headers=dict(request.headers),
            json=body,
            last_user_text=self.extract_last_user_text(body) if isinstance(body, dict) else "",
        )
        with self._lock:
            self._requests.append(recorded)
        return recorded

    async def _wait_stop(self, seconds: float) -> None:
        """Sleep `seconds`, returning early if the backend is stopping."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping().wait(), seconds)

    async def _wait_hold(self, hold: threading.Event) -> None:
        """Wait for a thread-side event in a worker thread (the loop stays free); give up on stop.

        The short timeout only bounds how long a cancelled or stopping wait keeps its worker thread.
        """
        stopping = self._stopping()
        while not stopping.is_set():
            if await asyncio.to_thread(hold.wait, 0.1):
                return


async def _half(body: str) -> AsyncIterator[str]:
    """The first half of `body`: a JSON answer cut short."""
    yield body[: len(body) // 2]


class _Dropped(Response):
    """A 200 answer whose body is `parts`, after which the connection is closed without the body's end (uvicorn
    closes a connection whose app returned before its response was complete, and logs one line for it)."""

    def __init__(self, parts: AsyncIterator[str], media_type: str) -> None:  # no body: no content-length either
        self.status_code, self.background, self.parts = 200, None, parts
        self.raw_headers = [(b"content-type", media_type.encode())]

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        async for part in self.parts:
            await send({"type": "http.response.body", "body": part.encode(), "more_body": True})


def run_cli(backend_class: type[FakeBackend], argv: Sequence[str] | None = None) -> None:
    """Run `backend_class` in the foreground until Ctrl-C, answering by `demo_reply` (for trying things by hand)."""
    parser = argparse.ArgumentParser(description=f"Run {backend_class.__name__} on 127.0.0.1 for trying the agent "
                                                 "without a model.", epilog=DEMO_HELP,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, default=0, help="TCP port (default: any free port)")
    parser.add_argument("--echo", action="store_true", help="only echo, no scripts")
    args = parser.parse_args(argv)
    with StopSignals() as stop, \
            backend_class(port=args.port, default_reply=echo_reply if args.echo else demo_reply) as backend:
        print(f"{backend_class.__name__} listening; base URL: {backend.base_url}  (Ctrl-C to stop)\n"
              + ("" if args.echo else DEMO_HELP), flush=True)
        stop.wait()  # leaving the block stops the server: held and streaming replies end (FakeBackend.stop)
