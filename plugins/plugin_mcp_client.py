"""MCP client: the tools of external MCP servers (stdio and Streamable HTTP) as agent-mcp tools.

Servers are listed in `mcp-servers.json` in the config directory. At start every enabled server is
connected; each of its tools becomes a `StructuredTool` named `<server>_<tool>` whose argument
schema is the server's own input schema, registered with every other tool (so `llm_tools`, rate
limits and gates apply; gate type `mcp`). A server that cannot start is reported (log, /health,
`!mcp`) and skipped. A server that dies is reconnected on the next call of one of its tools; a
tool-list change announced by the server replaces its tools in the registry; shutdown closes
every session and stops every child process. `!mcp` lists servers, status and tools.

Each connection lives in its own task, so the SDK's task groups and cancel scopes are entered
and left in one task whatever task calls a tool.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import hashlib
import json
import logging
import os
import re
from collections import deque
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import anyio
import httpx2
import jsonschema
import mcp_types as types
from langchain_core.tools import StructuredTool
from mcp import Client, StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp.client.subscriptions import SubscriptionLost
from mcp.shared.exceptions import MCPError
from mcp_types.version import MODERN_PROTOCOL_VERSIONS
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from config import ConfigError, read_json
from plugin_loader import BasePlugin, PluginSettings, parse_settings

logger = logging.getLogger("agent_mcp.mcp_client")

MCP_SERVERS_FILE = "mcp-servers.json"
GATE_TYPE = "mcp"
#: OpenAI rejects function names longer than this.
MAX_TOOL_NAME = 64
STDERR_LINES_KEPT = 20
CLOSE_GRACE_SECONDS = 10


# ── Configuration ───────────────────────────────────────────────────────────────────────────


def _env_name(v: str) -> str:
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", v):
        raise ValueError(f"{v!r} is not an environment variable name (letters, digits, _)")
    return v


def _server_name(v: str) -> str:
    if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_]{0,31}", v):
        raise ValueError(f"server name {v!r}: use up to 32 letters, digits and _, starting with a letter "
                         "(it prefixes the names of the server's tools)")
    return v


EnvName = Annotated[str, AfterValidator(_env_name)]
ServerName = Annotated[str, AfterValidator(_server_name)]


class _ServerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    #: Only for a trusted server do its `readOnlyHint` annotations make tools gate as reads.
    trusted: bool = False
    #: "auto" negotiates the newest protocol era; "legacy" forces the 2025-11-25 handshake.
    protocol: Literal["auto", "legacy"] = "auto"
    connect_timeout: float = Field(default=30, gt=0, le=600)
    call_timeout: float = Field(default=120, gt=0, le=3600)


class StdioServer(_ServerConfig):
    """A server started as a child process, speaking MCP over its stdin/stdout."""

    command: str = Field(min_length=1)
    args: list[str] = []
    #: Variables passed to the child, as names (same name) or child name → agent-mcp variable.
    #: Nothing else of agent-mcp's environment is passed (the SDK adds HOME, PATH, SHELL, …).
    env: dict[EnvName, EnvName] = {}
    #: Working directory; relative paths are relative to the config directory (the default).
    cwd: str | None = None

    @field_validator("env", mode="before")
    @classmethod
    def _names_to_mapping(cls, v: Any) -> Any:
        return {n: n for n in v} if isinstance(v, list) and all(isinstance(n, str) for n in v) else v


class HttpServer(_ServerConfig):
    """A server reached over Streamable HTTP."""

    url: str
    #: Literal headers (nothing secret: the file is not a secret store).
    headers: dict[str, str] = {}
    #: Header name → environment variable holding its value.
    headers_env: dict[str, EnvName] = {}
    #: Environment variable holding a bearer token, sent as `Authorization: Bearer <token>`.
    token_env: EnvName | None = None

    @field_validator("url")
    @classmethod
    def _http_url(cls, v: str) -> str:
        parts = urlsplit(v)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("must be an http:// or https:// URL, e.g. http://127.0.0.1:8000/mcp")
        return v


def _server_kind(value: Any) -> str | None:
    if isinstance(value, BaseModel):
        return "stdio" if isinstance(value, StdioServer) else "http"
    if not isinstance(value, dict) or ("command" in value) == ("url" in value):
        return None
    return "stdio" if "command" in value else "http"


ServerConfig = Annotated[
    Annotated[StdioServer, Tag("stdio")] | Annotated[HttpServer, Tag("http")],
    Discriminator(
        _server_kind,
        custom_error_type="server_kind",
        custom_error_message="a server needs exactly one of 'command' (stdio) and 'url' (Streamable HTTP)",
    ),
]


class McpServersFile(BaseModel):
    """`mcp-servers.json`: the MCP servers whose tools agent-mcp uses, by name."""

    model_config = ConfigDict(extra="forbid")

    version: str = "1.0.0"
    servers: dict[ServerName, ServerConfig] = {}


def load_servers(path: Path) -> McpServersFile:
    """Read and validate `mcp-servers.json`; a ConfigError names the file and each bad field."""
    data = read_json(path)
    try:
        return McpServersFile.model_validate(data)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            # Drop the union tags pydantic puts in the location; users know fields, not tags.
            where = ".".join(str(p) for p in err["loc"] if p not in ("stdio", "http")) or "(top level)"
            lines.append(f"  field '{where}': {err['msg']}")
        raise ConfigError(f"{path}: invalid configuration\n" + "\n".join(lines)) from None


# ── Tool schemas and results ────────────────────────────────────────────────────────────────


class McpTool(StructuredTool):
    """A StructuredTool that shows models the MCP server's own input schema, unchanged."""

    mcp_schema: dict[str, Any]

    @property
    def tool_call_schema(self) -> dict[str, Any]:  # type: ignore[override]
        return {**copy.deepcopy(self.mcp_schema), "description": self.description}


