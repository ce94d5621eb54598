"""Ollama- and OpenAI-compatible proxy: chat apps and SDKs talk to the agent as to a model server.

Ollama API on `/api/*` (and `/v1/api/*`, where Enchanted sends it when its URL ends in `/v1`):
NDJSON streams, JSON otherwise. OpenAI API on `/v1/*`, `/models` and `/chat/completions`: SSE
`chat.completion.chunk` streams, JSON otherwise. The path decides the format; the User-Agent only
decides the error format of paths that belong to neither. Each chat request is one turn of the
session of its conversation (`plugins._conversations`: the resent transcript says which; one per
chat or user when a trusted forwarder such as open-webui names them; `sessions_by: "address"` keeps
the reference behaviour, one session `llama-<client ip>`); its prompt is the last user message,
because the server keeps the history itself. Tokens are written the moment the model produces
them. Binds 127.0.0.1:11435 by default; with `AGENT_PROXY_TOKEN` set, every request needs
`Authorization: Bearer <token>`; with `user_keys`, every request needs one of those keys, and the
key says who the caller is (`plugins._proxy_identity`: forwarded headers count only from a
forwarder's key and a trusted address).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, Literal

from pydantic import ConfigDict, Field
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

import guard
import plugin_api
from plugin_api import BasePlugin, parse_settings
from plugins import _http
from plugins._conversations import ConversationIndex, Turn, fingerprint, seed
from plugins._proxy_identity import Caller, Identities, IdentityError, IdentitySettings, config_extra
from plugins._proxy_wire import (
    EventStream,
    Ollama,
    OllamaChat,
    OllamaGenerate,
    OllamaShow,
    OpenAI,
    OpenAIChat,
    Output,
    ProxyError,
    TurnPump,
    first_output,
    now_iso,
    read_body,
    tagged,
    transcript,
    unloads,
)

#: Client ids of this plugin's sessions start with this (its client-id namespace).
PREFIX = "llama-"
#: A route's handler.
Handler = Callable[[Request], Awaitable[Response]]
logger = logging.getLogger("agent_mcp.proxy")

#: The Ollama API version we answer like (open-webui parses it as dotted numbers).
OLLAMA_API_VERSION = "0.12.3"
DEFAULT_PORT = 11435  # 11434 is Ollama's own port, where the shipped `local` model lives
MAX_PROMPT = 200_000
TASK_PREFIX = "### Task:"  # how every open-webui background-task prompt template starts
_UNSUPPORTED_OLLAMA = {"embed": "POST", "embeddings": "POST", "pull": "POST", "push": "POST",
                       "create": "POST", "copy": "POST", "delete": "DELETE"}


class ProxyConfig(guard.ListenerSettings, IdentitySettings):
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
    #: One session per open-webui chat (or user) when a trusted forwarder names them.
    session_per_chat: bool = True
    #: Without those headers: a session per conversation (told by the transcript the client resends),
    #: or one per client address (the reference behaviour: one memory across all chats of a host).
    sessions_by: Literal["conversation", "address"] = "conversation"
    #: open-webui's background tasks (titles, tags, follow-ups: prompts starting with `### Task:`)
    #: run in a throwaway session, so they never enter the chat's history.
    task_sessions: bool = True


# ── The plugin ──────────────────────────────────────────────────────────────────────────────


class LlamaProxyPlugin(BasePlugin):
    """Serves Ollama and OpenAI chat clients (open-webui, Enchanted, LM Studio, the SDKs)."""

    PLUGIN_NAME = "plugin_proxy_llama"
    PLUGIN_VERSION = "1.0.0"
    PLUGIN_TYPE = "client_interface"
    CLIENT_NAMESPACES = {PREFIX: plugin_api.PROXY}
    DESCRIPTION = "Ollama- and OpenAI-compatible proxy (open-webui, Enchanted, LM Studio, SDKs)"
    DEPENDENCIES = ["sse-starlette"]

    def __init__(self) -> None:
        super().__init__()
        self.cfg = ProxyConfig()
        self._started = now_iso()
        self._created = int(time.time())
        self._routes: list[Route] = []
        #: Turns being read (TurnPump); one whose client left while a gate waits for approvers runs on here.
        self._pumps: set[asyncio.Task[None]] = set()

    def init(self, config: dict[str, Any]) -> bool:
        self.cfg = parse_settings(self.PLUGIN_NAME, ProxyConfig, config)
        return True

    @functools.cached_property
    def conversations(self) -> ConversationIndex:
        return ConversationIndex(self.ctx.sessions, PREFIX, self.ctx.values)

    @functools.cached_property
    def identities(self) -> Identities:
        env = self.context.config.env if self.context else {}
        return Identities(self.cfg, env.get(self.cfg.token_env) or None)

    def shutdown(self) -> None:
        """Nothing to release: every request's turn ends with its connection."""

    def get_config(self) -> dict[str, Any]:
        env = self.context.config.env if self.context else {}
        return {"host": self.cfg.host, "port": self.cfg.port, "name": "Ollama/OpenAI proxy",
                "token": env.get(self.cfg.token_env) or None, "allowed_hosts": self.cfg.allowed_hosts,
                "allowed_origins": self.cfg.allowed_origins, **config_extra(self.identities)}

    def get_help(self) -> str:
        return (f"Ollama/OpenAI proxy on http://{self.cfg.host}:{self.cfg.port} "
                f"(models: {', '.join(self.model_names())})")

    # ── routing ──

    def get_routes(self) -> list[Route]:
        o, a = self._ollama_endpoint, self._openai_endpoint
        # The chat routes first: Starlette tries the routes in order, and nearly every request is a chat
        # (the OpenAI one was the 32nd: 13 µs of matching per request). No two of these paths overlap.
        table: list[Route] = [Route(f"{prefix}/chat/completions", a(self.openai_chat), methods=["POST"])
                              for prefix in ("/v1", "")]  # open-webui's OpenAI connection may be set up without /v1
        for prefix in ("/api", "/v1/api"):  # /v1/api/*: Enchanted with a server URL ending in /v1
            table += [Route(f"{prefix}/chat", o(self.ollama_chat), methods=["POST"]),
                      Route(f"{prefix}/generate", o(self.ollama_generate), methods=["POST"])]
        table += [Route(p, self._endpoint(self.root, OpenAI.error_response), methods=["GET"])
                  for p in ("/", "/v1", "/v1/")]
        for prefix in ("/api", "/v1/api"):
            table += [
                Route(f"{prefix}/version", o(self.version), methods=["GET"]),
                Route(f"{prefix}/tags", o(self.tags), methods=["GET"]),
                Route(f"{prefix}/ps", o(self.ps), methods=["GET"]),
                Route(f"{prefix}/show", o(self.show), methods=["POST"]),
            ]
            table += [Route(f"{prefix}/{name}", o(self.unsupported), methods=[method])
                      for name, method in _UNSUPPORTED_OLLAMA.items()]
        for prefix in ("/v1", ""):
            table += [
                Route(f"{prefix}/models", a(self.models), methods=["GET"]),
                Route(f"{prefix}/models/{{model_id:path}}", a(self.model), methods=["GET"]),
                Route(f"{prefix}/embeddings", a(self.unsupported), methods=["POST"]),
            ]
        self._routes = table
        return [*table, Route("/{path:path}", self.not_found,
                              methods=["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"])]

    def _ollama_endpoint(self, handler: Handler) -> Handler:
        return self._endpoint(handler, Ollama.error_response)

    def _openai_endpoint(self, handler: Handler) -> Handler:
        return self._endpoint(handler, OpenAI.error_response)

    def _endpoint(self, handler: Handler, render: Callable[[int, str, str | None], Response]) -> Handler:
        async def endpoint(request: Request) -> Response:
            try:
                request.state.caller = self.identities.caller(request)
                return await handler(request)
            except IdentityError as exc:
                return render(401, str(exc), "invalid_api_key")
            except ProxyError as exc:
                return render(exc.status, exc.message, exc.code)

        return endpoint

    async def not_found(self, request: Request) -> Response:
        """Unknown paths and wrong methods, in the format the path (or else the User-Agent) implies."""
        path = request.url.path
        ollama = path.startswith(("/api/", "/v1/api/")) or (
            not path.startswith("/v1/") and "ollama" in request.headers.get("user-agent", "").lower())
        render = Ollama.error_response if ollama else OpenAI.error_response
        try:
            self.identities.caller(request)
        except IdentityError as exc:
            return render(401, str(exc), "invalid_api_key")
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
        names: dict[str, str | None] = {tagged(self.cfg.model_name): None}
        for key in self.ctx.config.models:
            names.setdefault(tagged(key), key)
        return names

    def _resolve(self, requested: str) -> tuple[str, str | None]:
        """(listed name, registry key or None) for a requested model; no model means the agent."""
        names = self.model_names()
        name = tagged(requested.strip()) if requested.strip() else tagged(self.cfg.model_name)
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
        agent = tagged(self.cfg.model_name)
        return JSONResponse({"models": [{**self._ollama_model(agent), "expires_at": "2099-01-01T00:00:00Z",
                                         "size_vram": 0, "context_length": 0}]})

    async def show(self, request: Request) -> Response:
        body = await read_body(request, OllamaShow)
        name, key = self._resolve(body.model or body.name)
        registry = self.ctx.config.models.get(key or self.ctx.config.default_model)
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
        body = await read_body(request, OllamaChat)
        name, key = self._resolve(body.model)
        fmt = Ollama(name, "chat")
        if not body.messages:  # Ollama's load / unload request
            return JSONResponse(
                {**fmt.obj("", done=True), "done_reason": "unload" if unloads(body.keep_alive) else "load"}
            )
        return await self._answer(request, fmt, transcript(body.messages), key, body.stream is not False)

    async def ollama_generate(self, request: Request) -> Response:
        body = await read_body(request, OllamaGenerate)
        name, key = self._resolve(body.model)
        fmt = Ollama(name, "generate")
        if not body.prompt.strip():
            return JSONResponse(
                {**fmt.obj("", done=True), "done_reason": "unload" if unloads(body.keep_alive) else "load"}
            )
        return await self._answer(request, fmt, [("user", body.prompt)], key, body.stream is not False)

    async def openai_chat(self, request: Request) -> Response:
        body = await read_body(request, OpenAIChat)
        name, key = self._resolve(body.model)
        fmt = OpenAI(name, bool(body.stream_options and body.stream_options.include_usage))
        return await self._answer(request, fmt, transcript(body.messages), key, body.stream is True)

    @staticmethod
    def _caller(request: Request) -> Caller:
        caller: Caller = request.state.caller  # set by _endpoint before any handler runs
        return caller

    def _address(self, request: Request) -> str:
        """`llama-<client ip>` anonymous (the reference's id); with a key, the key's user comes first."""
        caller = self._caller(request)
        return f"{PREFIX}{caller.address}" if caller.user is None else f"{PREFIX}{caller.slug}-{caller.address}"

    def _by_header(self, request: Request) -> str | None:
        """`llama-<forwarder>-chat-<id>` (or `-user-<id>`) when a trusted forwarder names its chat or user."""
        caller = self._caller(request)
        if self.cfg.session_per_chat and caller.user is not None:
            if caller.chat:
                return f"{PREFIX}{caller.slug}-chat-{caller.chat}"
            if caller.forwarded_user:
                return f"{PREFIX}{caller.slug}"
        return None

    async def _session_of(self, request: Request, transcript: list[Turn]
                          ) -> tuple[str, str | None, tuple[dict[str, Any], ...]]:
        """(client id, scope, history) of the session this request continues or starts; the scope is None
        when the session is not told by the transcript (forwarded headers, `sessions_by: "address"`); the
        history is what a session started now begins with (the client's earlier turns)."""
        by_header = self._by_header(request)
        if by_header is not None or self.cfg.sessions_by == "address":
            self.ctx.metrics.proxy_conversation("header" if by_header is not None else "address")
            return by_header or self._address(request), None, ()
        scope, prior = self._caller(request).scope, transcript[:-1]
        client_id = await self.conversations.claim(fingerprint(scope, prior)) if prior else None
        self.ctx.metrics.proxy_conversation("new" if client_id is None else "matched")
        if client_id is None:  # the request creates the session, with the conversation so far
            return f"{PREFIX}{uuid.uuid4().hex[:16]}", scope, tuple(seed(prior))
        return client_id, scope, ()

    async def _then_remember(self, events: EventStream, out: Output, client_id: str, scope: str,
                             transcript: list[Turn]) -> AsyncGenerator[plugin_api.Event, None]:
        """`events`, remembering the transcript the client will send back next when the turn ends well (or with its
        answer cut off, which the session keeps): before its `done` is passed on, so the client cannot send it
        before it is known (and stored)."""
        async with contextlib.aclosing(events):
            async for ev in events:
                if ev.name == "done" and (out.error is None or out.cut):  # every event before it was fed to `out`
                    answer = ("assistant", "".join(out.text))
                    await self.conversations.remember(client_id, fingerprint(scope, [*transcript, answer]))
                yield ev

    async def _then_forget(self, events: EventStream, client_id: str
                           ) -> AsyncGenerator[plugin_api.Event, None]:
        """`events`; then, once the request has ended, the throwaway session is deleted."""
        try:
            async for ev in events:
                yield ev
        finally:
            await events.aclose()
            # A request cut short is cancelled and cleaned up first; nobody else follows the id: no notice.
            await self.ctx.delete_session(client_id, remember=False, announce=False)

    async def _answer(self, request: Request, fmt: Ollama | OpenAI, transcript: list[Turn], key: str | None,
                      stream: bool) -> Response:
        """Run the conversation's last user message as one turn and answer in `fmt`, streamed or whole."""
        text = transcript[-1][1]
        if not text.strip():
            raise ProxyError(400, "the last user message is empty")
        if len(text) > MAX_PROMPT:
            raise ProxyError(413, f"the message is {len(text)} characters; the limit is {MAX_PROMPT}")
        out = Output(self.cfg.status_lines, text)
        # Rate limits follow who is asking, proven, not the session (a new chat is a new session).
        identity = f"proxy:{self._caller(request).identity}"
        if self.cfg.task_sessions and text.lstrip().startswith(TASK_PREFIX):
            client_id = f"{self._by_header(request) or self._address(request)}-task-{uuid.uuid4().hex[:12]}"
            asked = self.ctx.request(client_id, text, model=key, identity=identity)
            events: EventStream = self._then_forget(self.ctx.run_turn(asked), client_id)
        else:
            client_id, scope, history = await self._session_of(request, transcript)
            asked = self.ctx.request(client_id, text, model=key, identity=identity, history=history)
            events = self.ctx.run_turn(asked)
            if scope is not None:
                events = self._then_remember(events, out, client_id, scope, transcript)
        events = TurnPump(events, out, self._pumps)  # a gate waiting for approvers outlives a client that left
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
        first = await _http.unless_disconnected(request, first_output(events))
        if first is None:
            return Response(status_code=499)
        piece = out.feed(first)
        if out.error is not None:
            async for _ in events:
                pass
            return fmt.error_response(*out.failure())
        return fmt.stream(out, piece, events)
