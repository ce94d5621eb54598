"""The client side of agent-mcp's shell endpoint: HTTP requests and one self-healing SSE stream.

No terminal here: shell.py draws what this module receives, and tests drive it directly.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import httpx
from httpx_sse import EventSource
from tenacity import AsyncRetrying, retry_if_exception, wait_exponential

import guard
from api_client import AgentEvent, error_message, send_retrying, sse_events
from config import CODE_DIR
from decisions import DECISIONS

DEFAULT_URL = "http://127.0.0.1:8765"
DEFAULT_PORT = 8765
SESSION_FILE = ".aiops_session_id"
TOKEN_HINT = "pass --token or set AGENT_SHELL_TOKEN"


def approval_gate(data: Mapping[str, Any], now: float) -> dict[str, Any]:
    """A feed `approval` event (approvals.RoutedGate) as the gate dict the shell's panel shows (`routed`: True)."""
    args = given if isinstance(given := data.get("args"), dict) else {}
    shape = data.get("summary") if data.get("tables") else None
    return {"gate_id": data.get("gate_id"), "tool_name": data.get("tool"), "tables": data.get("tables") or [],
            "tool_args": {**args, "operation_type": data.get("op")}, "grants": data.get("scopes") or [],
            "timeout_seconds": max(0.1, float(data.get("deadline") or 0) - now), "routed": True,
            "session": data.get("session"), "client_label": data.get("client_label"),
            **({"shape": shape} if shape else {})}


# --------------------------------------------------------------------------- errors


class ShellError(Exception):
    """Base class of every error this module raises on purpose."""


class ServerOffline(ShellError):
    """The server could not be reached (refused, reset or timed out); try again later."""


class AuthRequired(ShellError):
    """The server answered 401/403: start the shell with --token or set AGENT_SHELL_TOKEN."""