def _llm_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """The input schema as sent to models: an object schema with `properties`, no `$schema`."""
    out = {k: copy.deepcopy(v) for k, v in schema.items() if k != "$schema"}
    out["type"] = "object"
    out.setdefault("properties", {})
    return out


def _args_model(exposed: str, schema: dict[str, Any]) -> type[BaseModel]:
    """A pydantic model that validates arguments against the server's JSON schema and keeps them all."""
    llm_schema = _llm_schema(schema)
    try:
        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        cls.check_schema(schema)
        validator: jsonschema.protocols.Validator | None = cls(schema)
    except jsonschema.SchemaError as exc:
        # The server checks its own arguments anyway; a broken schema must not hide the tool.
        logger.warning("tool %s: input schema is not valid JSON Schema (%s); arguments are not checked", exposed,
                       exc.message)
        validator = None

    class Arguments(BaseModel):
        model_config = ConfigDict(extra="allow", title=f"{exposed}_arguments")

        @model_validator(mode="before")
        @classmethod
        def _match_schema(cls, data: Any) -> Any:
            if validator is not None:
                problems = [
                    f"{'.'.join(map(str, e.absolute_path)) or 'arguments'}: {e.message}"
                    for e in sorted(validator.iter_errors(data), key=lambda e: list(map(str, e.absolute_path)))
                ]
                if problems:
                    raise PydanticCustomError("mcp_arguments", "{problems}", {"problems": "; ".join(problems)})
            return data

        @classmethod
        def model_json_schema(cls, *args: Any, **kwargs: Any) -> dict[str, Any]:
            return copy.deepcopy(llm_schema)

    Arguments.__name__ = Arguments.__qualname__ = f"{exposed}_arguments"
    return Arguments


def exposed_name(server: str, tool: str) -> str:
    """`<server>_<tool>` as a valid identifier of at most 64 characters."""
    name = re.sub(r"\W", "_", f"{server}_{tool}", flags=re.ASCII)
    if len(name) > MAX_TOOL_NAME:
        digest = hashlib.sha1(name.encode()).hexdigest()[:6]
        name = f"{name[:MAX_TOOL_NAME - 7]}_{digest}"
    return name


