"""AgentClient: use an agent-mcp server from Python programs (and from other agents) over its JSON/SSE API.

::

    client = AgentClient("http://127.0.0.1:8767", auto_approve_gates={"db_query": True})
    answer = await client.send("How many users signed up today?")   # the whole answer of the turn
    async for text in client.stream("Write a haiku"):                 # the answer as it is produced
        print(text, end="", flush=True)

    with SyncAgentClient("http://127.0.0.1:8767") as client:         # for plain scripts
        print(client.send("hello"))

Each message is one turn of the session `client_id`: the client submits it, then follows that
turn's own events (`GET /api/v1/stream/{id}?turn_id=…`, resuming with `Last-Event-ID` after a
dropped connection) until the turn's end, answering gates at once by its policy.

The API always needs its key: `api_key`, else `API_KEY`, else the file the server generated,
`$AGENT_DATA_DIR/api-key` (default `data/api-key` of this checkout; mode 0600, read the way
shell.py reads its token, by `guard.read_token_file`). It needs this file, `guard.py`, `httpx`
and `httpx-sse`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import ssl
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from httpx_sse import EventSource, SSEError, aconnect_sse
from httpx_sse import ServerSentEvent as _RawEvent
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception,
    retry_if_exception_type,
    retry_if_result,
    stop_after_attempt,
    stop_after_delay,
    wait_exponential,
)

import guard
from config import CODE_DIR

#: How a client answers the gates of its turns: None rejects every gate at once, True approves every
#: one, a mapping decides by tool name first and then by operation type ("read" / "write"; database
#: gates also "ddl", which a "write" entry does not cover); a gate found in neither is rejected.
GatePolicy = bool | Mapping[str, bool] | None

REQUEST_TIMEOUT = 10.0
#: No byte (the server sends a keepalive every 15 s) for this long means a dead connection: reconnect.
STREAM_READ_TIMEOUT = 60.0
RECONNECTS = 5
#: Back-off between those tries: 0.4, 0.8, 1.6, then 3 s.
RECONNECT_WAIT = wait_exponential(multiplier=0.4, max=3)
#: Answers that say nothing took the request, so it may be sent again: 502 (a load balancer found no
#: instance to take it, e.g. during a restart) and 503 (the server cannot take requests for a moment).
#: Not 504: the request may be running.
RETRY_STATUSES = (502, 503)
#: How long a request is sent again while it gets those answers or its connection is refused.
RETRY_SECONDS = 8.0


class AgentClientError(RuntimeError):
    """Base of every error AgentClient raises."""


class AgentConnectionError(AgentClientError):
    """The server cannot be reached, or the stream kept breaking; check the URL and that it runs."""


class AgentAuthError(AgentClientError):
    """The server refused the credentials (HTTP 401/403): pass the right `api_key`."""


class AgentRequestError(AgentClientError):
    """The server refused a request; `status` is the HTTP status, the message is the server's reason."""

    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


class AgentTurnError(AgentClientError):
    """A turn did not end normally; `partial` holds the answer text received before that."""

    def __init__(self, message: str, partial: str = ""):
        super().__init__(message)
        self.partial = partial


class AgentError(AgentTurnError):
    """The agent reported an error for the turn (a failed model call, an unknown command, …)."""


class AgentTimeout(AgentTurnError, TimeoutError):
    """The turn did not end within the timeout (it may still be running on the server)."""


class AgentCancelled(AgentTurnError):
    """The turn was cancelled on the server (a newer message on the same session, its deletion), or
    interrupted (the server restarted while it ran)."""


class _StreamBroke(Exception):
    """One connection to a turn's stream ended before the turn; `progress`: it brought new events."""

    def __init__(self, cause: BaseException, progress: bool):
        super().__init__(str(cause))
        self.cause, self.progress = cause, progress