class RequestRejected(ShellError):
    """The server refused a request; ``status`` is the HTTP status, ``message`` its ``error`` text."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message


class SessionNotFound(ShellError):
    """No session matches the id given to attach(); `!session` lists the sessions the server has."""


# --------------------------------------------------------------------------- session file


def save_client_id(path: Path, client_id: str) -> None:
    """Write ``client_id`` to the session file ``path``."""
    Path(path).write_text(client_id + "\n", encoding="utf-8")


def load_or_create_client_id(path: Path) -> str:
    """Return the client id stored in ``path``; if it is missing or empty, save a new uuid4 and return it."""
    try:
        client_id = Path(path).read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        client_id = ""
    if not client_id:
        client_id = str(uuid.uuid4())
        save_client_id(path, client_id)
    return client_id


# --------------------------------------------------------------------------- token


def default_token_file(env: Mapping[str, str]) -> Path:
    """Where a server started from this checkout keeps its generated token: `$AGENT_DATA_DIR/shell-token`."""
    return Path(env.get("AGENT_DATA_DIR") or CODE_DIR / "data") / guard.SHELL_TOKEN_FILE


def find_token(token: str | None, env: Mapping[str, str], token_file: Path | None = None
               ) -> tuple[str | None, str | None]:
    """(the token to send, what to tell the user on a 401): `token`, else AGENT_SHELL_TOKEN, else the token file."""
    token = token or env.get("AGENT_SHELL_TOKEN") or None
    if token is not None:
        return token, None
    path = token_file or default_token_file(env)
    try:
        return guard.read_token_file(path), (f"the token was read from {path}; if the server keeps its data "
                                             "elsewhere, pass --token-file or set AGENT_DATA_DIR")
    except guard.TokenFileError as exc:
        return None, str(exc)


# --------------------------------------------------------------------------- SSE


#: One event of a session's stream: ``name`` is tok|status|gate|done|error, ``data`` its JSON object
#: (the same events as the JSON/SSE API's, so one decoder serves both clients).
ShellEvent = AgentEvent


# --------------------------------------------------------------------------- client

_CLOSED = object()


class _StreamDown(Exception):
    """The event stream ended; `was_up`: it had connected before it did."""

    def __init__(self, was_up: bool):
        super().__init__("the event stream is down")
        self.was_up = was_up


def _describe(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


class ShellClient:
    """Async client of the shell endpoint: plain requests plus one self-healing SSE stream.

    ::

        async with ShellClient("http://127.0.0.1:8765", session_file=Path(".aiops_session_id")) as c:
            await c.connect()            # open the stream first, so no event of the turn is missed
            await c.submit("hello")
            async for ev in c.events():  # ShellEvent(name="tok"|"status"|"gate"|"done"|"error", ...)
                if ev.name == "done":
                    break

    ``token`` is the bearer token to send; ``auth_hint`` is added to every AuthRequired message (where
    the token came from, or why there is none: see find_token()).

    The stream reconnects by itself after a drop, sending ``Last-Event-ID`` so the server replays
    what was missed. ``state`` is "idle", "connected", "reconnecting", "offline" or "unauthorized";
    ``on_state(state, detail)`` is called on every change. ``events()`` is meant for one consumer.
    """

    def __init__(
        self,
        base_url: str = DEFAULT_URL,
        client_id: str | None = None,
        *,
        session_file: Path | str | None = None,
        token: str | None = None,
        auth_hint: str | None = None,
        timeout: float = 10.0,
        read_timeout: float = 120.0,
        retry_initial: float = 0.5,
        retry_max: float = 10.0,
        on_state: Callable[[str, str], None] | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.session_file = Path(session_file) if session_file else None
        if client_id is None:
            client_id = (
                load_or_create_client_id(self.session_file) if self.session_file else str(uuid.uuid4())
            )
        self._client_id = client_id
        self._has_token = bool(token)
        self._auth_hint = auth_hint
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.AsyncClient(
            base_url=self.base_url, headers=headers, timeout=timeout, transport=transport
        )
        self._timeout = timeout
        # No keepalive for read_timeout seconds means a dead connection: reconnect, losing nothing.
        self._stream_timeout = httpx.Timeout(timeout, read=read_timeout)
        self._retry_initial = retry_initial
        self._retry_max = retry_max
        self.on_state = on_state
        self.state = "idle"
        self.last_event_id: int | None = None
        self._queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        self._generation = 0
        self._pump: asyncio.Task[None] | None = None
        self._connected = asyncio.Event()
        self._fatal: AuthRequired | None = None
        self._closed = False
        #: This window's identity as an approver of other sessions' gates (`!approver on`).
        self.window_id = f"w-{uuid.uuid4().hex[:8]}"

    def __repr__(self) -> str:  # never shows the token
        return f"ShellClient({self.base_url!r}, client_id={self._client_id!r})"

    async def __aenter__(self) -> ShellClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    @property
    def client_id(self) -> str:
        """The session this client submits to and streams from."""
        return self._client_id

    # ---- requests

    async def health(self) -> dict[str, Any]:
        """GET /health: ``{"status", "models", "default_model"}``."""
        answer: dict[str, Any] = await self._request("GET", "/health")
        return answer

    async def sessions(self, client_id: str | None = None) -> list[dict[str, Any]]:
        """GET /sessions, filtered by a full client id or a shorthand such as "101"."""
        params = {"client_id": str(client_id)} if client_id is not None else None
        body = await self._request("GET", "/sessions", params=params)
        return list(body.get("sessions", [])) if isinstance(body, dict) else []

    async def submit(self, text: str, default_model: str | None = None) -> dict[str, Any]:
        """POST /submit: start a turn (or a server command); its output arrives on events()."""
        payload: dict[str, Any] = {"client_id": self._client_id, "text": text}
        if default_model:
            payload["default_model"] = default_model
        answer: dict[str, Any] = await self._request("POST", "/submit", json=payload, again=True)
        return answer

    async def stop(self) -> bool:
        """POST /stop: cancel this session's running turn (it ends with `[stopped]` and `done`); whether one ran."""
        body = await self._request("POST", "/stop", json={"client_id": self._client_id})
        return isinstance(body, dict) and body.get("cancelled") is True

    async def gate_response(self, gate_id: str, decision: str, minutes: int | None = None,
                            as_approver: bool = False, content: dict[str, Any] | None = None) -> dict[str, Any]:
        """POST /gate_response: allow (once), allow_for (`minutes`), allow_session, allow_pattern or reject;
        `as_approver`: a gate of another session routed to this window (`set_approver`); `content`: the values
        an MCP server's elicitation asks for (with allow)."""
        if decision not in DECISIONS:
            raise ValueError(f"decision must be one of {', '.join(DECISIONS)}, not {decision!r}")
        body: dict[str, Any] = {"gate_id": gate_id, "decision": decision}
        if minutes is not None:
            body["minutes"] = minutes
        if as_approver:
            body["approver"] = self.window_id
        if content is not None:
            body["content"] = content
        answer: dict[str, Any] = await self._request("POST", "/gate_response", json=body, again=True)
        return answer

    async def set_approver(self, on: bool) -> dict[str, Any]:
        """POST /approver: this window answers (or stops answering) gates routed to shell approvers."""
        answer: dict[str, Any] = await self._request("POST", "/approver", json={"window": self.window_id, "on": on},
                                                     again=True)
        return answer

    async def approvals(self) -> AsyncGenerator[ShellEvent, None]:
        """The approver feed while this window is an approver: `approval` (a routed gate, see approvals.RoutedGate)
        and `approval_closed` events; after a drop it opts in again and reconnects (the open gates come again)."""
        while not self._closed:
            try:
                async with self._http.stream("GET", "/approvals", params={"window": self.window_id},
                                             headers={"Accept": "text/event-stream"},
                                             timeout=self._stream_timeout) as response:
                    if response.status_code in (401, 403):
                        raise AuthRequired(self._auth_message())
                    if response.status_code != 200:
                        await response.aread()
                        raise RequestRejected(response.status_code, error_message(response)[:200])
                    async for event in sse_events(EventSource(response)):
                        yield event
            except httpx.TransportError:
                pass
            await asyncio.sleep(self._retry_initial)
            try:
                await self.set_approver(True)
            except ServerOffline:
                continue

    async def attach(self, session_id: str) -> dict[str, Any]:
        """Switch to an existing session (full id or shorthand) at once; return its /sessions entry.

        Writes the session file and moves a running events() iterator to the new session's stream
        before returning (waiting up to ``timeout`` for it to open). Raises SessionNotFound.
        """
        found = await self.sessions(str(session_id))
        if not found:
            raise SessionNotFound(f"no session {session_id!r} on the server: `!session` lists them")
        info = found[0]
        await self._switch(str(info["client_id"]))
        return info

    async def new_session(self) -> str:
        """Switch to a fresh uuid4 client id (saved like attach()) and return it."""
        client_id = str(uuid.uuid4())
        await self._switch(client_id)
        return client_id

    async def _request(self, method: str, path: str, again: bool = False, **kwargs: Any) -> Any:
        """One request; with `again`, sent again while nothing took it (api_client.send_retrying): what the
        user asked goes through a restart behind a load balancer (the shell says when the server is away)."""
        def send() -> Awaitable[httpx.Response]:
            return self._http.request(method, path, **kwargs)

        try:
            response = await (send_retrying(send) if again else send())
        except httpx.TransportError as exc:
            raise ServerOffline(f"server offline ({self.base_url}): {_describe(exc)}") from exc
        if response.status_code in (401, 403):
            raise AuthRequired(self._auth_message())
        if response.status_code >= 400:
            raise RequestRejected(response.status_code, error_message(response)[:200])
        try:
            return response.json()
        except ValueError:
            return None

    def _auth_message(self) -> str:
        if self._has_token:
            message = f"the server at {self.base_url} rejected the token: check --token / AGENT_SHELL_TOKEN"
        else:
            message = f"the server at {self.base_url} requires a token: {TOKEN_HINT}"
        return f"{message} ({self._auth_hint})" if self._auth_hint else message

    # ---- stream

    async def connect(self, max_wait: float | None = None) -> bool:
        """Open the event stream if needed and wait until it is open; False if ``max_wait`` seconds passed first."""
        self._ensure_stream()
        return await self._wait_connected(max_wait)

    async def events(self) -> AsyncGenerator[ShellEvent, None]:
        """Yield the current session's events in order until aclose(); raises AuthRequired.

        Survives drops (reconnecting with Last-Event-ID) and attach() (switching streams at once;
        events of the old session still queued are dropped).
        """
        self._ensure_stream()
        while True:
            generation, item = await self._queue.get()
            if item is _CLOSED:
                return
            if isinstance(item, BaseException):
                raise item
            if generation == self._generation:
                yield item

    async def aclose(self) -> None:
        """Stop the stream, end events() and close the HTTP client."""
        self._closed = True
        await self._stop_pump()
        self._queue.put_nowait((self._generation, _CLOSED))
        self._set_state(self._generation, "idle", "closed")
        await self._http.aclose()

    def _ensure_stream(self) -> None:
        if self._closed:
            raise ShellError("this ShellClient is closed")
        if self._pump is None or self._pump.done():
            self._fatal = None
            self._pump = asyncio.create_task(self._run_stream(self._generation))

    async def _stop_pump(self) -> None:
        pump, self._pump = self._pump, None
        if pump is not None:
            pump.cancel()
            await asyncio.wait([pump])

    async def _switch(self, client_id: str) -> None:
        if self.session_file:
            save_client_id(self.session_file, client_id)
        if client_id == self._client_id:
            return
        self._client_id = client_id
        self.last_event_id = None
        self._generation += 1
        self._connected.clear()
        if self._pump is not None:
            await self._stop_pump()
            self._ensure_stream()
            await self._wait_connected(self._timeout)

    async def _wait_connected(self, max_wait: float | None) -> bool:
        assert self._pump is not None
        waiter = asyncio.create_task(self._connected.wait())
        try:
            await asyncio.wait({waiter, self._pump}, timeout=max_wait, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
        if self._fatal is not None:
            raise self._fatal
        return self._connected.is_set()

    def _set_state(self, generation: int, state: str, detail: str = "") -> None:
        if generation != self._generation or state == self.state:
            return
        self.state = state
        if self.on_state is not None:
            self.on_state(state, detail)

    async def _run_stream(self, generation: int) -> None:
        """Follow the stream for ever: back off exponentially while the server is away, and start
        again from the shortest delay after every drop of a stream that was up."""
        while True:
            try:
                async for attempt in AsyncRetrying(
                    wait=wait_exponential(multiplier=self._retry_initial, max=self._retry_max),
                    retry=retry_if_exception(lambda exc: isinstance(exc, _StreamDown) and not exc.was_up),
                    reraise=True,
                ):
                    with attempt:
                        await self._stream_attempt(generation)
            except AuthRequired as exc:
                self._fatal = exc
                self._set_state(generation, "unauthorized", str(exc))
                self._queue.put_nowait((generation, exc))
                return
            except _StreamDown:
                await asyncio.sleep(self._retry_initial)

    async def _stream_attempt(self, generation: int) -> None:
        """One connection to /stream; always ends in _StreamDown (or AuthRequired)."""
        try:
            await self._stream_once(generation)
            detail = "the server closed the stream"
        except (httpx.TransportError, RequestRejected) as exc:
            detail = _describe(exc)
        was_up = self._connected.is_set()
        if was_up:
            self._connected.clear()
        self._set_state(generation, "reconnecting" if was_up else "offline", detail)
        raise _StreamDown(was_up)

    async def _stream_once(self, generation: int) -> None:
        headers = {"Accept": "text/event-stream", "Cache-Control": "no-cache"}
        if self.last_event_id is not None:
            headers["Last-Event-ID"] = str(self.last_event_id)
        params = {"client_id": self._client_id}
        async with self._http.stream(
            "GET", "/stream", params=params, headers=headers, timeout=self._stream_timeout
        ) as response:
            if response.status_code in (401, 403):
                raise AuthRequired(self._auth_message())
            if response.status_code != 200:
                await response.aread()
                raise RequestRejected(response.status_code, error_message(response)[:200] or "stream refused")
            self._connected.set()
            self._set_state(generation, "connected")
            async for event in sse_events(EventSource(response)):
                if event.id is not None:
                    self.last_event_id = event.id
                self._queue.put_nowait((generation, event))
