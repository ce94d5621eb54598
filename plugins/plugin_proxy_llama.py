"""Ollama- and OpenAI-compatible proxy: chat apps and SDKs talk to the agent as to a model server.

Ollama API on `/api/*` (and `/v1/api/*`, where Enchanted sends it when its URL ends in `/v1`):
NDJSON streams, JSON otherwise. OpenAI API on `/v1/*`, `/models` and `/chat/completions`: SSE
`chat.completion.chunk` streams, JSON otherwise. The path decides the format; the User-Agent only
decides the error format of paths that belong to neither. Each chat request is one turn of the
session of its conversation (`plugins._conversations`: the resent transcript says which; one per
chat or user when open-webui forwards its headers; `sessions_by: "address"` keeps the reference
behaviour, one session `llama-<client ip>`); its prompt is the last user message, because the
server keeps the history itself. Tokens are written the moment the model produces them. Binds 127.0.0.1:11435 by default; with `AGENT_PROXY_TOKEN`
set, every request needs `Authorization: Bearer <token>`.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

import gate
import guard
import routes
import state
from plugin_loader import BasePlugin, parse_settings
from plugins import _http
from plugins._conversations import ConversationIndex, Turn, content_text, fingerprint, seed

#: Client ids of this plugin's sessions start with this (its client-id namespace).
PREFIX = "llama-"
logger = logging.getLogger("agent_mcp.proxy")

#: The Ollama API version we answer like (open-webui parses it as dotted numbers).
OLLAMA_API_VERSION = "0.12.3"
DEFAULT_PORT = 11435  # 11434 is Ollama's own port, where the shipped `local` model lives
MAX_PROMPT = 200_000
#: Chat apps send the whole conversation, images included, on every request.
MAX_BODY = 64 * 1024 * 1024
TASK_PREFIX = "### Task:"  # how every open-webui background-task prompt template starts
SSE_PING_SECONDS = 15
_SAFE_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
#: open-webui's forwarded headers (ENABLE_FORWARD_USER_INFO_HEADERS): one session per chat, else per user.
_SESSION_HEADERS = (("x-openwebui-chat-id", "chat"), ("x-openwebui-user-id", "user"))
_UNSUPPORTED_OLLAMA = {"embed": "POST", "embeddings": "POST", "pull": "POST", "push": "POST",
                       "create": "POST", "copy": "POST", "delete": "DELETE"}
_OPENAI_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
                       405: "invalid_request_error", 413: "invalid_request_error"}
#: Every error answer says so: SDKs (openai's retries 408/409/429/5xx twice by default) must never
#: send a chat request again, because the turn's tools may already have run.
_NO_RETRY = {"x-should-retry": "false"}
#: The OpenAI error `code` of each status a failed turn gets.
_ERROR_CODES = {502: "backend_error", 503: "cancelled", 504: "backend_timeout"}

T = TypeVar("T", bound=BaseModel)


class ProxyConfig(guard.ListenerSettings):
    """`plugin_config.plugin_proxy_llama` in plugins-enabled.json."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    host: str = "127.0.0.1"
    port: int = Field(default=DEFAULT_PORT, ge=1, le=65535)
    token_env: str = "AGENT_PROXY_TOKEN"
    #: The agent's name in model lists (tagged `:latest` when it has no tag).
    model_name: str = Field(default="agent-mcp", pattern=r"^[A-Za-z0-9._/-]+(:[A-Za-z0-9._-]+)?$")
    #: How tool status lines reach chat apps: a Markdown quote in the answer, reasoning text, or not at all.
    status_lines: Literal["quote", "thinking", "off"] = "quote"
    #: One session per open-webui chat (or user) when its forwarded headers are present.
    session_per_chat: bool = True
    #: Without those headers: a session per conversation (told by the transcript the client resends),
    #: or one per client address (the reference behaviour: one memory across all chats of a host).
    sessions_by: Literal["conversation", "address"] = "conversation"
    #: open-webui's background tasks (titles, tags, follow-ups: prompts starting with `### Task:`)
    #: run in a throwaway session, so they never enter the chat's history.
    task_sessions: bool = True


