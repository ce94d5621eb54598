"""Slack thread bot: Socket Mode in, Web API out, one agent session per Slack thread.

Inbound: slack-sdk's Socket Mode client (`SLACK_APP_TOKEN`, `xapp-…`); every envelope is
acknowledged before anything else happens. App mentions, direct messages and replies in threads
the bot already answers in become requests of client `slack-<channel>-<thread_ts>`; the bot's own
and other bots' messages, edits, deletions and repeated deliveries are dropped. Outbound: the Web
API (`SLACK_BOT_TOKEN`, `xoxb-…`): a placeholder is posted in the thread at once and edited with
`chat.update` while the answer streams (at most once per `update_interval`), then replaced by the
final answer in Slack mrkdwn, split into several messages at `max_message_chars` without breaking
code blocks. `api_base_url` points both clients elsewhere (a proxy, or the fake Slack in tests).
`/slack/health` and `/slack/status` are served on the plugin's own port (127.0.0.1:8766).

slack-sdk's asyncio clients all need aiohttp, and with aiohttp installed google-genai moves its own
async transport to aiohttp; so this plugin uses slack-sdk's dependency-free clients instead: the
builtin Socket Mode client (its own threads; listeners ack from there and hand the event to the
event loop) and `WebClient`, called through `asyncio.to_thread`.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import re
import socket
import urllib.request
from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from pydantic import ConfigDict, Field
from slack_sdk import WebClient
from slack_sdk.errors import SlackApiError, SlackClientError
from slack_sdk.http_retry.builtin_handlers import ConnectionErrorRetryHandler, RateLimitErrorRetryHandler
from slack_sdk.socket_mode.builtin import SocketModeClient
from slack_sdk.socket_mode.client import BaseSocketModeClient
from slack_sdk.socket_mode.request import SocketModeRequest
from slack_sdk.socket_mode.response import SocketModeResponse
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, wait_exponential

import guard
import plugin_api
from plugin_api import BasePlugin, parse_settings
from plugins._slack_approvals import SlackApprovals
from plugins._slack_events import PREFIX, SEEN_MEMORY, EventFilter, InboundMessage
from plugins._slack_reply import Reply, describe

logger = logging.getLogger("agent_mcp.slack")

SLACK_CLIENT_ID = re.compile(r"^slack-(?P<channel>[A-Z0-9]+)-(?P<thread_ts>\d+\.\d+)$")
SHUTDOWN_GRACE = 3
#: How long an event or message id stays claimed in Redis against repeats (several instances).
DEDUPE_SECONDS = 3600


# ── Settings ────────────────────────────────────────────────────────────────────────────────


class SlackSettings(guard.ListenerSettings):
    """`plugin_config.plugin_client_slack` in plugins-enabled.json."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    host: str = "127.0.0.1"
    port: int = Field(default=8766, ge=1, le=65535)
    #: Environment variable holding the bearer token of /slack/health and /slack/status.
    token_env: str = "AGENT_SLACK_TOKEN"
    #: Slack's Web API root; Socket Mode URLs come from it too (apps.connections.open).
    api_base_url: str = Field(default="https://slack.com/api/", pattern=r"^https?://")
    #: Seconds between two chat.update calls of one answer (Slack allows about one per second).
    update_interval: float = Field(default=1.5, ge=0.05, le=60)
    #: Longest message posted; longer answers go out as several messages in the thread.
    max_message_chars: int = Field(default=3900, ge=200, le=39_000)
    #: Socket Mode keepalive; a connection silent for 4 intervals is replaced.
    ping_interval: float = Field(default=5, ge=0.2, le=60)
    #: Model of new Slack sessions (default: the server's default model).
    default_model: str | None = None


def _is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def proxy_for(url: str) -> str | None:
    """The HTTP(S) proxy to reach `url`: from the environment, honouring NO_PROXY and loopback.

    slack-sdk reads HTTPS_PROXY itself but ignores NO_PROXY, which would send traffic meant for a
    local Slack stand-in to the proxy.
    """
    host = urlsplit(url).hostname or ""
    if _is_loopback(host) or urllib.request.proxy_bypass(host):
        return None
    proxies = urllib.request.getproxies()
    return proxies.get("https") or proxies.get("http") or None


