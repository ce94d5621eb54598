"""A fake Slack on 127.0.0.1: the Web API over HTTP and the Socket Mode WebSocket, in its own thread.

The real slack-sdk talks to it unchanged through `AsyncWebClient(base_url=fake.base_url)`:
`apps.connections.open` hands out a `ws://` URL of this server, whose `/link/` WebSocket sends
`hello`, then the envelopes a test pushes, and records every frame the client sends back (the
acks). `auth.test`, `chat.postMessage`, `chat.update` (both with Block Kit `blocks`) and
`chat.postEphemeral` behave like Slack's (same bodies, same error codes); every call is recorded.
Test controls: `push_event`, `click` (a button press: an `interactive` envelope of type
`block_actions`, as Slack sends it), `send_disconnect`, `drop_socket`, `fail_next`; `wait_for` /
`until` wait for a condition instead of sleeping.

The server (Starlette on uvicorn, like the fake LLM backends) runs on its own event loop in a
background thread, so it serves a plugin in the test's process as well as a server subprocess.
State is guarded by one condition variable.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import parse_qsl

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from tests.fakes.server import ThreadedServer

T = TypeVar("T")

BOT_TOKEN = "xoxb-fake-1234-bot-token"
APP_TOKEN = "xapp-fake-1-A1-app-token"
BOT_USER_ID = "UBOT"
BOT_ID = "BBOT"
TEAM_ID = "T1"
APP_ID = "A1"
#: Slack truncates or refuses message text above this many characters (chat.postMessage docs).
MAX_TEXT = 40_000


@dataclass
class ApiCall:
    """One Web API request: the method, its arguments (JSON or form body) and the bearer token."""

    method: str
    args: dict[str, Any]
    token: str | None
    #: When it arrived (time.time(): comparable with a server's timestamps on this machine).
    at: float = 0.0


@dataclass
class Message:
    """A message the bot posted, with every text it had (posted first, then each chat.update)."""

    channel: str
    ts: str
    thread_ts: str | None
    texts: list[str]
    #: The Block Kit blocks of each version (None for a version without blocks).
    versions: list[list[dict[str, Any]] | None] = field(default_factory=list)

    @property
    def text(self) -> str:
        return self.texts[-1]

    @property
    def blocks(self) -> list[dict[str, Any]]:
        return self.blocks_of(-1)

    def blocks_of(self, version: int) -> list[dict[str, Any]]:
        return (self.versions[version] if self.versions else None) or []

    def buttons(self, version: int = -1) -> dict[str, dict[str, Any]]:
        """The buttons of the current version (or of `version`: 0 is as first posted), by action_id."""
        return {e["action_id"]: e for b in self.blocks_of(version) if b.get("type") == "actions"
                for e in b.get("elements", []) if e.get("type") == "button"}

    def block_text(self) -> str:
        """Every mrkdwn/plain text of the current blocks, one per line."""
        out = []
        for b in self.blocks:
            for part in [b.get("text") or {}, *(b.get("elements") or [])]:
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    out.append(part["text"])
        return "\n".join(out)


@dataclass
class Ephemeral:
    """A chat.postEphemeral: shown only to `user`."""

    channel: str
    user: str
    text: str
    thread_ts: str | None


@dataclass
class Envelope:
    """An envelope sent to the client and, once acknowledged, its ack frame."""

    envelope_id: str
    event_id: str
    body: dict[str, Any]
    sent: float
    ack: dict[str, Any] | None = None
    acked: float | None = None


@dataclass
class _Failure:
    error: str
    status: int
    headers: dict[str, str] = field(default_factory=dict)


class FakeSlack(ThreadedServer):
    """A fake Slack workspace with one bot user (`UBOT` / `BBOT`) and one app (`A1`)."""

    ws = "websockets-sansio"

    def __init__(self, *, echo_bot_messages: bool = False) -> None:
        super().__init__()
        #: Send the bot's own posts and edits back as `message` events, as Slack does.
        self.echo_bot_messages = echo_bot_messages
        self._cond = threading.Condition()
        self.calls: list[ApiCall] = []
        self.envelopes: list[Envelope] = []
        self.messages: dict[str, Message] = {}
        self.ephemerals: list[Ephemeral] = []
        self.opens = 0
        self.connections = 0
        self.unknown_frames: list[str] = []
        self._sockets: list[WebSocket] = []
        self._tickets: set[str] = set()
        self._failures: dict[str, list[_Failure]] = {}
        self._ts = itertools.count(1)

    # ── lifecycle ──────────────────────────────────────────────────────────────────────────

    @property
    def base_url(self) -> str:
        """What to give `AsyncWebClient(base_url=...)` (with the trailing `/api/`)."""
        return f"http://127.0.0.1:{self.port}/api/"

    def app(self) -> Starlette:
        return Starlette(routes=[Route("/api/{method}", self._api, methods=["POST"]),
                                 WebSocketRoute("/link/", self._link)])

    def stop(self) -> None:
        """Close the Socket Mode connections, then stop the server and wait for its thread."""
        if self._server is not None and self._server.loop is not None and self._server.started:
            for ws in list(self._sockets):
                with contextlib.suppress(Exception):
                    self._run(ws.close())
        super().stop()

    # ── test controls (thread-safe; called from the test's thread) ─────────────────────────

    def _run(self, coro: Any) -> Any:
        assert self._server is not None and self._server.loop is not None, "FakeSlack is not started"
        return asyncio.run_coroutine_threadsafe(coro, self._server.loop).result(10)

    def push_event(
        self, event: dict[str, Any], *, event_id: str | None = None, retry_attempt: int = 0, retry_reason: str = "",
        socket: int | None = None,
    ) -> Envelope:
        """Wrap `event` in an `events_api` envelope (new envelope id) and send it on the newest socket (or on
        socket number `socket`, oldest first: Slack spreads events over an app's connections)."""
        event_id = event_id or f"Ev{uuid.uuid4().hex[:10].upper()}"
        body = {
            "envelope_id": str(uuid.uuid4()),
            "type": "events_api",
            "accepts_response_payload": False,
            "retry_attempt": retry_attempt,
            "retry_reason": retry_reason,
            "payload": {
                "token": "verification-token-unused",
                "team_id": TEAM_ID,
                "api_app_id": APP_ID,
                "type": "event_callback",
                "event_id": event_id,
                "event_time": int(time.time()),
                "authorizations": [{"team_id": TEAM_ID, "user_id": BOT_USER_ID, "is_bot": True}],
                "event": event,
            },
        }
        return self._run(self._send_envelope(body, event_id, socket))

    def click(self, message: Message, action_id: str, user: str, *, socket: int | None = None,
              version: int = -1) -> Envelope:
        """`user` presses the button `action_id` of `message` (as shown in `version`, e.g. 0 on a phone that
        has not refreshed): a Socket Mode `interactive` envelope with a `block_actions` payload, as Slack sends it."""
        button = message.buttons(version)[action_id]
        block_id = next(b.get("block_id", "") for b in message.blocks_of(version) if button in b.get("elements", []))
        container = {"type": "message", "message_ts": message.ts, "channel_id": message.channel, "is_ephemeral": False,
                     **({"thread_ts": message.thread_ts} if message.thread_ts else {})}
        payload = {
            "type": "block_actions", "team": {"id": TEAM_ID, "domain": "fake"},
            "user": {"id": user, "username": user.lower(), "name": user.lower(), "team_id": TEAM_ID},
            "api_app_id": APP_ID, "token": "verification-token-unused", "container": container,
            "trigger_id": f"{uuid.uuid4().int % 10**12}.{uuid.uuid4().hex[:12]}",
            "channel": {"id": message.channel, "name": message.channel.lower()},
            "message": {"type": "message", "user": BOT_USER_ID, "bot_id": BOT_ID, "ts": message.ts,
                        "text": message.texts[version], "blocks": message.blocks_of(version),
                        **({"thread_ts": message.thread_ts} if message.thread_ts else {})},
            "state": {"values": {}}, "response_url": f"http://127.0.0.1:{self.port}/actions/unused",
            "actions": [{"type": "button", "action_id": action_id, "block_id": block_id, "value": button.get("value"),
                         "text": button["text"], "action_ts": f"{time.time():.6f}",
                         **({"style": button["style"]} if "style" in button else {})}],
        }
        body = {"envelope_id": str(uuid.uuid4()), "type": "interactive", "accepts_response_payload": False,
                "payload": payload}
        return self._run(self._send_envelope(body, "", socket))

    def send_raw(self, frame: dict[str, Any]) -> None:
        """Send any frame (e.g. a `slash_commands` envelope) on the newest socket."""
        self._run(self._send(frame))

    def send_disconnect(self, reason: str = "refresh_requested") -> None:
        """Slack's `disconnect` frame: the client should open a new connection."""
        self._run(self._send({"type": "disconnect", "reason": reason, "debug_info": {"host": "applink-fake"}}))

    def drop_socket(self) -> None:
        """Close the newest socket from the server side, as when Slack restarts a connection."""
        self._run(self._drop())

    def fail_next(self, method: str, error: str, *, status: int = 200, retry_after: int | None = None) -> None:
        """Make the next call of `method` answer `{"ok": false, "error": error}` (429 + Retry-After if given)."""
        headers = {"Retry-After": str(retry_after)} if retry_after is not None else {}
        with self._cond:
            self._failures.setdefault(method, []).append(_Failure(error, status, headers))

    # ── inspection ─────────────────────────────────────────────────────────────────────────

    def calls_of(self, method: str) -> list[ApiCall]:
        with self._cond:
            return [c for c in self.calls if c.method == method]

    def in_channel(self, channel: str) -> list[Message]:
        """The bot's messages in a channel (top level and in threads), oldest first."""
        with self._cond:
            return [m for m in self.messages.values() if m.channel == channel]

    def told(self, user: str) -> list[Ephemeral]:
        """The ephemeral messages shown to `user`."""
        with self._cond:
            return [e for e in self.ephemerals if e.user == user]

    def thread(self, channel: str, thread_ts: str) -> list[Message]:
        """The bot's messages in one thread, oldest first."""
        with self._cond:
            return [m for m in self.messages.values() if m.channel == channel and m.thread_ts == thread_ts]

    @property
    def live(self) -> int:
        """Socket Mode connections open now."""
        with self._cond:
            return len(self._sockets)

    def acked(self, envelope: Envelope) -> bool:
        with self._cond:
            return envelope.ack is not None

    def wait_for(self, predicate: Callable[[], T], timeout: float = 10) -> T:
        """Block until `predicate()` is truthy (re-checked on every change) and return its value."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                value = predicate()
                if value:
                    return value
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"FakeSlack: condition not met within {timeout} s")
                self._cond.wait(left)

    async def until(self, predicate: Callable[[], T], within: float = 10) -> T:
        """`wait_for` for async tests: waits in a worker thread so the test's loop keeps running."""
        return await asyncio.to_thread(self.wait_for, predicate, within)

    # ── Web API ────────────────────────────────────────────────────────────────────────────

    async def _api(self, request: Request) -> JSONResponse:
        method = request.path_params["method"]
        raw = (await request.body()).decode()
        if request.headers.get("content-type", "").startswith("application/json"):
            try:
                args = json.loads(raw or "{}")
            except ValueError:
                return _error("invalid_json")
        else:
            args = dict(parse_qsl(raw))
        auth = request.headers.get("Authorization", "")
        token = auth.removeprefix("Bearer ") if auth.startswith("Bearer ") else None
        with self._cond:
            self.calls.append(ApiCall(method, args, token, time.time()))
            failures = self._failures.get(method)
            failure = failures.pop(0) if failures else None
            self._cond.notify_all()
        if failure is not None:
            return _error(failure.error, failure.status, failure.headers)
        handler = {
            "apps.connections.open": self._connections_open,
            "auth.test": self._auth_test,
            "chat.postMessage": self._post_message,
            "chat.update": self._update,
            "chat.postEphemeral": self._post_ephemeral,
        }.get(method)
        if handler is None:
            return _error("unknown_method", 404)
        expected = APP_TOKEN if method == "apps.connections.open" else BOT_TOKEN
        if token is None:
            return _error("not_authed")
        if token != expected:
            return _error("invalid_auth")
        return await handler(args)

    async def _connections_open(self, args: dict[str, Any]) -> JSONResponse:
        with self._cond:
            self.opens += 1
            ticket = f"t{self.opens}-{uuid.uuid4().hex[:8]}"
            self._tickets.add(ticket)
            self._cond.notify_all()
        return JSONResponse({"ok": True, "url": f"ws://127.0.0.1:{self.port}/link/?ticket={ticket}&app_id={APP_ID}"})

    async def _auth_test(self, args: dict[str, Any]) -> JSONResponse:
        return JSONResponse({
            "ok": True, "url": "https://fake.slack.com/", "team": "Fake", "user": "agent", "team_id": TEAM_ID,
            "user_id": BOT_USER_ID, "bot_id": BOT_ID, "is_enterprise_install": False,
        })

    def _next_ts(self) -> str:
        n = next(self._ts)
        return f"{1_700_000_100 + n}.{n:06d}"

    async def _post_message(self, args: dict[str, Any]) -> JSONResponse:
        channel, text, thread_ts = args.get("channel"), args.get("text"), args.get("thread_ts")
        blocks = _blocks(args)
        if not channel:
            return _error("channel_not_found")
        if blocks is False:
            return _error("invalid_blocks")
        if not text and not blocks:
            return _error("no_text")
        text = text or ""
        if len(text) > MAX_TEXT:
            return _error("msg_too_long")
        if channel.startswith(("U", "W")):  # a user id: the app's DM with that user
            channel = "D" + channel
        ts = self._next_ts()
        with self._cond:
            self.messages[ts] = Message(channel, ts, thread_ts, [text], [blocks or None])
            self._cond.notify_all()
        message = {"type": "message", "text": text, "user": BOT_USER_ID, "bot_id": BOT_ID, "app_id": APP_ID, "ts": ts,
                   **({"thread_ts": thread_ts} if thread_ts else {})}
        if self.echo_bot_messages:
            await self._echo({**message, "channel": channel, "channel_type": _channel_type(channel), "event_ts": ts})
        return JSONResponse({"ok": True, "channel": channel, "ts": ts, "message": message})

    async def _update(self, args: dict[str, Any]) -> JSONResponse:
        channel, ts, text = args.get("channel"), args.get("ts"), args.get("text")
        blocks = _blocks(args)
        if blocks is False:
            return _error("invalid_blocks")
        if not text and not blocks:
            return _error("no_text")
        text = text or ""
        if len(text) > MAX_TEXT:
            return _error("msg_too_long")
        with self._cond:
            message = self.messages.get(str(ts))
            if message is None or message.channel != channel:
                return _error("message_not_found")
            message.texts.append(text)
            message.versions.append(blocks or None)
            self._cond.notify_all()
        if self.echo_bot_messages:
            edited = {"type": "message", "text": text, "user": BOT_USER_ID, "bot_id": BOT_ID, "ts": ts}
            await self._echo({"type": "message", "subtype": "message_changed", "hidden": True, "channel": channel,
                              "channel_type": _channel_type(channel), "ts": self._next_ts(), "message": edited})
        return JSONResponse({"ok": True, "channel": channel, "ts": ts, "text": text})

    async def _post_ephemeral(self, args: dict[str, Any]) -> JSONResponse:
        channel, user, text = args.get("channel"), args.get("user"), args.get("text")
        if not channel:
            return _error("channel_not_found")
        if not user:
            return _error("user_not_in_channel")
        if not text and not _blocks(args):
            return _error("no_text")
        with self._cond:
            self.ephemerals.append(Ephemeral(channel, user, text or "", args.get("thread_ts")))
            self._cond.notify_all()
        return JSONResponse({"ok": True, "message_ts": self._next_ts()})

    async def _echo(self, event: dict[str, Any]) -> None:
        event_id = f"Ev{uuid.uuid4().hex[:10].upper()}"
        body = {"envelope_id": str(uuid.uuid4()), "type": "events_api", "accepts_response_payload": False,
                "retry_attempt": 0, "retry_reason": "",
                "payload": {"type": "event_callback", "team_id": TEAM_ID, "api_app_id": APP_ID,
                            "event_id": event_id, "event_time": int(time.time()), "event": event}}
        with contextlib.suppress(ConnectionError, RuntimeError):
            await self._send_envelope(body, event_id)

    # ── Socket Mode ────────────────────────────────────────────────────────────────────────

    async def _link(self, ws: WebSocket) -> None:
        ticket = ws.query_params.get("ticket", "")
        with self._cond:
            valid = ticket in self._tickets
            self._tickets.discard(ticket)  # a ticket opens one connection only
        if not valid:
            await ws.close(code=1008)  # refuses the handshake (HTTP 403)
            return
        await ws.accept()
        with self._cond:
            self._sockets.append(ws)
            count = len(self._sockets)
        await ws.send_json({"type": "hello", "num_connections": count, "debug_info": {"host": "applink-fake"},
                            "connection_info": {"app_id": APP_ID}})
        with self._cond:
            self.connections += 1  # counts sockets that got their hello
            self._cond.notify_all()
        try:
            while True:
                self._record_frame(await ws.receive_text())
        except (WebSocketDisconnect, RuntimeError):
            pass  # the client went away, or the fake closed the socket
        finally:
            with self._cond:
                if ws in self._sockets:
                    self._sockets.remove(ws)
                self._cond.notify_all()

    def _record_frame(self, data: str) -> None:
        try:
            frame = json.loads(data)
        except ValueError:
            frame = None
        with self._cond:
            envelope = None
            if isinstance(frame, dict):
                envelope = next((e for e in self.envelopes if e.envelope_id == frame.get("envelope_id")), None)
            if envelope is None or envelope.ack is not None:
                self.unknown_frames.append(data)
            else:
                envelope.ack, envelope.acked = frame, time.monotonic()
            self._cond.notify_all()

    def _newest_socket(self) -> WebSocket:
        with self._cond:
            live = list(self._sockets)
        if not live:
            raise ConnectionError("FakeSlack: no Socket Mode client is connected")
        return live[-1]

    async def _send(self, frame: dict[str, Any]) -> None:
        await self._newest_socket().send_json(frame)

    async def _send_envelope(self, body: dict[str, Any], event_id: str, socket: int | None = None) -> Envelope:
        envelope = Envelope(body["envelope_id"], event_id, body, time.monotonic())
        with self._cond:
            self.envelopes.append(envelope)
            ws = self._sockets[socket] if socket is not None else None
        await (ws.send_json(body) if ws is not None else self._send(body))
        return envelope

    async def _drop(self) -> None:
        ws = self._newest_socket()
        with self._cond:
            self._sockets.remove(ws)
        await ws.close()


def _blocks(args: dict[str, Any]) -> list[dict[str, Any]] | bool | None:
    """The `blocks` argument (a JSON list, or a JSON string of one in a form body); False when malformed."""
    blocks = args.get("blocks")
    if isinstance(blocks, str):
        try:
            blocks = json.loads(blocks)
        except ValueError:
            return False
    if blocks is None:
        return None
    if not isinstance(blocks, list) or len(blocks) > 50 or not all(isinstance(b, dict) and b.get("type")
                                                                   for b in blocks):
        return False
    return blocks


def _channel_type(channel: str) -> str:
    return "im" if channel.startswith("D") else "channel"


def _error(error: str, status: int = 200, headers: dict[str, str] | None = None) -> JSONResponse:
    """Slack's error shape: HTTP 200 (or 429 when rate limited) with `ok: false`."""
    return JSONResponse({"ok": False, "error": error}, status_code=status, headers=headers)