def _echoes(text: str, structured: dict[str, Any]) -> bool:
    """Whether a text block already carries the structured content (SDKs send both)."""
    candidates: list[Any] = [structured]
    if list(structured) == ["result"]:  # non-object results are wrapped as {"result": …}
        candidates.append(structured["result"])
    try:
        value = json.loads(text)
    except ValueError:
        value = text
    return value in candidates or text in candidates


def _block_text(block: Any) -> str:
    if isinstance(block, types.TextContent):
        return block.text
    if isinstance(block, types.ImageContent | types.AudioContent):
        kind = "image" if isinstance(block, types.ImageContent) else "audio"
        return f"[{kind} {block.mime_type}, {len(block.data) * 3 // 4} bytes]"
    if isinstance(block, types.ResourceLink):
        return f"[resource link: {block.name} {block.uri}]" + (f" {block.description}" if block.description else "")
    if isinstance(block, types.EmbeddedResource):
        res = block.resource
        if isinstance(res, types.TextResourceContents):
            return f"[resource {res.uri}]\n{res.text}"
        return f"[resource {res.uri} {res.mime_type or ''}, {len(getattr(res, 'blob', '')) * 3 // 4} bytes]"
    return json.dumps(block.model_dump(mode="json", exclude_none=True), ensure_ascii=False)


def format_result(exposed: str, result: types.CallToolResult) -> str:
    """A tool result as text for the model: text blocks, structured JSON, `ERROR:` when `isError`."""
    texts = [t for t in map(_block_text, result.content) if t]
    structured = result.structured_content
    if structured is not None and not any(_echoes(t, structured) for t in texts):
        texts.append(json.dumps(structured, ensure_ascii=False))
    body = "\n".join(texts) or "(no output)"
    return f"ERROR: {exposed} reported an error: {body}" if result.is_error else body


# ── Connections ─────────────────────────────────────────────────────────────────────────────


class ConnectError(Exception):
    """An MCP server could not be started or reached; the message says why."""


class _EofWatch:
    """A transport's read stream that reports when the server side ends (its process exited)."""

    def __init__(self, inner: Any, on_eof: Callable[[], None]):
        self._inner, self._on_eof = inner, on_eof

    @property
    def last_context(self) -> Any:
        return getattr(self._inner, "last_context", None)

    async def receive(self) -> Any:
        try:
            return await self._inner.receive()
        except anyio.EndOfStream:
            self._on_eof()
            raise

    def __aiter__(self) -> _EofWatch:
        return self

    async def __anext__(self) -> Any:
        try:
            return await self.receive()
        except anyio.EndOfStream:
            raise StopAsyncIteration from None

    async def aclose(self) -> None:
        await self._inner.aclose()

    async def __aenter__(self) -> _EofWatch:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


@contextlib.asynccontextmanager
async def _watched(transport: Any, on_eof: Callable[[], None]) -> AsyncIterator[tuple[Any, Any]]:
    async with transport as (read, write):
        yield _EofWatch(read, on_eof), write


class _StderrTap:
    """A pipe for a child's stderr: each line goes to the log, the last ones explain failures."""

    def __init__(self, server: str):
        self.server = server
        read_fd, write_fd = os.pipe()
        self.child_end = os.fdopen(write_fd, "w")
        self._read_end = os.fdopen(read_fd, "rb")
        self.lines: deque[str] = deque(maxlen=STDERR_LINES_KEPT)

    def spawned(self) -> None:
        """Close our copy of the child's end, so the pipe ends when the child does."""
        self.child_end.close()

    async def pump(self) -> None:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), self._read_end)
        try:
            while line := await reader.readline():
                text = line.decode(errors="replace").rstrip()
                if text:
                    self.lines.append(text)
                    logger.info("[mcp %s] %s", self.server, text)
        finally:
            transport.close()

    def close(self) -> None:
        self.child_end.close()
        self._read_end.close()

    def tail(self) -> str:
        return " | ".join(list(self.lines)[-3:])


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for e in exc.exceptions for leaf in _leaves(e)]
    return [exc]


async def _drain(pump: asyncio.Task[None]) -> None:
    """Let the stderr reader take the child's last lines (they explain crashes), then stop it."""
    with anyio.CancelScope(shield=True):  # also when the session is being cancelled
        done, _ = await asyncio.wait([pump], timeout=1)
        if not done:
            pump.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await pump