class ProxyError(Exception):
    """A request the proxy refuses; rendered in the protocol's own error format with `status`."""

    def __init__(self, status: int, message: str, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


# ── Wire bodies ─────────────────────────────────────────────────────────────────────────────


class _Wire(BaseModel):
    model_config = ConfigDict(extra="ignore")  # clients send many fields we do not use


class _Message(_Wire):
    role: str
    content: str | list[dict[str, Any]] | None = None


class _OllamaChat(_Wire):
    model: str = ""
    messages: list[_Message] = []
    stream: bool | None = None
    keep_alive: int | float | str | None = None


class _OllamaGenerate(_Wire):
    model: str = ""
    prompt: str = ""
    stream: bool | None = None
    keep_alive: int | float | str | None = None


class _OllamaShow(_Wire):
    model: str = ""
    name: str = ""  # older clients


class _StreamOptions(_Wire):
    include_usage: bool = False


class _OpenAIChat(_Wire):
    model: str = ""
    messages: list[_Message] = Field(min_length=1)
    stream: bool | None = None
    stream_options: _StreamOptions | None = None


async def _body(request: Request, model: type[T]) -> T:
    try:
        return await _http.read_json(request, model, MAX_BODY)
    except _http.BadRequest as exc:
        raise ProxyError(exc.status, str(exc)) from None


def _transcript(messages: list[_Message]) -> list[Turn]:
    """The conversation up to its last user message (the prompt), as (role, text) pairs."""
    turns = [(m.role, content_text(m.content)) for m in messages]
    users = [i for i, (role, _) in enumerate(turns) if role == "user"]
    if not users:
        raise ProxyError(400, "no user message: send at least one message with role 'user'")
    return turns[: users[-1] + 1]


def _unloads(keep_alive: Any) -> bool:
    """Whether an Ollama `keep_alive` means "unload now" (0, "0", "0s", …)."""
    return str(keep_alive).strip().rstrip("smh") in ("0", "0.0")


def _json(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def _sse(obj: Any) -> ServerSentEvent:
    return ServerSentEvent(data=_json(obj), sep="\n")


def _now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _tagged(name: str) -> str:
    return name if ":" in name else f"{name}:latest"


# ── One turn as a chat client sees it ───────────────────────────────────────────────────────


class _Output:
    """Turns one request's events into answer text, status lines (per `status_lines`), an error, stats."""

    def __init__(self, status_lines: str, prompt: str):
        self.mode = status_lines
        self.started = time.monotonic_ns()
        self.first: int | None = None
        self.ended: int | None = None
        # The turn does not report the backend's token usage, so the counts are estimates:
        # about 4 characters per prompt token, one token per streamed piece.
        self.prompt_tokens = max(1, len(prompt) // 4)
        self.pieces = 0
        self.text: list[str] = []
        self.thinking: list[str] = []
        self.error: str | None = None
        #: The HTTP status of a failed turn: 504 the model did not answer in time, 503 the turn was
        #: cancelled, 502 any other failure of the agent's backend.
        self.error_status = 502
        self._tail = "\n\n"

    @property
    def finished(self) -> bool:
        return self.ended is not None

    def feed(self, ev: state.Event) -> tuple[str, str]:
        """(answer text, reasoning text) that this event adds; notes an error or the end."""
        content = thinking = ""
        if ev.name == "tok":
            content = str(ev.data.get("text", ""))
            self.pieces += 1
            if self.first is None:
                self.first = time.monotonic_ns()
        elif ev.name == "status" and ev.data.get("cancelled"):
            self.error = "the request was cancelled: the server is stopping or the session was deleted"
            self.error_status = 503
            self.ended = time.monotonic_ns()
        elif ev.name in ("status", "gate"):
            line = str(ev.data.get("text", "")) if ev.name == "status" else (
                f"[{ev.data.get('tool_name', 'tool')}] waits for approval in shell.py")
            content, thinking = self._status(line)
        elif ev.name == "error" and self.error is None:
            self.error = str(ev.data.get("message", "error"))
            self.error_status = 504 if ev.data.get("kind") == "timeout" else 502
        elif ev.name == "done":
            self.ended = time.monotonic_ns()
        if content:
            self._tail = (self._tail + content)[-2:]
            self.text.append(content)
        if thinking:
            self.thinking.append(thinking)
        return content, thinking

    def failure(self) -> tuple[int, str, str]:
        """(HTTP status, message, OpenAI error code) of the failed turn."""
        return self.error_status, self.error or "", _ERROR_CODES[self.error_status]

    def _status(self, line: str) -> tuple[str, str]:
        if not line or self.mode == "off":
            return "", ""
        if self.mode == "thinking":
            return "", line + "\n"
        # A Markdown quote paragraph of its own, so it never runs into the answer text.
        lead = "" if self._tail == "\n\n" else "\n" if self._tail.endswith("\n") else "\n\n"
        return lead + "> " + line.replace("\n", "\n> ") + "\n\n", ""

    def ollama_stats(self) -> dict[str, Any]:
        end = self.ended or time.monotonic_ns()
        first = self.first or end
        return {
            "done_reason": "stop", "total_duration": end - self.started, "load_duration": 0,
            "prompt_eval_count": self.prompt_tokens, "prompt_eval_duration": first - self.started,
            "eval_count": self.pieces, "eval_duration": end - first,
        }

    def usage(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.pieces,
                "total_tokens": self.prompt_tokens + self.pieces}


# ── Protocol writers ────────────────────────────────────────────────────────────────────────


class _Ollama:
    """Ollama framing: one complete JSON object per NDJSON line, never a blank line."""

    def __init__(self, model: str, kind: Literal["chat", "generate"] = "chat"):
        self.model, self.kind = model, kind

    def obj(self, content: str, thinking: str = "", done: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {"model": self.model, "created_at": _now_iso()}
        if self.kind == "chat":
            out["message"] = {"role": "assistant", "content": content, **({"thinking": thinking} if thinking else {})}
        else:
            out["response"] = content
            if thinking:
                out["thinking"] = thinking
        out["done"] = done
        return out

    @staticmethod
    def line(obj: dict[str, Any]) -> str:
        return _json(obj) + "\n"

    @staticmethod
    def error_response(status: int, message: str, code: str | None = None) -> JSONResponse:
        return JSONResponse({"error": message}, status_code=status, headers=_NO_RETRY)

    def whole(self, out: _Output) -> JSONResponse:
        return JSONResponse({**self.obj("".join(out.text), "".join(out.thinking), done=True), **out.ollama_stats()})

    def stream(self, out: _Output, first: tuple[str, str], events: AsyncIterator[state.Event]) -> Response:
        async def body() -> AsyncIterator[str]:
            async for content, thinking in _pieces(out, first, events):
                if out.error is not None:
                    yield self.line({"error": out.error})
                elif out.finished:
                    yield self.line({**self.obj("", done=True), **out.ollama_stats()})
                else:
                    yield self.line(self.obj(content, thinking))

        return StreamingResponse(body(), media_type="application/x-ndjson",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


class _OpenAI:
    """OpenAI chat-completions framing: `chat.completion` JSON, or SSE chunks ending with `[DONE]`."""

    def __init__(self, model: str, include_usage: bool = False):
        self.model, self.include_usage = model, include_usage
        self.head = {"id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "object": "chat.completion.chunk",
                     "created": int(time.time()), "model": self.model, "system_fingerprint": None}

    @staticmethod
    def error_body(status: int, message: str, code: str | None = None) -> dict[str, Any]:
        kind = _OPENAI_ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        return {"error": {"message": message, "type": kind, "param": None, "code": code}}

    @staticmethod
    def error_response(status: int, message: str, code: str | None = None) -> JSONResponse:
        return JSONResponse(_OpenAI.error_body(status, message, code), status_code=status, headers=_NO_RETRY)

    def whole(self, out: _Output) -> JSONResponse:
        message: dict[str, Any] = {"role": "assistant", "content": "".join(out.text), "refusal": None}
        if out.thinking:
            message["reasoning_content"] = "".join(out.thinking)
        return JSONResponse({
            **self.head, "object": "chat.completion",
            "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": "stop"}],
            "usage": out.usage(),
        })

    def chunk(self, delta: dict[str, Any], finish: str | None = None) -> ServerSentEvent:
        obj: dict[str, Any] = {**self.head,
                               "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
        if self.include_usage:
            obj["usage"] = None  # the spec: null on every chunk but the last
        return _sse(obj)

    def stream(self, out: _Output, first: tuple[str, str], events: AsyncIterator[state.Event]) -> Response:
        async def body() -> AsyncIterator[ServerSentEvent]:
            yield self.chunk({"role": "assistant", "content": ""})
            async for content, thinking in _pieces(out, first, events):
                if out.error is not None:
                    yield _sse(self.error_body(*out.failure()))
                elif out.finished:
                    yield self.chunk({}, "stop")
                    if self.include_usage:
                        yield _sse({**self.head, "choices": [], "usage": out.usage()})
                    yield ServerSentEvent(data="[DONE]", sep="\n")
                else:
                    yield self.chunk({"content": content} if content else {"reasoning_content": thinking})

        return EventSourceResponse(body(), ping=SSE_PING_SECONDS, sep="\n", headers={"Cache-Control": "no-cache"})


async def _pieces(out: _Output, first: tuple[str, str], events: AsyncIterator[state.Event]
                  ) -> AsyncIterator[tuple[str, str]]:
    """What a stream must write: `first` (already fed to `out`), then each later event's text, then
    the end or the error. After an error the rest of the turn (its `done`) is read without writing.
    """
    try:
        content, thinking = first
        while True:
            if out.error is not None:
                yield "", ""
                async for _ in events:
                    pass
                return
            if content or thinking or out.finished:
                yield content, thinking
            if out.finished:
                return
            ev = await anext(events, None)
            if ev is None:
                return
            content, thinking = out.feed(ev)
    finally:
        await events.aclose()  # cancels the turn if the client went away before its end


async def _first_output(events: AsyncIterator[state.Event]) -> state.Event:
    """The turn's first event that says something to the client (not the echo of its own message)."""
    async for ev in events:
        if ev.name != "user":
            return ev
    raise StopAsyncIteration


# ── The plugin ──────────────────────────────────────────────────────────────────────────────


class LlamaProxyPlugin(BasePlugin):
    """Serves Ollama and OpenAI chat clients (open-webui, Enchanted, LM Studio, the SDKs)."""

    PLUGIN_NAME = "plugin_proxy_llama"
    PLUGIN_VERSION = "1.0.0"
    PLUGIN_TYPE = "client_interface"
    CLIENT_NAMESPACES = {PREFIX: gate.PROXY}
    DESCRIPTION = "Ollama- and OpenAI-compatible proxy (open-webui, Enchanted, LM Studio, SDKs)"
    DEPENDENCIES = ["sse-starlette"]

    def __init__(self) -> None:
        super().__init__()
        self.cfg = ProxyConfig()
        self._started = _now_iso()
        self._created = int(time.time())
        self._routes: list[Route] = []

    def init(self, config: dict[str, Any]) -> bool:
        self.cfg = parse_settings(self.PLUGIN_NAME, ProxyConfig, config)
        return True

    @functools.cached_property
    def conversations(self) -> ConversationIndex:
        return ConversationIndex(self.rt.sessions, PREFIX)

    def shutdown(self) -> None:
        """Nothing to release: every request's turn ends with its connection."""

    def get_config(self) -> dict[str, Any]:
        env = self.runtime.config.env if self.runtime else {}
        return {"host": self.cfg.host, "port": self.cfg.port, "name": "Ollama/OpenAI proxy",
                "token": env.get(self.cfg.token_env) or None, "allowed_hosts": self.cfg.allowed_hosts,
                "allowed_origins": self.cfg.allowed_origins}

    def get_help(self) -> str:
        return (f"Ollama/OpenAI proxy on http://{self.cfg.host}:{self.cfg.port} "
                f"(models: {', '.join(self.model_names())})")

    # ── routing ──

    def get_routes(self) -> list[Route]:
        o, a = self._ollama_endpoint, self._openai_endpoint
        table: list[Route] = [Route(p, self.root, methods=["GET"]) for p in ("/", "/v1", "/v1/")]
        for prefix in ("/api", "/v1/api"):  # /v1/api/*: Enchanted with a server URL ending in /v1
            table += [
                Route(f"{prefix}/version", o(self.version), methods=["GET"]),
                Route(f"{prefix}/tags", o(self.tags), methods=["GET"]),
                Route(f"{prefix}/ps", o(self.ps), methods=["GET"]),
                Route(f"{prefix}/show", o(self.show), methods=["POST"]),
                Route(f"{prefix}/chat", o(self.ollama_chat), methods=["POST"]),
                Route(f"{prefix}/generate", o(self.ollama_generate), methods=["POST"]),
            ]
            table += [Route(f"{prefix}/{name}", o(self.unsupported), methods=[method])
                      for name, method in _UNSUPPORTED_OLLAMA.items()]
        for prefix in ("/v1", ""):  # open-webui's OpenAI connection may be set up without /v1
            table += [
                Route(f"{prefix}/models", a(self.models), methods=["GET"]),
                Route(f"{prefix}/models/{{model_id:path}}", a(self.model), methods=["GET"]),
                Route(f"{prefix}/chat/completions", a(self.openai_chat), methods=["POST"]),
                Route(f"{prefix}/embeddings", a(self.unsupported), methods=["POST"]),
            ]
        self._routes = table
        return [*table, Route("/{path:path}", self.not_found,
                              methods=["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"])]

    def _ollama_endpoint(self, handler: Any) -> Any:
        return self._endpoint(handler, _Ollama.error_response)

    def _openai_endpoint(self, handler: Any) -> Any:
        return self._endpoint(handler, _OpenAI.error_response)

    @staticmethod
    def _endpoint(handler: Any, render: Any) -> Any:
        async def endpoint(request: Request) -> Response:
            try:
                return await handler(request)
            except ProxyError as exc:
                return render(exc.status, exc.message, exc.code)

        return endpoint

    async def not_found(self, request: Request) -> Response:
        """Unknown paths and wrong methods, in the format the path (or else the User-Agent) implies."""
        path = request.url.path
        ollama = path.startswith(("/api/", "/v1/api/")) or (
            not path.startswith("/v1/") and "ollama" in request.headers.get("user-agent", "").lower())
        render = _Ollama.error_response if ollama else _OpenAI.error_response
        allowed = sorted({m for r in self._routes if r.path_regex.match(path) for m in r.methods or ()})
        if allowed:
            response = render(405, f"{request.method} is not supported on {path}; use {' or '.join(allowed)}")
            response.headers["Allow"] = ", ".join(allowed)
            return response
        return render(404, f"unsupported endpoint: {request.method} {path}", "unknown_endpoint")

    async def unsupported(self, request: Request) -> Response:
        name = request.url.path.rstrip("/").rsplit("/", 1)[-1]
        # 404, not 501: a missing feature is no server failure, and SDKs retry every 5xx.
        raise ProxyError(404, f"{name} is not supported: this server is an agent, not a model store",
                         "unsupported_endpoint")

    # ── models ──

    def model_names(self) -> dict[str, str | None]:
        """Listed name → registry key for that model, or None for the agent on the session's model."""
        names: dict[str, str | None] = {_tagged(self.cfg.model_name): None}
        for key in self.rt.config.models:
            names.setdefault(_tagged(key), key)
        return names

    def _resolve(self, requested: str) -> tuple[str, str | None]:
        """(listed name, registry key or None) for a requested model; no model means the agent."""
        names = self.model_names()
        name = _tagged(requested.strip()) if requested.strip() else _tagged(self.cfg.model_name)
        if name not in names:
            raise ProxyError(404, f"model '{requested}' not found; available: {', '.join(names)}", "model_not_found")
        return name, names[name]

    def _details(self) -> dict[str, Any]:
        return {"parent_model": "", "format": "gguf", "family": "agent-mcp", "families": ["agent-mcp"],
                "parameter_size": "0B", "quantization_level": "none"}

    def _ollama_model(self, name: str) -> dict[str, Any]:
        return {"name": name, "model": name, "modified_at": self._started, "size": 0,
                "digest": hashlib.sha256(name.encode()).hexdigest(), "details": self._details()}

    def _openai_model(self, name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": self._created, "owned_by": "agent-mcp"}

    async def root(self, request: Request) -> Response:
        return PlainTextResponse("Ollama is running")

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": OLLAMA_API_VERSION})

    async def tags(self, request: Request) -> Response:
        return JSONResponse({"models": [self._ollama_model(n) for n in self.model_names()]})

    async def ps(self, request: Request) -> Response:
        agent = _tagged(self.cfg.model_name)
        return JSONResponse({"models": [{**self._ollama_model(agent), "expires_at": "2099-01-01T00:00:00Z",
                                         "size_vram": 0, "context_length": 0}]})

    async def show(self, request: Request) -> Response:
        body = await _body(request, _OllamaShow)
        name, key = self._resolve(body.model or body.name)
        registry = self.rt.config.models.get(key or self.rt.config.default_model)
        about = f"agent-mcp on {key}" if key else "agent-mcp on the session's model (!model to switch)"
        return JSONResponse({
            "modelfile": f"# {about}" + (f": {registry.description}" if key and registry else ""),
            "parameters": "", "template": "{{ .Prompt }}", "details": self._details(),
            "model_info": {"general.architecture": "agent-mcp", "general.basename": name},
            "capabilities": ["completion"], "modified_at": self._started,
        })

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._openai_model(n) for n in self.model_names()]})

    async def model(self, request: Request) -> Response:
        name, _ = self._resolve(request.path_params["model_id"])
        return JSONResponse(self._openai_model(name))

    # ── chat ──

    async def ollama_chat(self, request: Request) -> Response:
        body = await _body(request, _OllamaChat)
        name, key = self._resolve(body.model)
        fmt = _Ollama(name, "chat")
        if not body.messages:  # Ollama's load / unload request
            return JSONResponse({**fmt.obj("", done=True), "done_reason": "unload" if _unloads(body.keep_alive) else "load"})
        return await self._answer(request, fmt, _transcript(body.messages), key, body.stream is not False)

    async def ollama_generate(self, request: Request) -> Response:
        body = await _body(request, _OllamaGenerate)
        name, key = self._resolve(body.model)
        fmt = _Ollama(name, "generate")
        if not body.prompt.strip():
            return JSONResponse({**fmt.obj("", done=True), "done_reason": "unload" if _unloads(body.keep_alive) else "load"})
        return await self._answer(request, fmt, [("user", body.prompt)], key, body.stream is not False)

    async def openai_chat(self, request: Request) -> Response:
        body = await _body(request, _OpenAIChat)
        name, key = self._resolve(body.model)
        fmt = _OpenAI(name, bool(body.stream_options and body.stream_options.include_usage))
        return await self._answer(request, fmt, _transcript(body.messages), key, body.stream is True)

    def _address(self, request: Request) -> str:
        return f"{PREFIX}{request.client.host if request.client else 'unknown'}"

    def _by_header(self, request: Request) -> str | None:
        """`llama-<client ip>-chat-<id>` (or `-user-<id>`) when open-webui forwards its chat or user."""
        if self.cfg.session_per_chat:
            for header, kind in _SESSION_HEADERS:
                value = request.headers.get(header, "").strip()
                if value:
                    safe = value if _SAFE_ID.match(value) else hashlib.sha256(value.encode()).hexdigest()[:16]
                    return f"{self._address(request)}-{kind}-{safe}"
        return None

    def _scope(self, request: Request) -> str:
        """What narrows a conversation match: the client address, its API key (digested), a forwarded user."""
        auth = request.headers.get("authorization", "")
        return "\x00".join((self._address(request), hashlib.sha256(auth.encode()).hexdigest() if auth else "",
                             request.headers.get("x-openwebui-user-id", "")))

    async def _session_of(self, request: Request, transcript: list[Turn]) -> tuple[str, str | None]:
        """(client id, scope) of the session this request continues or starts; the scope is None when
        the session is not told by the transcript (forwarded headers, `sessions_by: "address"`)."""
        by_header = self._by_header(request)
        if by_header is not None or self.cfg.sessions_by == "address":
            return by_header or self._address(request), None
        scope, prior = self._scope(request), transcript[:-1]
        client_id = self.conversations.claim(fingerprint(scope, prior)) if prior else None
        if client_id is None:
            client_id = f"{PREFIX}{uuid.uuid4().hex[:16]}"
            session, _ = self.rt.sessions.get_or_add(client_id, self.rt.config.default_model, gate.PROXY)
            session.history = seed(prior)
            await self.rt.sessions.save(session)
        return client_id, scope

    async def _then_remember(self, events: AsyncIterator[state.Event], out: _Output, client_id: str, scope: str,
                             transcript: list[Turn]) -> AsyncIterator[state.Event]:
        """`events`, remembering the transcript the client will send back next when the turn ends well:
        before its `done` is passed on, so the client cannot send it before it is known (and stored)."""
        async with contextlib.aclosing(events):
            async for ev in events:
                if ev.name == "done" and out.error is None:  # every event before it has been fed to `out`
                    answer = ("assistant", "".join(out.text))
                    await self.conversations.remember(client_id, fingerprint(scope, [*transcript, answer]))
                yield ev

    async def _then_forget(self, events: AsyncIterator[state.Event], client_id: str) -> AsyncIterator[state.Event]:
        """`events`; then, once the request has ended, the throwaway session is deleted."""
        try:
            async for ev in events:
                yield ev
        finally:
            await events.aclose()
            await routes.cancel_active_task(self.rt, client_id)  # a request cut short: wait for its cleanup
            if self.rt.sessions.get(client_id) is not None:
                await self.rt.sessions.delete(client_id, remember=False)  # which also drops its event channel
            else:
                self.rt.hub.drop(client_id)

    async def _answer(self, request: Request, fmt: _Ollama | _OpenAI, transcript: list[Turn], key: str | None,
                      stream: bool) -> Response:
        """Run the conversation's last user message as one turn and answer in `fmt`, streamed or whole."""
        text = transcript[-1][1]
        if not text.strip():
            raise ProxyError(400, "the last user message is empty")
        if len(text) > MAX_PROMPT:
            raise ProxyError(413, f"the message is {len(text)} characters; the limit is {MAX_PROMPT}")
        out = _Output(self.cfg.status_lines, text)
        payload = {"model": key} if key else None
        if self.cfg.task_sessions and text.lstrip().startswith(TASK_PREFIX):
            client_id = f"{self._by_header(request) or self._address(request)}-task-{uuid.uuid4().hex[:12]}"
            events = self._then_forget(routes.run_turn(self.rt, client_id, text, payload), client_id)
        else:
            client_id, scope = await self._session_of(request, transcript)
            events = routes.run_turn(self.rt, client_id, text, payload)
            if scope is not None:
                events = self._then_remember(events, out, client_id, scope, transcript)
        if not stream:
            async def collect() -> bool:
                async with contextlib.aclosing(events):
                    async for ev in events:
                        out.feed(ev)
                return True

            if await _http.unless_disconnected(request, collect()) is None:
                return Response(status_code=499)  # nobody is listening any more
            return fmt.error_response(*out.failure()) if out.error is not None else fmt.whole(out)
        # Wait for the first event before answering, so an error before any output gets an
        # error status instead of a 200 stream.
        first = await _http.unless_disconnected(request, _first_output(events))
        if first is None:
            return Response(status_code=499)
        piece = out.feed(first)
        if out.error is not None:
            async for _ in events:
                pass
            return fmt.error_response(*out.failure())
        return fmt.stream(out, piece, events)
