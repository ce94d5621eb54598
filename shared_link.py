"""Several instances on one Redis (`SESSION_STORE=redis://host:port/db`): the connection, and what lives where.

Everything two instances could disagree about lives in Redis itself, under one key prefix
(`?prefix=name:` on the URL, default `agent-mcp:`), read when it is used:

- sessions: a hash per session (`session:<id>`: shorthand, updated, record JSON), an index by
  shorthand id (`sessions`), the shorthand counter (`shorthand`, INCR: unique across instances),
  the sessions whose turn is running (`running`) and why removed ones went (`gone:<id>`);
- the turn lease of a session (`lease:<id>`, SET NX PX): the instance running a turn renews it;
  when that instance dies the lease lapses and another instance ends the turn (SessionManager.recover);
- event streams (`events:<id>`, a Redis Stream of bounded length): every instance reads them, so a
  subscriber anywhere sees every event and resumes by `Last-Event-ID`;
- pending gates (`gate:<id>`) and their answers (`answer:<id>`, a list the asking turn pops);
- rate-limit windows (`rate:<id>:<type>`, sorted sets) and disabled tool types (`disabled:<id>`);
- small values of plugins (`value:<name>`): de-duplication keys, fingerprints, turn cursors;
- gates routed to approvers (`approval:<id>`, `approvals`) and shell windows that approve (`approver:<id>`).

This module holds the connection (`Link`: the pool, the key prefix, whether Redis answers) and the
signals between instances; the session store is `shared_store.py`, event streams `shared_events.py`,
gates `shared_gates.py`, rate windows and plugin values `shared_values.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import uuid
from collections.abc import Awaitable, Callable, Iterator
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import metrics
import stores

logger = logging.getLogger("agent_mcp.shared")

DEFAULT_PREFIX = "agent-mcp:"
#: Longest wait of one blocking read (below the socket timeout, so a dead server is noticed).
BLOCK_MS = 1000
SOCKET_TIMEOUT = 5.0


class StoreUnavailable(stores.SessionError):
    """Redis cannot be reached; the message names it and says what to do."""


async def stop_task(task: asyncio.Task[Any]) -> None:
    """Cancel a background task and wait for its end, cancelling again while it runs on: redis-py's
    asyncio.wait_for (Python 3.11) can swallow a cancellation that comes as a command's send finishes
    (`Link.calling` catches that inside its calls; a loop's call outside one would otherwise run on, and
    closing would wait for it forever). Its exception, if it failed, is raised."""
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=0.5)
    with contextlib.suppress(asyncio.CancelledError):
        await task


def is_redis_url(url: str | None) -> bool:
    return bool(url) and str(url).strip().startswith(("redis://", "rediss://", "unix://"))


def split_prefix(url: str) -> tuple[str, str]:
    """(the URL for redis-py, the key prefix) from a SESSION_STORE URL with an optional `prefix` parameter.
    A URL redis-py would misread (it takes a database that is not a number for 0) is refused."""
    parts = urlsplit(url.strip())
    shown = f"{parts.scheme}://{where(url)}{parts.path}"  # never the password
    if parts.scheme != "unix":
        if not parts.hostname:
            raise stores.SessionError(f"SESSION_STORE={shown!r} names no host: write redis://host:port/db")
        if parts.path.strip("/") and not parts.path.strip("/").isdigit():
            raise stores.SessionError(f"SESSION_STORE={shown!r}: the database after the port must be a number "
                                     "(redis://host:port/0; a default Redis has 0 to 15)")
    query = parse_qsl(parts.query, keep_blank_values=True)
    prefix = next((v for k, v in query if k == "prefix"), DEFAULT_PREFIX)
    if not prefix:
        raise stores.SessionError(f"SESSION_STORE={shown!r}: prefix= is empty, so agent-mcp's keys would mix with "
                                 f"everything else in that database; leave it out for the default {DEFAULT_PREFIX!r}")
    rest = urlencode([(k, v) for k, v in query if k != "prefix"])
    return urlunsplit(parts._replace(query=rest)), prefix


def where(url: str) -> str:
    """The Redis server of a URL without its password, for messages."""
    parts = urlsplit(url.strip())
    if parts.scheme == "unix":
        return parts.path
    try:
        port = parts.port or 6379
    except ValueError:
        raise stores.SessionError(f"SESSION_STORE={parts.scheme}://{parts.hostname or ''}:…: the port must be a number "
                                 "from 1 to 65535 (Redis listens on 6379)") from None
    return f"{parts.hostname or 'localhost'}:{port}"


class Link:
    """One Redis connection pool, its key prefix, and whether Redis answered lately.

    `down` is the reason Redis failed its last command (None when it answers); while down, a
    background ping notices when it is back, so the instance recovers by itself.
    """

    def __init__(self, url: str):
        self.url, self.prefix = split_prefix(url)
        self.where = where(self.url)
        # redis-py (about 8 MiB of code) is imported with the first Link: a server whose sessions are in
        # SQLite or in memory never loads it. Everything else here talks to Redis through a Link.
        import redis.asyncio as aioredis
        from redis import exceptions
        from redis.asyncio.retry import Retry
        from redis.backoff import ExponentialBackoff

        #: What a command raises when Redis cannot be reached; `failed` adds every other Redis error.
        self.lost: tuple[type[BaseException], ...] = (exceptions.ConnectionError, exceptions.TimeoutError, OSError)
        self.failed = (*self.lost, exceptions.RedisError)
        #: A command Redis refused (in a pipeline's results: another instance wrote a stream further ahead).
        self.refused = exceptions.ResponseError
        # A command on a pooled connection that died with a restarted Redis is sent again on a new one.
        # decode_responses: every reply is str (or None), where redis-py's annotations say bytes | str whatever the
        # option; so the callers declare the str types they get (`# type: ignore[assignment]  # decoded: str`).
        self.client = aioredis.Redis.from_url(self.url, decode_responses=True, socket_timeout=SOCKET_TIMEOUT,
                                              socket_connect_timeout=2.0,
                                              retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), 3),
                                              retry_on_error=[exceptions.ConnectionError, exceptions.TimeoutError])
        self.down: str | None = None
        #: Counts round trips and failures (build_runtime gives it the runtime's metrics).
        self.metrics: metrics.Metrics = metrics.OFF
        self.instance = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self._pinger: asyncio.Task[None] | None = None

    def key(self, *parts: str) -> str:
        return self.prefix + ":".join(parts)

    def unavailable(self, exc: BaseException) -> StoreUnavailable:
        """Record that Redis failed and the error that says so."""
        if self.down is None:
            logger.error("Redis at %s is unreachable (%s); requests get 503 until it is back", self.where, exc)
        self.down = (str(exc) or type(exc).__name__).rstrip(".")
        if self._pinger is None or self._pinger.done():
            with contextlib.suppress(RuntimeError):
                self._pinger = asyncio.get_running_loop().create_task(self._ping_until_back(), name="redis-ping")
        return StoreUnavailable(self.unavailable_message() or "")

    def unavailable_message(self) -> str | None:
        """Why requests cannot be served now, or None. Clients are not told where Redis is (the log says)."""
        if self.down is None:
            return None
        return ("the session store (Redis) is unreachable; try again in a moment: this server recovers by itself "
                "when Redis is back")

    @contextlib.contextmanager
    def calling(self) -> Iterator[None]:
        """One Redis round trip (counted): connection failures become StoreUnavailable (and Redis is noted down).

        A task cancelled during the call ends there even when redis-py lost the cancellation: it sends through
        asyncio.wait_for, which on Python 3.11 returns the result instead when the send has just finished. Lost,
        the task would run on: a stopped or deleted session's turn, or the session manager's recovery loop,
        which closing the store then waits for forever."""
        task = asyncio.current_task()
        asked = task.cancelling() if task is not None else 0
        self.metrics.redis_round_trip()
        try:
            yield
        except self.lost as exc:
            self.metrics.redis_failed()
            raise self.unavailable(exc) from None
        if task is not None and task.cancelling() > asked:
            raise asyncio.CancelledError

    async def _ping_until_back(self) -> None:
        while self.down is not None:
            await asyncio.sleep(0.5)
            with contextlib.suppress(*self.failed):
                await self.client.ping()
                logger.warning("Redis at %s answers again", self.where)
                self.down = None

    async def open(self) -> None:
        try:
            await self.client.ping()
        except self.failed as exc:
            why = str(exc).rstrip(".")
            raise StoreUnavailable(f"SESSION_STORE: cannot reach Redis at {self.where} ({why}); start it, or fix "
                                   "the URL (redis://host:port/db), or unset SESSION_STORE for the embedded "
                                   "SQLite store") from None

    async def close(self) -> None:
        if self._pinger is not None:
            self._pinger.cancel()
        await self.client.aclose()


class Signals:
    """Messages every other instance acts on: cancel or stop a session's requests (`cancel`, `stop`),
    and whatever plugins register (`on`). One Redis pub/sub channel that each instance listens to; an
    instance ignores what it sent itself."""

    def __init__(self, link: Link):
        self.link = link
        self._listener: asyncio.Task[None] | None = None
        self._handling: set[asyncio.Future[Any]] = set()
        self._handlers: dict[str, Callable[[str], Awaitable[Any]]] = {}

    async def send(self, what: str, subject: str) -> None:
        with self.link.calling():
            await self.link.client.publish(self.link.key("signals"), json.dumps([self.link.instance, what, subject]))

    def on(self, what: str, handler: Callable[[str], Awaitable[Any]]) -> Callable[[], None]:
        """Call `handler(subject)` for every `what` another instance sends; returns the function that stops it."""
        self._handlers[what] = handler

        def stop() -> None:
            if self._handlers.get(what) is handler:
                self._handlers.pop(what, None)
        return stop

    def start(self) -> None:
        """Listen until `close`."""
        self._listener = asyncio.create_task(self._listen(), name="signals")

    async def _listen(self) -> None:
        while True:
            try:
                async with self.link.client.pubsub() as channel:
                    await channel.subscribe(self.link.key("signals"))
                    while True:
                        message = await channel.get_message(ignore_subscribe_messages=True, timeout=BLOCK_MS / 1000)
                        if message is None:
                            continue
                        sender, what, subject = json.loads(message["data"])
                        handler = self._handlers.get(what)
                        if sender != self.link.instance and handler is not None:
                            work = asyncio.ensure_future(handler(subject))
                            self._handling.add(work)
                            work.add_done_callback(self._handled)
            except self.link.failed as exc:
                self.link.unavailable(exc)
                await asyncio.sleep(0.5)

    def _handled(self, work: asyncio.Future[Any]) -> None:
        self._handling.discard(work)
        if not work.cancelled() and work.exception() is not None:
            logger.error("acting on another instance's signal failed", exc_info=work.exception())

    async def close(self) -> None:
        if self._listener is not None:
            await stop_task(self._listener)