def _safe_url(url: str) -> str:
    """A URL without userinfo or query (either may hold a secret)."""
    p = urlsplit(url)
    return f"{p.scheme}://{p.hostname}{f':{p.port}' if p.port else ''}{p.path}"


class Connection:
    """One configured MCP server: its live session (owned by a task of its own), tools and status."""

    def __init__(self, name: str, spec: StdioServer | HttpServer, env: dict[str, str], config_dir: Path,
                 on_change: Callable[[Connection], None]):
        self.name, self.spec, self._env, self._config_dir = name, spec, env, config_dir
        self._on_change = on_change
        self.status = "not started"
        self.error: str | None = None
        self.tools: list[types.Tool] = []
        self.protocol: str | None = None
        self.starts = 0
        self.client: Client | None = None
        self._task: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()
        self._scope: anyio.CancelScope | None = None
        self._lock = asyncio.Lock()
        self._http_status: str | None = None
        #: The last session ended because the server could not be reached (so no call got through).
        self._unreachable = False
        #: The HTTP server answered 404 to our session id: it no longer knows the session.
        self._session_gone = False
        self._stderr: _StderrTap | None = None

    # ── describing ──

    def describe(self) -> str:
        """How the server is reached, without secrets."""
        if isinstance(self.spec, StdioServer):
            return f"stdio: {' '.join([self.spec.command, *self.spec.args])}"
        return f"http: {_safe_url(self.spec.url)}"

    def _explain(self, exc: BaseException) -> str:
        reasons = []
        for e in _leaves(exc):
            if isinstance(e, FileNotFoundError):
                reasons.append(f"command not found: {e.filename or getattr(self.spec, 'command', '?')} "
                               "(install it or fix 'command' in mcp-servers.json)")
            elif isinstance(e, ConnectError):
                reasons.append(str(e))
            elif isinstance(e, TimeoutError):
                reasons.append("the server did not answer in time")
            elif isinstance(e, MCPError):
                reasons.append(f"{e.error.message} (MCP error {e.error.code})")
            elif isinstance(e, httpx2.TransportError):
                reasons.append(f"cannot reach {_safe_url(getattr(self.spec, 'url', ''))}: {type(e).__name__}: {e}")
            elif not isinstance(e, asyncio.CancelledError):
                reasons.append(f"{type(e).__name__}: {e}")
        if self._http_status:
            reasons.append(self._http_status)
        if self._stderr and self._stderr.lines:
            reasons.append(f"server stderr: {self._stderr.tail()}")
        return "; ".join(dict.fromkeys(reasons)) or "the connection ended"

    # ── transports ──

    def _env_value(self, var: str, field: str) -> str:
        value = self._env.get(var)
        if not value:
            raise ConnectError(f"environment variable {var} (from '{field}') is not set: add it to .env")
        return value

    async def _transport(self, stack: contextlib.AsyncExitStack) -> Any:
        spec = self.spec
        if isinstance(spec, StdioServer):
            env = {child: self._env_value(src, "env") for child, src in spec.env.items()}
            cwd = self._config_dir / spec.cwd if spec.cwd else self._config_dir
            self._stderr = tap = _StderrTap(self.name)
            stack.callback(tap.close)
            params = StdioServerParameters(command=spec.command, args=spec.args, env=env, cwd=cwd)
            return stdio_client(params, errlog=tap.child_end)
        headers = dict(spec.headers)
        headers.update({h: self._env_value(v, "headers_env") for h, v in spec.headers_env.items()})
        if spec.token_env:
            headers["Authorization"] = f"Bearer {self._env_value(spec.token_env, 'token_env')}"

        async def note_refusal(response: httpx2.Response) -> None:
            if response.status_code == 404 and "mcp-session-id" in response.request.headers:
                self._session_gone = True  # the server forgot our session (it restarted): start a new one
            if self.status != "connecting":  # later 4xx (a 405 for the optional GET stream) explain nothing
                return
            if response.status_code in (401, 403):
                self._http_status = (f"HTTP {response.status_code} from the server: check the token "
                                     "(token_env / headers_env in mcp-servers.json)")
            elif response.status_code >= 400:
                self._http_status = f"HTTP {response.status_code} from {_safe_url(spec.url)}"

        http = await stack.enter_async_context(httpx2.AsyncClient(
            headers=headers, timeout=httpx2.Timeout(30, read=max(300, spec.call_timeout + 30)),
            event_hooks={"response": [note_refusal]},
        ))
        return streamable_http_client(spec.url, http_client=http)

    # ── lifecycle ──

    @property
    def alive(self) -> bool:
        return self.status == "connected" and self.client is not None

    async def connect(self, force: bool = False) -> bool:
        """(Re)start the session and list the tools; on failure record why. Never raises.

        Without `force` a session that is already up (another caller just reconnected) is kept.
        """
        async with self._lock:
            if self.alive and not force:
                return True
            await self._close_session()
            self.status, self.error, self._http_status, self.protocol = "connecting", None, None, None
            self._unreachable = self._session_gone = False
            self.starts += 1
            ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._stop = asyncio.Event()
            self._task = asyncio.create_task(self._run(ready, self._stop), name=f"mcp:{self.name}")
            try:
                await asyncio.wait_for(asyncio.shield(ready), self.spec.connect_timeout)
            except TimeoutError:
                ready.cancel()
                await self._close_session(cancel=True)
                tail = self._stderr.tail() if self._stderr else ""
                self._set("failed", f"no answer within {self.spec.connect_timeout:g} s (connect_timeout)"
                          + (f"; server stderr: {tail}" if tail else ""))
            except ConnectError as exc:
                await self._close_session()
                self._set("failed", str(exc))
            else:
                self._set("connected", None)
            finally:
                # Cancelled while waiting (the caller's turn was replaced): the runner must not report
                # to nobody; the next connect() or close() stops it.
                ready.cancel()
                if not ready.cancelled():
                    ready.exception()  # mark as retrieved
            return self.status == "connected"

    async def close(self) -> None:
        """End the session and stop the child process."""
        async with self._lock:
            await self._close_session()
            self.status = "stopped"

    async def _close_session(self, cancel: bool = False) -> None:
        """Stop the session task: politely (the SDK closes the session, then the process), else by force."""
        task = self._task
        if task is None:
            return
        self._stop.set()
        if not cancel:
            done, _ = await asyncio.wait([task], timeout=CLOSE_GRACE_SECONDS)
            cancel = not done
        if cancel:
            if self._scope is not None:
                self._scope.cancel()
            else:
                task.cancel()
            await asyncio.wait([task], timeout=CLOSE_GRACE_SECONDS)
        self._task, self.client = None, None

    def _set(self, status: str, error: str | None) -> None:
        self.status, self.error = status, error
        if error:
            log = logger.error if status == "failed" else logger.warning
            log("MCP server %s (%s) %s: %s", self.name, self.describe(), status, error)
        else:
            logger.info("MCP server %s (%s) %s, protocol %s, %d tool(s)", self.name, self.describe(), status,
                        self.protocol, len(self.tools))
        self._on_change(self)

    def _lost(self, reason: str) -> None:
        """The session ended by itself: remember why; the next call reconnects."""
        if self.status == "connected" and not self._stop.is_set():
            self._stop.set()
            self._set("disconnected", f"{reason}; it is restarted on the next call")

    async def _run(self, ready: asyncio.Future[None], stop: asyncio.Event) -> None:
        """Own the session: open it, list tools, follow tool-list changes, close it when told to."""
        changed = asyncio.Event()

        async def on_message(message: Any) -> None:
            if isinstance(message, types.ToolListChangedNotification):
                changed.set()
            elif isinstance(message, Exception):
                logger.warning("MCP server %s sent something unreadable: %s", self.name, message)

        self._stderr = None
        client: Client | None = None
        try:
            with anyio.CancelScope() as self._scope:
                async with contextlib.AsyncExitStack() as stack:
                    ended = ("the server process exited" if isinstance(self.spec, StdioServer)
                             else "the server closed the connection")
                    transport = _watched(await self._transport(stack), lambda: self._lost(ended))
                    tap = self._stderr
                    if tap:
                        # Read stderr from the start: a child that fills the pipe during the handshake blocks.
                        pump = asyncio.create_task(tap.pump(), name=f"mcp-stderr:{self.name}")
                        stack.push_async_callback(_drain, pump)  # after the child has stopped (LIFO)
                    client = Client(transport, mode=self.spec.protocol, message_handler=on_message, cache=None,
                                    read_timeout_seconds=self.spec.connect_timeout,
                                    client_info=types.Implementation(name="agent-mcp", version="0.1.0"))
                    try:
                        await stack.enter_async_context(client)
                    finally:
                        if tap:
                            tap.spawned()
                    self.tools = await self._list_tools(client)
                    self.client, self.protocol = client, client.protocol_version
                    async with anyio.create_task_group() as tg:
                        caps = client.server_capabilities.tools
                        if client.protocol_version in MODERN_PROTOCOL_VERSIONS and caps and caps.list_changed:
                            # 2026-07-28 servers announce changes only on a subscriptions/listen stream.
                            tg.start_soon(self._listen, client, changed)
                        tg.start_soon(self._follow_changes, client, changed)
                        if not ready.done():  # cancelled when connect() gave up waiting
                            ready.set_result(None)
                        await stop.wait()
                        tg.cancel_scope.cancel()
        except Exception as exc:
            self._unreachable = any(isinstance(e, httpx2.ConnectError) for e in _leaves(exc))
            reason = self._explain(exc)
            if not ready.done():
                ready.set_exception(ConnectError(reason))
            else:
                self._lost(reason)
        finally:
            if client is not None and self.client is client:
                self.client = None
            if not ready.done():
                ready.set_exception(ConnectError(self._explain(ConnectError("stopped before it was ready"))))

    async def _list_tools(self, client: Client) -> list[types.Tool]:
        tools: list[types.Tool] = []
        cursor: str | None = None
        for _ in range(100):  # a server that pages forever must not hang start-up
            page = await client.list_tools(cursor=cursor)
            tools += page.tools
            cursor = page.next_cursor
            if cursor is None:
                break
        return tools

    async def _follow_changes(self, client: Client, changed: asyncio.Event) -> None:
        """Re-list the tools whenever the server says they changed (either protocol era)."""
        while True:
            await changed.wait()
            changed.clear()
            try:
                self.tools = await self._list_tools(client)
            except Exception as exc:
                logger.warning("MCP server %s: cannot re-list tools: %s", self.name, self._explain(exc))
                continue
            logger.info("MCP server %s: tool list changed, now %d tool(s)", self.name, len(self.tools))
            self._on_change(self)

    async def _listen(self, client: Client, changed: asyncio.Event) -> None:
        """Keep a `subscriptions/listen` stream open for tool-list changes (2026-07-28 servers)."""
        while True:
            try:
                async with client.listen(tools_list_changed=True) as subscription:
                    async for _event in subscription:
                        changed.set()
                return  # the server ended the stream on purpose
            except SubscriptionLost:
                changed.set()  # a change may have been missed: re-list, then listen again
                await anyio.sleep(1)
            except Exception as exc:
                logger.info("MCP server %s: no tool-list subscription (%s)", self.name, self._explain(exc))
                return

    # ── calls ──

    async def call(self, exposed: str, tool: str, arguments: dict[str, Any]) -> str:
        """Call one tool; every failure becomes a readable `ERROR:` result."""
        for attempt in (1, 2):
            if not await self.connect():
                return (f"ERROR: MCP server '{self.name}' is not available: {self.error}. "
                        "Tell the user; `!mcp` shows the servers' status.")
            client = self.client
            assert client is not None
            try:
                result = await client.call_tool(tool, arguments, read_timeout_seconds=self.spec.call_timeout)
            except (anyio.ClosedResourceError, anyio.BrokenResourceError) as exc:
                result = MCPError(types.CONNECTION_CLOSED, f"{type(exc).__name__}")
            except MCPError as exc:
                result = exc
            if not isinstance(result, MCPError):
                return format_result(exposed, result)
            code, message = result.error.code, result.error.message
            if self._session_gone and attempt == 1:
                # HTTP 404 for our session id: the server restarted and never saw this call.
                self._lost("the server no longer knows the session")
                continue
            if code == types.CONNECTION_CLOSED:
                if self._task is not None:  # let the ending session record why it ended
                    await asyncio.wait([self._task], timeout=3)
                self._lost("the connection was lost during a call")
                if self._unreachable:
                    return f"ERROR: MCP server '{self.name}' cannot be reached, so {exposed} did not run: {self.error}"
                return (f"ERROR: the connection to MCP server '{self.name}' was lost while {exposed} ran; "
                        "it may or may not have completed. The server is restarted on the next call.")
            if code == types.REQUEST_TIMEOUT:
                return f"ERROR: {exposed}: no answer from MCP server '{self.name}' within {self.spec.call_timeout:g} s."
            return f"ERROR: {exposed} failed: {message} (MCP error {code})"
        return f"ERROR: MCP server '{self.name}' keeps ending the session; `!mcp` shows its status."