@dataclass(frozen=True)
class AgentEvent:
    """One event of a turn: `name` is tok, status, gate, error or done; `data` its JSON object."""

    name: str
    data: dict[str, Any] = field(default_factory=dict)
    id: int | None = None

    @property
    def text(self) -> str:
        """The text of a tok or status event, the message of an error, else ""."""
        value = self.data.get("text", self.data.get("message", ""))
        return value if isinstance(value, str) else str(value)

    @property
    def ends_turn(self) -> bool:
        """Whether this is the turn's last event (its `done`, or the status of its cancellation)."""
        return self.name == "done" or (self.name == "status" and self.data.get("cancelled") is True)

    @classmethod
    def from_sse(cls, raw: _RawEvent) -> AgentEvent:
        """Decode a raw message; data that is not a JSON object is kept as `{"text": data}`."""
        try:
            data = json.loads(raw.data) if raw.data.strip() else {}
        except ValueError:
            data = {"text": raw.data}
        if not isinstance(data, dict):
            data = {"text": data if isinstance(data, str) else json.dumps(data)}
        event_id = int(raw.id) if raw.id and raw.id.strip().isdigit() else None
        # An event without a name ("message") is answer text, as servers without names send it.
        return cls("tok" if raw.event in ("", "message") else raw.event, data, event_id)


async def sse_events(source: EventSource) -> AsyncGenerator[AgentEvent, None]:
    """The events of an SSE stream as the WHATWG algorithm dispatches them: never one without data.
    (httpx-sse also yields an empty message after every keepalive comment once an id was seen, which
    would read as an empty `tok` every 15 s.)"""
    async for raw in source.aiter_sse():
        if raw.data:
            yield AgentEvent.from_sse(raw)


def gate_decision(policy: GatePolicy, gate: Mapping[str, Any]) -> bool:
    """Whether `policy` approves a gate event's data (`tool_name`, `tool_args.operation_type`)."""
    if policy is True:
        return True
    if not isinstance(policy, Mapping):
        return False
    tool = gate.get("tool_name")
    if isinstance(tool, str) and tool in policy:
        return bool(policy[tool])
    args = gate.get("tool_args")
    operation = args.get("operation_type") if isinstance(args, Mapping) else None
    if isinstance(operation, str) and operation in policy:
        return bool(policy[operation])
    return False


def default_key_file(env: Mapping[str, str]) -> Path:
    """Where a server started from this checkout keeps its generated API key: `$AGENT_DATA_DIR/api-key`."""
    return Path(env.get("AGENT_DATA_DIR") or CODE_DIR / "data") / guard.API_KEY_FILE


def find_api_key(api_key: str | None, env: Mapping[str, str]) -> tuple[str | None, str | None]:
    """(the key to send, why none could be found): `api_key`, else API_KEY, else the generated key file;
    `api_key=""` sends no key at all (a call to another server must never carry this one's key)."""
    if api_key == "":
        return None, None
    api_key = api_key or env.get("API_KEY") or None
    if api_key is not None:
        return api_key, None
    try:
        return guard.read_token_file(default_key_file(env), "API_KEY"), None
    except guard.TokenFileError as exc:
        return None, str(exc)


def error_message(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict) and body.get("error"):
        return str(body["error"])
    if "html" in response.headers.get("content-type", ""):  # agent-mcp answers JSON or text, never a page
        return f"{response.reason_phrase} from {response.headers.get('server') or 'a proxy'} in front of the server"
    return response.text[:300] or response.reason_phrase


async def send_retrying(send: Callable[[], Awaitable[httpx.Response]]) -> httpx.Response:
    """`send()`, and again for RETRY_SECONDS at most while nothing took the request (its connection
    refused, or a RETRY_STATUSES answer); then the last answer, or the connection error."""
    def last(state: RetryCallState) -> httpx.Response:
        assert state.outcome is not None
        answer: httpx.Response = state.outcome.result()  # the last answer, or raises the last error
        return answer

    async def once() -> httpx.Response:
        return await send()

    return await AsyncRetrying(
        stop=stop_after_delay(RETRY_SECONDS), wait=wait_exponential(multiplier=0.2, max=2),
        retry=retry_if_exception_type(httpx.ConnectError) | retry_if_result(
            lambda r: r.status_code in RETRY_STATUSES), retry_error_callback=last,
    )(once)