def _close_socket_mode(client: SocketModeClient) -> None:
    """Close slack-sdk's Socket Mode client and join its threads. Blocking.

    Its reader thread sits in recv() for up to 3 s holding the lock that close() needs, and its
    message thread polls a queue every second: shutting the socket down and queueing a wake-up
    first lets close() return at once.
    """
    client.closed = True
    client.auto_reconnect_enabled = False
    # The session monitor reconnects whenever auto_reconnect is on, which a connect still under way turns
    # back on: its thread ends at its next round, and one such a connect starts ends at once.
    client.current_app_monitor.event.set()
    client.current_session_state.terminated = True
    session = client.current_session
    if session is not None and session.sock is not None:
        with contextlib.suppress(OSError):
            session.sock.shutdown(socket.SHUT_RDWR)
    client.message_queue.put(None)
    try:
        client.close()
        # A `disconnect` frame handled meanwhile may have opened (and switched to) a new connection.
        client.auto_reconnect_enabled = False
        client.current_app_monitor.shutdown()
        client.disconnect()
    except Exception:  # slack-sdk's reconnect and close race on its connection objects
        logger.debug("closing the Socket Mode client raced with a reconnect", exc_info=True)


# ── The plugin ──────────────────────────────────────────────────────────────────────────────


class SlackPlugin(BasePlugin):
    """Answers Slack mentions, DMs and thread replies, one agent session per thread."""

    PLUGIN_NAME = "plugin_client_slack"
    PLUGIN_VERSION = "1.0.0"
    PLUGIN_TYPE = "client_interface"
    CLIENT_NAMESPACES = {PREFIX: plugin_api.SLACK}
    DESCRIPTION = "Slack thread bot: Socket Mode in, chat.postMessage out"
    DEPENDENCIES = ["slack-sdk>=3.30", "slackify-markdown>=0.2.4"]
    ENV_VARS = ["SLACK_BOT_TOKEN", "SLACK_APP_TOKEN"]

    def __init__(self) -> None:
        super().__init__()
        self.settings = SlackSettings()
        self.web: WebClient | None = None
        self.socket: SocketModeClient | None = None
        self.filter: EventFilter | None = None
        self.problem = "not started"
        self.stats: Counter[str] = Counter()
        self.ignored: Counter[str] = Counter()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._connecting: asyncio.Task[None] | None = None
        self._thread_call: asyncio.Future[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        #: client id → the latest answer of that thread; the next one waits for it.
        self._latest: dict[str, asyncio.Task[None]] = {}
        self._users: OrderedDict[str, str] = OrderedDict()
        self._stopping = False
        #: Several instances on one store: threads whose session another instance holds, and the
        #: events being checked against Redis (see _dispatch_shared).
        self._shared_threads: OrderedDict[str, None] = OrderedDict()
        self._pending_events: set[asyncio.Future[None]] = set()
        #: Gates routed to approvers, posted with buttons (only with an `approvals` section).
        self.approvals: SlackApprovals | None = None
        self._approvals_task: asyncio.Task[None] | None = None

    # ── lifecycle ──

    async def init(self, config: dict[str, Any]) -> bool:
        self.settings = parse_settings(self.PLUGIN_NAME, SlackSettings, config)
        env = self.ctx.config.env
        bot_token, app_token = env.get("SLACK_BOT_TOKEN", "").strip(), env.get("SLACK_APP_TOKEN", "").strip()
        if not bot_token.startswith("xoxb-"):
            logger.error("plugin_client_slack: SLACK_BOT_TOKEN must be the app's bot token (xoxb-…), "
                         "from OAuth & Permissions of the Slack app")
            return False
        if not app_token.startswith("xapp-"):
            logger.error("plugin_client_slack: SLACK_APP_TOKEN must be an app-level token (xapp-…) with the "
                         "connections:write scope, from Basic Information of the Slack app")
            return False
        self._loop = asyncio.get_running_loop()
        base_url = self.settings.api_base_url
        proxy = proxy_for(base_url)
        self.web = WebClient(
            token=bot_token, base_url=base_url, timeout=30, proxy=proxy,
            retry_handlers=[ConnectionErrorRetryHandler(), RateLimitErrorRetryHandler(max_retry_count=3)],
        )
        self.web.proxy = proxy  # the constructor falls back to HTTPS_PROXY when given None
        # One listener thread: envelopes reach the event loop in the order they arrived (a listener
        # only acks and hands over, so one thread keeps up).
        self.socket = SocketModeClient(
            app_token=app_token, web_client=self.web, ping_interval=self.settings.ping_interval, concurrency=1,
            proxy=proxy, logger=logging.getLogger("agent_mcp.slack.socket"),
        )
        self.socket.proxy = proxy
        if self.ctx.gate.desk is not None:
            self.approvals = SlackApprovals(self.ctx, self.web)
            self._approvals_task = asyncio.create_task(self.approvals.run(), name="slack:approvals")
        self.socket.message_listeners.append(self._on_frame)
        self.socket.socket_mode_request_listeners.append(self._on_request)
        try:
            await asyncio.to_thread(self._identify)
        except SlackApiError as exc:
            logger.error("plugin_client_slack: Slack refused the tokens (%s); check SLACK_BOT_TOKEN and "
                         "SLACK_APP_TOKEN in .env", exc.response.get("error"))
            await self.shutdown()
            return False
        except OSError as exc:
            logger.warning("plugin_client_slack: cannot reach Slack at %s (%s); retrying in the background",
                           base_url, describe(exc))
            self.problem = f"cannot reach Slack: {describe(exc)}"
            self._connecting = asyncio.create_task(self._connect_with_retries(), name="slack:connect")
            return True
        except Exception:
            await self.shutdown()  # the Socket Mode client already runs threads
            raise
        self._connecting = asyncio.create_task(self._connect_with_retries(first=True), name="slack:connect")
        return True

    def _identify(self) -> None:
        """Who the bot is (auth.test, for self-filtering) and a Socket Mode URL. Blocking."""
        assert self.web is not None and self.socket is not None
        auth = self.web.auth_test()
        self.filter = EventFilter(str(auth["user_id"]), auth.get("bot_id"), self._is_bot_thread)
        self.socket.wss_uri = self.socket.issue_new_wss_url()
        self.problem = "connecting"

    async def _connect_with_retries(self, first: bool = False) -> None:
        """Open the Socket Mode connection, retrying while Slack cannot be reached.

        Once connected, slack-sdk's client replaces lost connections itself.
        """
        assert self.socket is not None

        def unreachable(retry: RetryCallState) -> None:
            exc = retry.outcome.exception() if retry.outcome else None
            self.problem = f"cannot reach Slack: {describe(exc) if exc else 'unknown error'}"

        try:
            async for attempt in AsyncRetrying(
                wait=wait_exponential(multiplier=1, max=60),
                retry=retry_if_exception(lambda exc: isinstance(exc, OSError | SlackClientError)
                                         and not isinstance(exc, SlackApiError)),
                before_sleep=unreachable, reraise=True,
            ):
                with attempt:
                    if not (first and attempt.retry_state.attempt_number == 1):
                        await self._in_thread(self._identify)
                    await self._in_thread(self.socket.connect)
        except SlackApiError as exc:
            self.problem = f"Slack refused the tokens ({exc.response.get('error')})"
            logger.error("plugin_client_slack: %s; fix .env and restart", self.problem)

    async def _in_thread(self, fn: Callable[[], None]) -> None:
        # Shielded: a blocking connect keeps running when its task is cancelled, and shutdown
        # waits for it so that no connection is opened after the client is closed.
        self._thread_call = asyncio.ensure_future(asyncio.to_thread(fn))
        await asyncio.shield(self._thread_call)

    async def shutdown(self) -> None:
        self._stopping = True
        # Answers whose request the server just cancelled still post their "(cancelled)" ending.
        answers = [t for t in self._tasks if not t.done()]
        if answers:
            await asyncio.wait(answers, timeout=SHUTDOWN_GRACE)
        if self.approvals is not None:
            await self.approvals.stop()
        tasks = [t for t in (*self._tasks, self._connecting, self._approvals_task) if t is not None and not t.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=SHUTDOWN_GRACE)
        if self._thread_call is not None and not self._thread_call.done():
            await asyncio.wait([self._thread_call], timeout=SHUTDOWN_GRACE)
        if self.socket is not None:
            await asyncio.to_thread(_close_socket_mode, self.socket)
        self.socket = self.web = self._connecting = self._approvals_task = self.approvals = None
        self.problem = "stopped"

    def get_config(self) -> dict[str, Any]:
        env = self.context.config.env if self.context else {}
        return {
            "host": self.settings.host,
            "port": self.settings.port,
            "name": "Slack bot status",
            "token": env.get(self.settings.token_env) or None,
            "allowed_hosts": self.settings.allowed_hosts,
            "allowed_origins": self.settings.allowed_origins,
        }

    def get_routes(self) -> list[Route]:
        return [
            Route("/slack/health", self.health, methods=["GET"]),
            Route("/slack/status", self.status, methods=["GET"]),
        ]

    def get_help(self) -> str:
        routed = " (unless approvers are configured: then with buttons)" if self.approvals else ""
        return ("Slack: mention the bot in a channel or send it a direct message; it answers in the thread, "
                f"one session per thread. Tools that need approval are refused there{routed}.")

    # ── inbound ──

    def _on_frame(self, client: Any, message: dict[str, Any], raw: str | None) -> None:
        # A Socket Mode thread: hand over to the event loop.
        if message.get("type") == "hello":
            self._call_in_loop(self._connected_once)

    def _connected_once(self) -> None:
        self.stats["connections"] += 1
        self.problem = ""

    def _on_request(self, client: BaseSocketModeClient, req: SocketModeRequest) -> None:
        """A Socket Mode thread: ack the envelope at once (Slack redelivers what is not acked in 3 s)."""
        text = "Slash commands are not supported: mention the bot or send it a direct message."
        payload = {"text": text} if req.type == "slash_commands" else None
        try:
            client.send_socket_mode_response(SocketModeResponse(req.envelope_id, payload=payload))
        except Exception as exc:  # the connection is being replaced: Slack delivers the event again
            logger.warning("slack: could not acknowledge an envelope (%s); it will be redelivered", describe(exc))
        self._call_in_loop(self._dispatch, req.type, req.payload)

    def _call_in_loop(self, fn: Callable[..., None], *args: Any) -> None:
        if self._loop is not None and not self._stopping:
            with contextlib.suppress(RuntimeError):  # the loop is closing
                self._loop.call_soon_threadsafe(fn, *args)

    def _dispatch(self, kind: str, payload: dict[str, Any]) -> None:
        """In the event loop: filter the acknowledged envelope and start its answer."""
        self.stats["envelopes"] += 1
        if kind == "interactive" and self.approvals is not None and self.approvals.on_interactive(payload):
            return
        if kind != "events_api" or self.filter is None:
            self._ignore(f"{kind} envelope")
            return
        if self.ctx.values is not None:  # several instances: Slack may deliver a repeat to another one
            self._pending_events.add(asyncio.ensure_future(self._dispatch_shared(self.ctx.values, payload)))
            return
        self._handle(self.filter.accept(payload))

    def _handle(self, accepted: InboundMessage | str) -> None:
        if isinstance(accepted, str):
            self._ignore(accepted)
            return
        self.stats["messages"] += 1
        self._remember_user(accepted)
        self._start_answer(accepted)

    async def _dispatch_shared(self, values: plugin_api.PluginValues, payload: dict[str, Any]) -> None:
        """`_dispatch` when instances share a store: a thread is the bot's when its session exists on any
        instance, and an event or message is handled by the first instance that claims it in Redis."""
        event = payload.get("event") or {}
        try:
            thread = f"{PREFIX}{event.get('channel')}-{event.get('thread_ts')}"
            if event.get("thread_ts") and await self.ctx.sessions.exists(thread):
                self._shared_threads[thread] = None
                while len(self._shared_threads) > SEEN_MEMORY:
                    self._shared_threads.popitem(last=False)
            event_id = payload.get("event_id")
            if event_id and not await values.put(f"slack-event:{event_id}", "1", DEDUPE_SECONDS, only_new=True):
                self._ignore("repeated delivery of an event (handled by another instance)")
                return
            assert self.filter is not None
            accepted = self.filter.accept(payload)
            if isinstance(accepted, InboundMessage) and not await values.put(
                    f"slack-message:{accepted.channel}:{accepted.ts}", "1", DEDUPE_SECONDS, only_new=True):
                accepted = "message already handled (by another instance)"
            self._handle(accepted)
        except plugin_api.SessionError as exc:
            logger.error("slack: an event was not handled: %s", exc)
        finally:
            self._pending_events.discard(asyncio.current_task())

    def _ignore(self, reason: str) -> None:
        self.ignored[reason] += 1
        logger.debug("slack: ignored %s", reason)

    def _remember_user(self, msg: InboundMessage) -> None:
        self._users[msg.client_id] = msg.user
        self._users.move_to_end(msg.client_id)
        if len(self._users) > SEEN_MEMORY:
            self._users.popitem(last=False)

    def _is_bot_thread(self, client_id: str) -> bool:
        return (client_id in self._latest or client_id in self._shared_threads
                or self.ctx.sessions.get(client_id) is not None)

    def _start_answer(self, msg: InboundMessage) -> None:
        previous = self._latest.get(msg.client_id)
        task = asyncio.create_task(self._answer(msg, previous), name=f"slack:{msg.client_id}")
        self._latest[msg.client_id] = task
        self._tasks.add(task)

        def forget(t: asyncio.Task[None]) -> None:
            self._tasks.discard(t)
            if self._latest.get(msg.client_id) is t:
                del self._latest[msg.client_id]

        task.add_done_callback(forget)

    async def _answer(self, msg: InboundMessage, previous: asyncio.Task[None] | None) -> None:
        """Answer one message in its thread, after the thread's previous answer is complete."""
        if previous is not None:
            await asyncio.wait([previous])
        if self._stopping or self.web is None:
            return
        reply = Reply(self.web, self.settings, msg.channel, msg.thread_ts)
        poster = asyncio.create_task(reply.run(), name=f"slack-post:{msg.client_id}")
        asked = self.ctx.request(msg.client_id, msg.text, default_model=self.settings.default_model,
                                 identity=f"slack:{msg.user}")
        try:
            async for ev in self.ctx.run_turn(asked, cancel_running=False):
                reply.feed(ev)
        except asyncio.CancelledError:
            poster.cancel()
            raise
        except plugin_api.Stopping as exc:  # the server stopped before this message's turn could start
            reply.errors.append(str(exc))
        except Exception as exc:
            logger.exception("slack: request of %s failed", msg.client_id)
            reply.errors.append(f"internal error: {type(exc).__name__}")
        reply.finish()
        try:
            await poster
        except Exception:
            logger.exception("slack: posting the answer in %s failed", msg.client_id)
        self.stats["answers"] += 1
        self.stats["posts"] += reply.posted

    # ── HTTP ──

    def _sessions(self) -> list[plugin_api.Session]:
        return [s for s in self.ctx.sessions.all() if s.client_id.startswith(PREFIX)]

    def _connected(self) -> bool:
        return self.socket is not None and self.socket.is_connected()

    async def health(self, request: Request) -> JSONResponse:
        connected = self._connected()
        body = {
            "status": "healthy" if connected else "disconnected",
            "plugin": self.PLUGIN_NAME,
            "version": self.PLUGIN_VERSION,
            "enabled": self.enabled,
            "connected": connected,
            "active_sessions": len(self._sessions()),
        }
        if not connected:
            body["detail"] = self.problem or "Socket Mode connection lost; reconnecting"
        return JSONResponse(body, status_code=200 if connected else 503)

    async def status(self, request: Request) -> JSONResponse:
        rows = []
        for s in self._sessions():
            m = SLACK_CLIENT_ID.match(s.client_id)
            rows.append({"session_id": s.client_id, "shorthand_id": s.shorthand,
                         "channel_id": m["channel"] if m else None, "thread_ts": m["thread_ts"] if m else None,
                         "user_id": self._users.get(s.client_id), "history_length": len(s.history)})
        return JSONResponse({
            "plugin": self.PLUGIN_NAME,
            "connected": self._connected(),
            "bot_user_id": self.filter.bot_user_id if self.filter else None,
            "connections": self.stats["connections"],
            "envelopes": self.stats["envelopes"],
            "messages": self.stats["messages"],
            "answers": self.stats["answers"],
            "answering": len(self._latest),
            "ignored": dict(self.ignored),
            **({"approvals": dict(self.approvals.stats)} if self.approvals is not None else {}),
            "active_sessions": len(rows),
            "sessions": rows,
        })
