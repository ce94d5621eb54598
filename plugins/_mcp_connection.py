"""One connection to an MCP server (stdio child process or streamable HTTP): connecting, listing and
calling tools, reconnecting, closing."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import anyio
import httpx2
import mcp_types as types
from mcp import Client, StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp.client.subscriptions import SubscriptionLost
from mcp.shared.exceptions import MCPError
from mcp_types.version import MODERN_PROTOCOL_VERSIONS

import plugin_api
from plugin_api import ToolError
from plugins._mcp_fence import FenceError, Host, fenced
from plugins._mcp_launch import PREFIX as FENCE_PREFIX
from plugins._mcp_servers import (
    ARG_REFERENCE,
    HttpServer,
    MissingVariable,
    StdioServer,
    expand_arguments,
    format_result,
    shown_arguments,
)

logger = logging.getLogger("agent_mcp.mcp_client")
STDERR_LINES_KEPT = 20
CLOSE_GRACE_SECONDS = 10


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

    def __init__(self, server: str, secrets: list[str]):
        self.server = server
        #: Values the child was given (from .env): masked if it prints them.
        self._secrets = sorted({s for s in secrets if len(s) >= 4}, key=len, reverse=True)
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
                for secret in self._secrets:
                    text = text.replace(secret, "***")
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

    def fence_note(self) -> str:
        """What the launcher said about how the server ended (a signal, a limit), or ""."""
        return next((line for line in reversed(self.lines) if line.startswith(FENCE_PREFIX)), "")


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


#: async (connection, exposed tool name, the calling turn or None, params) → the result sent to the server.
Elicit = Callable[["Connection", str, "plugin_api.Turn | None", types.ElicitRequestParams],
                  Awaitable[types.ElicitResult]]


class Connection:
    """One configured MCP server: its live session (owned by a task of its own), tools and status."""

    def __init__(self, name: str, spec: StdioServer | HttpServer, env: dict[str, str], config_dir: Path,
                 on_change: Callable[[Connection], None], on_elicit: Elicit | None = None,
                 sandbox: Host | None = None):
        self.name, self.spec, self._env, self._config_dir = name, spec, env, config_dir
        #: The agent's dirs and the bubblewrap found at start (None: no sandbox was looked for).
        self._host = sandbox or Host(config_dir, config_dir / "data", None, "no sandbox was looked for")
        #: How the running (or last) stdio server is fenced, for the log and `!mcp`.
        self.fence: str | None = None
        self._on_change = on_change
        #: Asks the human of a calling turn an elicitation of the server (None: every one is declined).
        self._on_elicit = on_elicit
        #: Calls in flight: a number each → (the exposed tool, the turn that called it).
        self._calls: dict[int, tuple[str, plugin_api.Turn | None]] = {}
        self._call_seq = 0
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
            return f"stdio: {' '.join([self.spec.command, *shown_arguments(self.spec.args)])}"
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

    def _command_path(self, command: str, cwd: Path) -> str:
        """The server's executable as a path (looked up as the child would: PATH, or relative to its cwd)."""
        if os.sep in command:
            path = Path(command) if os.path.isabs(command) else cwd / command
            found = str(path) if os.access(path, os.X_OK) and path.is_file() else None
        else:
            found = shutil.which(command, path=os.environ.get("PATH"))
        if found is None:
            raise ConnectError(f"command not found: {command} (install it or fix 'command' in mcp-servers.json)")
        return os.path.abspath(found)

    async def _transport(self, stack: contextlib.AsyncExitStack) -> Any:
        spec = self.spec
        if isinstance(spec, StdioServer):
            env = {child: self._env_value(src, "env") for child, src in spec.env.items()}
            try:
                args = expand_arguments(spec.args, self._env)
            except MissingVariable as exc:
                raise ConnectError(f"environment variable {exc.name} (from 'args') is not set: add it to .env") \
                    from None
            cwd = (self._config_dir / spec.cwd) if spec.cwd else self._config_dir
            try:
                launch = fenced(self.name, spec, self._command_path(spec.command, cwd), args, list(env), self._host)
            except FenceError as exc:
                raise ConnectError(str(exc)) from None
            self.fence = launch.summary
            referenced = [self._env[n] for a in spec.args for n in ARG_REFERENCE.findall(a)]
            self._stderr = tap = _StderrTap(self.name, [*env.values(), *referenced])
            stack.callback(tap.close)
            params = StdioServerParameters(command=launch.command, args=launch.args, env=env, cwd=launch.cwd)
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
            logger.info("MCP server %s (%s) %s, protocol %s, %d tool(s)%s", self.name, self.describe(), status,
                        self.protocol, len(self.tools), f"; {self.fence}" if self.fence else "")
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
                                    client_info=types.Implementation(name="agent-mcp", version="0.1.0"),
                                    elicitation_callback=self._elicited)
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
            # The child has stopped and its stderr is read to the end: say which limit stopped it, if one did.
            if self.status == "disconnected" and self._stderr and (note := self._stderr.fence_note()):
                self.error = f"{self.error}; {note}"
                self._on_change(self)
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

    def _caller(self) -> tuple[str, plugin_api.Turn | None]:
        """The call an elicitation belongs to: the current turn's (when the SDK runs the callback in the
        caller's context), else the only session with calls in flight; ("", None) when it is ambiguous."""
        turn = plugin_api.current_turn()
        mine = [c for c in self._calls.values() if turn is not None and c[1] is turn]
        if mine:
            return mine[0]
        sessions = {c[1].client_id if c[1] else None for c in self._calls.values()}
        if len(sessions) == 1 and None not in sessions:
            return next(iter(self._calls.values()))
        return "", None

    async def _elicited(self, context: Any, params: types.ElicitRequestParams) -> types.ElicitResult | types.ErrorData:
        exposed, turn = self._caller()
        if self._on_elicit is None:
            return types.ElicitResult(action="decline")
        try:
            return await self._on_elicit(self, exposed, turn, params)
        except Exception:  # never leave the server's tool waiting on our failure
            logger.exception("MCP server %s: asking its elicitation failed; declined", self.name)
            return types.ElicitResult(action="decline")

    async def call(self, exposed: str, tool: str, arguments: dict[str, Any]) -> str:
        """Call one tool; every failure raises ToolError with a readable message."""
        for attempt in (1, 2):
            if not await self.connect():
                raise ToolError(f"MCP server '{self.name}' is not available: {self.error}. "
                                "Tell the user; `!mcp` shows the servers' status.")
            client = self.client
            assert client is not None
            self._call_seq += 1
            key = self._call_seq
            self._calls[key] = (exposed, plugin_api.current_turn())
            result: types.CallToolResult | MCPError
            try:
                result = await client.call_tool(tool, arguments, read_timeout_seconds=self.spec.call_timeout)
            except (anyio.ClosedResourceError, anyio.BrokenResourceError) as exc:
                result = MCPError(types.CONNECTION_CLOSED, f"{type(exc).__name__}")
            except MCPError as exc:
                result = exc
            finally:
                self._calls.pop(key, None)
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
                    raise ToolError(f"MCP server '{self.name}' cannot be reached, so {exposed} did not run: "
                                    f"{self.error}")
                note = self._stderr.fence_note() if self._stderr else ""
                raise ToolError(f"the connection to MCP server '{self.name}' was lost while {exposed} ran"
                                + (f" ({note})" if note else "")
                                + "; it may or may not have completed. The server is restarted on the next call.")
            if code == types.REQUEST_TIMEOUT:
                raise ToolError(f"{exposed}: no answer from MCP server '{self.name}' within "
                                f"{self.spec.call_timeout:g} s.")
            raise ToolError(f"{exposed} failed: {message} (MCP error {code})")
        raise ToolError(f"MCP server '{self.name}' keeps ending the session; `!mcp` shows its status.")