class AgentClient:
    """An async client of one session on an agent-mcp API endpoint (`plugin_client_api`).

    `client_id` defaults to a fresh `api-<8 hex>`; the server puts ids without the `api-` prefix
    into its API namespace and the client then uses the id the server returned. `api_key` is the
    endpoint's bearer token (None: `API_KEY`, else the server's `<data dir>/api-key`; "": none),
    `admin_key` its admin token (`API_ADMIN_KEY`, needed for
    gate-changing commands). `default_timeout` (seconds) bounds each turn; `verify` is httpx's TLS
    setting for https URLs (pass one `ssl.SSLContext` to skip loading the CA bundle per call). `headers`
    are sent with every request (agent_call sends the W3C `traceparent` this way). Every call opens its
    own HTTP connection, so a client may be shared and needs no closing.
    """

    def __init__(
        self,
        base_url: str,
        client_id: str | None = None,
        api_key: str | None = None,
        auto_approve_gates: GatePolicy = None,
        default_timeout: float = 60,
        *,
        admin_key: str | None = None,
        verify: ssl.SSLContext | bool = True,
        transport: httpx.AsyncBaseTransport | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.client_id = client_id or f"api-{uuid.uuid4().hex[:8]}"
        self.auto_approve_gates = auto_approve_gates
        self.default_timeout = default_timeout
        api_key, self._key_problem = find_api_key(api_key, os.environ)
        self._headers = {**(headers or {}), **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
        if admin_key:
            self._headers["X-Admin-Key"] = admin_key
        # Plain http needs no TLS: skipping the CA bundle makes each call's client ~18 ms cheaper.
        self._verify = verify if self.base_url.startswith("https://") else False
        self._transport = transport

    def __repr__(self) -> str:  # never shows the keys
        return f"AgentClient({self.base_url!r}, client_id={self.client_id!r})"

    # ── turns ──

    async def send(self, text: str, timeout: float | None = None) -> str:  # noqa: ASYNC109 (the reference API)
        """Send one message and return the whole answer of its turn.

        Raises AgentError (the agent reported an error), AgentTimeout, AgentCancelled (each with
        `.partial`), AgentAuthError, AgentRequestError or AgentConnectionError.
        """
        parts = [piece async for piece in self.stream(text, timeout)]
        return "".join(parts)

    async def stream(self, text: str, timeout: float | None = None) -> AsyncGenerator[str, None]:  # noqa: ASYNC109
        """Send one message and yield the answer text as it is produced (raises like `send`)."""
        parts: list[str] = []
        stopped = False
        async with contextlib.aclosing(self.events(text, timeout)) as events:
            async for ev in events:
                if ev.name == "tok":
                    parts.append(ev.text)
                    yield ev.text
                elif ev.name == "error":
                    raise AgentError(f"Agent error: {ev.text}", "".join(parts))
                elif ev.name == "status" and ev.data.get("stopped") is True:
                    stopped = True  # its `done` follows
                elif ev.ends_turn and (ev.name != "done" or stopped):
                    why = "stopped (stop())" if stopped else "cancelled on the server"
                    raise AgentCancelled(f"the turn was {why}", "".join(parts))

    async def events(self, text: str, timeout: float | None = None  # noqa: ASYNC109
                     ) -> AsyncGenerator[AgentEvent, None]:
        """Send one message and yield every event of its turn, through its last one.

        Gates are answered by the policy before their event is yielded. Raises AgentTimeout (with
        `.partial`) when the turn has not ended within `timeout` (default: `default_timeout`).
        """
        limit = self.default_timeout if timeout is None else timeout
        loop = asyncio.get_running_loop()
        deadline = loop.time() + limit
        received: list[str] = []
        async with self._http() as http:
            accepted = await self._call(http, "POST", "/api/v1/submit", again=True,
                                        json={"client_id": self.client_id, "text": text, "wait": False})
            self.client_id = str(accepted.get("client_id") or self.client_id)
            turn_id = accepted.get("turn_id")
            after = accepted.get("after")
            queue: asyncio.Queue[AgentEvent | BaseException] = asyncio.Queue()
            reader = asyncio.create_task(self._read(http, turn_id, after if isinstance(after, int) else None, queue))
            try:
                while True:
                    try:
                        async with asyncio.timeout(max(0.0, deadline - loop.time())):
                            item = await queue.get()
                    except TimeoutError:
                        raise AgentTimeout(f"no end of the turn within {limit:g} s", "".join(received)) from None
                    if isinstance(item, AgentRequestError) and item.status == 404 and turn_id:
                        # The server no longer knows the turn (it restarted meanwhile): say so, keep the text.
                        raise AgentCancelled(f"the turn was interrupted before it ended: the server restarted or "
                                             f"lost it ({item})", "".join(received)) from None
                    if isinstance(item, BaseException):
                        raise item
                    if item.name == "tok":
                        received.append(item.text)
                    yield item
                    if item.ends_turn:
                        return
            finally:
                reader.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await reader

    async def _read(self, http: httpx.AsyncClient, turn_id: Any, after: int | None,
                    queue: asyncio.Queue[AgentEvent | BaseException]) -> None:
        """Follow the turn's events into `queue`, reconnecting after drops (RECONNECTS tries in a row
        without a new event, backing off); errors go into the queue too."""
        params = {"turn_id": str(turn_id)} if turn_id else None
        last = after

        async def follow() -> None:
            nonlocal last
            seen = last
            headers = {"Last-Event-ID": str(last)} if last is not None else {}
            try:
                async with aconnect_sse(http, "GET", f"/api/v1/stream/{self.client_id}", params=params,
                                        headers=headers,
                                        timeout=httpx.Timeout(REQUEST_TIMEOUT, read=STREAM_READ_TIMEOUT)) as source:
                    if source.response.status_code >= 400:
                        await source.response.aread()
                        self._raise_for(source.response)
                    async for ev in sse_events(source):
                        if ev.id is not None:
                            last = ev.id
                        if ev.name == "gate":
                            await self._answer_gate(http, ev.data)
                        await queue.put(ev)
                        if ev.ends_turn:
                            return
                cause: BaseException = AgentConnectionError("the stream ended before the turn did")
            except (httpx.TransportError, SSEError) as exc:
                cause = exc
            raise _StreamBroke(cause, progress=last != seen)

        try:
            while True:  # a new series of tries after every drop that came after new events
                try:
                    async for attempt in AsyncRetrying(
                        stop=stop_after_attempt(RECONNECTS + 1), wait=RECONNECT_WAIT,
                        retry=retry_if_exception(lambda exc: isinstance(exc, _StreamBroke) and not exc.progress),
                        reraise=True,
                    ):
                        with attempt:
                            await follow()
                    return
                except _StreamBroke as exc:
                    if not exc.progress:
                        raise AgentConnectionError(
                            f"the event stream of {self.base_url} keeps breaking: {exc.cause}") from None
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            await queue.put(exc)

    async def _answer_gate(self, http: httpx.AsyncClient, gate: dict[str, Any]) -> None:
        gate_id = gate.get("gate_id")
        if not isinstance(gate_id, str) or gate.get("approvers"):  # routed to people the operator named: theirs
            return
        # A gate that timed out meanwhile answers 404: nothing left to do.
        with contextlib.suppress(httpx.HTTPError):
            await send_retrying(lambda: http.post(f"/api/v1/gate/{gate_id}",
                                                  json={"approve": gate_decision(self.auto_approve_gates, gate)}))

    async def stop(self) -> bool:
        """Stop this client's running turn without starting another (POST /api/v1/stop); whether one ran.
        A `send` or `stream` of that turn then raises AgentCancelled with the text received so far."""
        async with self._http() as http:
            body = await self._call(http, "POST", "/api/v1/stop", json={"client_id": self.client_id})
        return body.get("cancelled") is True

    # ── sessions ──

    async def sessions(self) -> list[dict[str, Any]]:
        """The sessions this key may see: `[{"client_id", "shorthand_id", "model", "history_length"}]`."""
        async with self._http() as http:
            body = await self._call(http, "GET", "/api/v1/sessions")
        return list(body.get("sessions", []))

    async def delete_session(self, session_id: str | int) -> dict[str, Any]:
        """Delete a session by full or shorthand id: `{"status": "deleted", "client_id"}`."""
        async with self._http() as http:
            return await self._call(http, "DELETE", f"/api/v1/session/{session_id}")

    async def health(self) -> dict[str, Any]:
        """`{"status": "ok", "sessions", "models"}`."""
        async with self._http() as http:
            return await self._call(http, "GET", "/api/v1/health")

    # ── plumbing ──

    def _http(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.base_url, headers=self._headers, timeout=REQUEST_TIMEOUT,
                                 verify=self._verify, transport=self._transport)

    async def _call(self, http: httpx.AsyncClient, method: str, path: str, again: bool = False,
                    **kwargs: Any) -> dict[str, Any]:
        """One request (with `again`: sent again while nothing took it, see send_retrying)."""
        def send() -> Awaitable[httpx.Response]:
            return http.request(method, path, **kwargs)

        try:
            response = await (send_retrying(send) if again else send())
        except httpx.TransportError as exc:
            raise AgentConnectionError(f"cannot reach {self.base_url}: {str(exc) or type(exc).__name__}") from exc
        self._raise_for(response)
        try:
            body = response.json()
        except ValueError:
            raise AgentRequestError(response.status_code, f"not a JSON answer: {response.text[:200]}") from None
        if not isinstance(body, dict):
            raise AgentRequestError(response.status_code, f"unexpected answer: {response.text[:200]}")
        return body

    def _raise_for(self, response: httpx.Response) -> None:
        if response.status_code in (401, 403):
            why = f" ({self._key_problem})" if self._key_problem else ""
            raise AgentAuthError(f"{self.base_url} refused the credentials (HTTP {response.status_code}): "
                                 f"{error_message(response)}; pass the endpoint's API key as api_key{why}")
        if response.status_code >= 400:
            raise AgentRequestError(response.status_code, error_message(response))


class SyncAgentClient:
    """AgentClient for scripts without asyncio: the same arguments and methods, blocking.

    Holds one event loop; close it with `close()` or a `with` block. Not for use inside async code.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.client = AgentClient(*args, **kwargs)
        self._runner = asyncio.Runner()

    def __enter__(self) -> SyncAgentClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        self._runner.close()

    @property
    def client_id(self) -> str:
        return self.client.client_id

    def send(self, text: str, timeout: float | None = None) -> str:
        """The whole answer of one message (see AgentClient.send)."""
        return self._runner.run(self.client.send(text, timeout))

    def stream(self, text: str, timeout: float | None = None) -> Iterator[str]:
        """The answer text of one message as it is produced (see AgentClient.stream)."""
        pieces = self.client.stream(text, timeout)

        async def step() -> str:
            return await anext(pieces)

        async def close() -> None:
            await pieces.aclose()

        try:
            while True:
                try:
                    yield self._runner.run(step())
                except StopAsyncIteration:
                    return
        finally:
            self._runner.run(close())

    def stop(self) -> bool:
        """Stop this client's running turn (see AgentClient.stop)."""
        return self._runner.run(self.client.stop())

    def sessions(self) -> list[dict[str, Any]]:
        return self._runner.run(self.client.sessions())

    def delete_session(self, session_id: str | int) -> dict[str, Any]:
        return self._runner.run(self.client.delete_session(session_id))

    def health(self) -> dict[str, Any]:
        return self._runner.run(self.client.health())