# ── The plugin ──────────────────────────────────────────────────────────────────────────────


class McpClientPlugin(BasePlugin):
    """Tools of the MCP servers in mcp-servers.json, with `!mcp` to see them."""

    PLUGIN_NAME = "plugin_mcp_client"
    PLUGIN_VERSION = "1.0.0"
    PLUGIN_TYPE = "data_tool"
    DESCRIPTION = "Tools of external MCP servers (stdio, Streamable HTTP) listed in mcp-servers.json"
    DEPENDENCIES = ["mcp", "httpx2", "jsonschema"]

    def __init__(self) -> None:
        super().__init__()
        self.servers: dict[str, Connection] = {}
        self.config_file: Path | None = None
        #: exposed tool name → (server, MCP tool name), as of the last registration.
        self._routes: dict[str, tuple[str, str]] = {}
        self._skipped: dict[str, str] = {}
        #: Set, then replaced, whenever a server's status or tools change: await it to follow them.
        self.changed = asyncio.Event()

    async def init(self, config: dict[str, Any]) -> bool:
        assert self.runtime is not None
        parse_settings(self.PLUGIN_NAME, PluginSettings, config)  # no settings but `enabled` (servers: mcp-servers.json)
        app = self.runtime.config
        self.config_file = app.path(MCP_SERVERS_FILE)
        servers = load_servers(self.config_file)
        for name, spec in servers.servers.items():
            if spec.enabled:
                self.servers[name] = Connection(name, spec, app.env, app.config_dir, self._server_changed)
        await asyncio.gather(*(c.connect() for c in self.servers.values()))
        return True

    async def shutdown(self) -> None:
        await asyncio.gather(*(c.close() for c in self.servers.values()))

    # ── tools ──

    def _tool(self, conn: Connection, tool: types.Tool, exposed: str) -> McpTool:
        async def run(**arguments: Any) -> str:
            return await conn.call(exposed, tool.name, arguments)

        description = (tool.description or tool.title or f"Tool '{tool.name}'").strip()
        return McpTool(
            name=exposed,
            description=f"{description}\n(MCP server '{conn.name}')",
            args_schema=_args_model(exposed, tool.input_schema),
            coroutine=run,
            mcp_schema=_llm_schema(tool.input_schema),
            metadata={"mcp_server": conn.name, "mcp_tool": tool.name},
        )

    def _collect(self) -> tuple[list[McpTool], dict[str, dict[str, Any]]]:
        """Every server's tools and their gates; a name already taken is skipped and remembered."""
        assert self.runtime is not None
        registry = self.runtime.tools
        tools: list[McpTool] = []
        gates: dict[str, dict[str, Any]] = {}
        routes: dict[str, tuple[str, str]] = {}
        skipped: dict[str, str] = {}
        for conn in self.servers.values():
            for tool in conn.tools:
                exposed = exposed_name(conn.name, tool.name)
                other = registry.entry(exposed)
                if exposed in routes:
                    skipped[f"{conn.name}/{tool.name}"] = f"{exposed} is taken by MCP server '{routes[exposed][0]}'"
                    continue
                if other is not None and other.owner != self.PLUGIN_NAME:
                    skipped[f"{conn.name}/{tool.name}"] = f"{exposed} is taken by {other.owner}"
                    continue
                routes[exposed] = (conn.name, tool.name)
                tools.append(self._tool(conn, tool, exposed))
                read_only = bool(tool.annotations and tool.annotations.read_only_hint)
                gates[exposed] = {"type": GATE_TYPE, "operation": "read" if conn.spec.trusted and read_only else "write"}
        for key in skipped.keys() - self._skipped.keys():
            logger.warning("MCP tool %s skipped: %s", key, skipped[key])
        self._routes, self._skipped = routes, skipped
        return tools, gates

    def get_tools(self) -> dict[str, Any]:
        return {"lc": self._collect()[0]}

    def get_gate_tools(self) -> dict[str, Any]:
        return self._collect()[1]

    def _server_changed(self, conn: Connection) -> None:
        """A server connected, failed, died or changed its tools: update /health and the registry."""
        assert self.runtime is not None
        report = self.runtime.plugins.reports.get(self.PLUGIN_NAME) if self.runtime.plugins else None
        if report is not None:
            report.reasons = [f"MCP server '{c.name}' {c.status}: {c.error}"
                              for c in self.servers.values() if c.error and c.status != "connected"]
        if self.enabled and conn.status == "connected":  # registered: keep the registry in step
            tools, gates = self._collect()
            try:
                self.runtime.tools.replace_plugin_tools(self.PLUGIN_NAME, {"lc": tools}, gates)
            except Exception:
                logger.exception("MCP server %s: its new tool list could not be registered", conn.name)
        self.changed.set()
        self.changed = asyncio.Event()

    # ── commands ──

    def get_commands(self) -> dict[str, Any]:
        return {"mcp": self.cmd_mcp}

    def get_help(self) -> str:
        return ("MCP servers (plugin_mcp_client):\n"
                "  !mcp                        list MCP servers, their status and tools\n"
                "  !mcp reconnect <server>     restart one server's connection")

    async def cmd_mcp(self, args: str) -> str:
        """!mcp [reconnect <server>] — the MCP servers, their status and their tools."""
        words = args.split()
        if words and words[0] == "reconnect":
            if len(words) != 2 or words[1] not in self.servers:
                return f"Use: !mcp reconnect <server>  (servers: {', '.join(self.servers) or 'none'})"
            conn = self.servers[words[1]]
            ok = await conn.connect(force=True)
            return (f"MCP server '{conn.name}' reconnected: {len(conn.tools)} tool(s)." if ok
                    else f"MCP server '{conn.name}' failed: {conn.error}")
        if words:
            return "Use: !mcp  or  !mcp reconnect <server>"
        return self._status_text()

    def _status_text(self) -> str:
        if not self.servers:
            return f"No MCP servers configured (add them to {self.config_file})."
        lines = [f"MCP servers ({self.config_file}):"]
        by_server: dict[str, list[str]] = {}
        for exposed, (server, _) in self._routes.items():
            by_server.setdefault(server, []).append(exposed)
        assert self.runtime is not None
        for conn in self.servers.values():
            flags = ", ".join(filter(None, [f"protocol {conn.protocol}" if conn.protocol else "",
                                            "trusted" if conn.spec.trusted else ""]))
            lines.append(f"  {conn.name} [{conn.status}] {conn.describe()}" + (f" ({flags})" if flags else ""))
            if conn.error:
                lines.append(f"    why: {conn.error}")
            for exposed in by_server.get(conn.name, []):
                entry = self.runtime.tools.entry(exposed)
                op = entry.gate.get("operation", "?") if entry else "not registered"
                desc = entry.tool.description.splitlines()[0] if entry and entry.tool.description else ""
                lines.append(f"    {exposed:<30} {op:<6} {desc}")
            for key, why in self._skipped.items():
                if key.startswith(f"{conn.name}/"):
                    lines.append(f"    (skipped {key.partition('/')[2]}: {why})")
        return "\n".join(lines) + "\n"
