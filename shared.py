"""Several instances on one Redis (`SESSION_STORE=redis://host:port/db`): what they share, and how.

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

Event ids are microsecond-like integers as on one instance, chosen by the publishing instance from its
clock (each above the last). A stream entry holds a run of one session's events, written in one round
trip; its stream id `ms-n` is the last event's id (`ms * 1000 + n`, n < 1000), so a reader resuming
after any event id reads from the entry that holds the next one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

import metrics
import state
import stores

logger = logging.getLogger("agent_mcp.shared")

DEFAULT_PREFIX = "agent-mcp:"
#: A turn lease lapses this long after its last renewal (its instance died); renewed every third of it.
LEASE_SECONDS = 5.0
#: How often a waiting request tries a taken lease again.
LEASE_POLL_SECONDS = 0.05
#: Longest wait of one blocking read (below the socket timeout, so a dead server is noticed).
BLOCK_MS = 1000
SOCKET_TIMEOUT = 5.0
#: Why a removed session went, kept this long for a client that comes back.
GONE_SECONDS = 30 * 86400
#: A deleted session's stream lingers this long, so its subscribers read what it had sent.
DROPPED_STREAM_SECONDS = 30
#: While events keep coming (one written less than STREAMING_SECONDS ago), the writer gathers them this
#: long before a round trip, so a streamed answer costs a few writes instead of one per token.
COALESCE_SECONDS = 0.005
STREAMING_SECONDS = 0.05
#: Events an instance keeps queued for Redis while it is unreachable; beyond this the oldest go.
MAX_QUEUED_EVENTS = 20_000

_DOWN = (RedisConnectionError, RedisTimeoutError, OSError)


class StoreUnavailable(state.SessionError):
    """Redis cannot be reached; the message names it and says what to do."""


def is_redis_url(url: str | None) -> bool:
    return bool(url) and str(url).strip().startswith(("redis://", "rediss://", "unix://"))


def split_prefix(url: str) -> tuple[str, str]:
    """(the URL for redis-py, the key prefix) from a SESSION_STORE URL with an optional `prefix` parameter.
    A URL redis-py would misread (it takes a database that is not a number for 0) is refused."""
    parts = urlsplit(url.strip())
    shown = f"{parts.scheme}://{where(url)}{parts.path}"  # never the password
    if parts.scheme != "unix":
        if not parts.hostname:
            raise state.SessionError(f"SESSION_STORE={shown!r} names no host: write redis://host:port/db")
        if parts.path.strip("/") and not parts.path.strip("/").isdigit():
            raise state.SessionError(f"SESSION_STORE={shown!r}: the database after the port must be a number "
                                     "(redis://host:port/0; a default Redis has 0 to 15)")
    query = parse_qsl(parts.query, keep_blank_values=True)
    prefix = next((v for k, v in query if k == "prefix"), DEFAULT_PREFIX)
    if not prefix:
        raise state.SessionError(f"SESSION_STORE={shown!r}: prefix= is empty, so agent-mcp's keys would mix with "
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
        raise state.SessionError(f"SESSION_STORE={parts.scheme}://{parts.hostname or ''}:…: the port must be a number "
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
        # A command on a pooled connection that died with a restarted Redis is sent again on a new one.
        self.client = aioredis.Redis.from_url(self.url, decode_responses=True, socket_timeout=SOCKET_TIMEOUT,
                                              socket_connect_timeout=2.0,
                                              retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), 3),
                                              retry_on_error=[RedisConnectionError, RedisTimeoutError])
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
        """One Redis round trip (counted): connection failures become StoreUnavailable (and Redis is noted down)."""
        self.metrics.redis_round_trip()
        try:
            yield
        except _DOWN as exc:
            self.metrics.redis_failed()
            raise self.unavailable(exc) from None

    async def _ping_until_back(self) -> None:
        while self.down is not None:
            await asyncio.sleep(0.5)
            with contextlib.suppress(*_DOWN, RedisError):
                await self.client.ping()
                logger.warning("Redis at %s answers again", self.where)
                self.down = None

    async def open(self) -> None:
        try:
            await self.client.ping()
        except (*_DOWN, RedisError) as exc:
            why = str(exc).rstrip(".")
            raise StoreUnavailable(f"SESSION_STORE: cannot reach Redis at {self.where} ({why}); start it, or fix "
                                   "the URL (redis://host:port/db), or unset SESSION_STORE for the embedded "
                                   "SQLite store") from None

    async def close(self) -> None:
        if self._pinger is not None:
            self._pinger.cancel()
        await self.client.aclose()


# ── Sessions ────────────────────────────────────────────────────────────────────────────────

#: Save a session (one round trip): its hash, the index by shorthand id, the running set; unless it must
#: exist already (ARGV[6] = 0) and another instance removed it, or it is saved under a turn lease (ARGV[7])
#: that this instance no longer holds.
_SAVE = """if ARGV[6] == '0' and redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
if ARGV[7] ~= '' and redis.call('GET', KEYS[4]) ~= ARGV[7] then return 0 end
redis.call('HSET', KEYS[1], 'shorthand', ARGV[2], 'updated', ARGV[3], 'record', ARGV[4])
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[1])
if ARGV[5] == '1' then redis.call('SADD', KEYS[3], ARGV[1]) else redis.call('SREM', KEYS[3], ARGV[1]) end
return 1"""
_RELEASE = """if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"""
_RENEW = """if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0"""


class RedisStore(stores.SessionStore):
    """Sessions in Redis, shared by every instance that names the same server and prefix."""

    shared = True

    def __init__(self, link: Link):
        self.link = link
        self.r = link.client
        self._save = self.r.register_script(_SAVE)
        self._beating: asyncio.Task[None] | None = None
        #: The turn leases this instance holds: client id → its token (saves under a lease are fenced by it).
        self._held: dict[str, str] = {}

    def _key(self, kind: str, client_id: str = "") -> str:
        return self.link.key(kind, client_id) if client_id else self.link.key(kind)

    async def open(self) -> None:
        await self.link.open()
        with self.link.calling():  # the first id handed out is FIRST_SHORTHAND
            await self.r.set(self._key("shorthand"), state.FIRST_SHORTHAND - 1, nx=True)
        await self._beat()
        self._beating = asyncio.create_task(self._beat_forever(), name="instance-heartbeat")

    async def close(self) -> None:
        if self._beating is not None:
            self._beating.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._beating
            with contextlib.suppress(*_DOWN, RedisError):
                await self.r.zrem(self._key("instances"), self.link.instance)  # a stopped instance leaves at once
        await self.link.close()

    async def _beat(self) -> None:
        """Say this instance is alive for the next LEASE_SECONDS (instances that stop saying so drop out)."""
        now = time.time()
        pipe = self.r.pipeline(transaction=False)
        pipe.zadd(self._key("instances"), {self.link.instance: now + LEASE_SECONDS})
        pipe.zremrangebyscore(self._key("instances"), "-inf", now)
        await pipe.execute()

    async def _beat_forever(self) -> None:
        while True:
            await asyncio.sleep(LEASE_SECONDS / 3)
            try:
                await self._beat()
            except (*_DOWN, RedisError) as exc:
                self.link.unavailable(exc)

    async def instances(self) -> int:
        with self.link.calling():
            return int(await self.r.zcount(self._key("instances"), time.time(), "+inf"))

    def describe(self) -> str:
        return f"Redis at {self.link.where}, keys under {self.link.prefix!r} (this instance: {self.link.instance})"

    @staticmethod
    def _session(client_id: str, fields: dict[str, str]) -> state.Session | None:
        if not fields:
            return None
        try:
            return state.Session.from_record(client_id, int(fields["shorthand"]), json.loads(fields["record"]),
                                             float(fields["updated"]))
        except (ValueError, KeyError, TypeError) as exc:
            logger.error("session %s in Redis is damaged and was skipped: %s", client_id, exc)
            return None

    async def fetch(self, client_id: str) -> state.Session | None:
        with self.link.calling():
            return self._session(client_id, await self.r.hgetall(self._key("session", client_id)))

    async def fetch_all(self) -> list[state.Session]:
        with self.link.calling():
            ids = await self.r.zrange(self._key("sessions"), 0, -1)
            pipe = self.r.pipeline(transaction=False)
            for client_id in ids:
                pipe.hgetall(self._key("session", client_id))
            rows = await pipe.execute() if ids else []
        found = (self._session(c, f) for c, f in zip(ids, rows, strict=True))
        return [s for s in found if s is not None]

    async def allocate_shorthand(self) -> int:
        with self.link.calling():
            return int(await self.r.incr(self._key("shorthand")))

    async def save(self, session: state.Session, last_shorthand: int, *, create: bool = True) -> bool:
        keys = [self._key("session", session.client_id), self._key("sessions"), self._key("running"),
                self._key("lease", session.client_id)]
        with self.link.calling():
            return bool(await self._save(keys, [
                session.client_id, session.shorthand, session.updated,
                json.dumps(session.to_record(), ensure_ascii=False), int(bool(session.running)), int(create),
                self._held.get(session.client_id, "")]))

    async def delete(self, client_id: str) -> None:
        with self.link.calling():
            pipe = self.r.pipeline(transaction=True)
            pipe.delete(self._key("session", client_id))
            pipe.zrem(self._key("sessions"), client_id)
            pipe.srem(self._key("running"), client_id)
            await pipe.execute()

    async def mark_gone(self, client_id: str, why: str) -> None:
        with self.link.calling():
            await self.r.set(self._key("gone", client_id), why, ex=GONE_SECONDS)

    async def take_gone(self, client_id: str) -> str | None:
        with self.link.calling():
            return await self.r.getdel(self._key("gone", client_id))

    @contextlib.asynccontextmanager
    async def lease(self, client_id: str, holder: str) -> AsyncIterator[None]:
        """The session's turn lease: taken when free (tried again every LEASE_POLL_SECONDS), renewed while
        held, given back at the end. If its instance dies it lapses after LEASE_SECONDS. An instance that
        finds it lost (paused, or cut from Redis, for longer) cancels the holder with state.LEASE_LOST, and
        its saves of the session are refused meanwhile: another instance has ended that turn."""
        key, token, ms = self._key("lease", client_id), f"{self.link.instance}:{holder}", int(LEASE_SECONDS * 1000)
        with self.link.calling():
            while not await self.r.set(key, token, nx=True, px=ms):  # noqa: ASYNC110 (the holder may be elsewhere)
                await asyncio.sleep(LEASE_POLL_SECONDS)
        self._held[client_id] = token
        renewer = asyncio.get_running_loop().create_task(
            self._renew(key, token, ms, asyncio.current_task()), name=f"lease:{client_id}")
        try:
            yield
        finally:
            renewer.cancel()
            if self._held.get(client_id) == token:
                del self._held[client_id]
            with contextlib.suppress(*_DOWN, RedisError):  # unreachable: it lapses by itself
                await self.r.eval(_RELEASE, 1, key, token)

    async def _renew(self, key: str, token: str, ms: int, holder: asyncio.Task[Any] | None) -> None:
        while True:
            await asyncio.sleep(LEASE_SECONDS / 3)
            try:
                if not await self.r.eval(_RENEW, 1, key, token, ms):
                    logger.error("lost the turn lease %s (this instance was paused, or cut off from Redis, for over "
                                 "%g s): another instance has ended that turn; it stops here and is not saved",
                                 key, LEASE_SECONDS)
                    if holder is not None:
                        holder.cancel(state.LEASE_LOST)
                    return
            except (*_DOWN, RedisError) as exc:
                logger.warning("could not renew the turn lease %s: %s", key, exc)

    async def orphans(self) -> list[str]:
        with self.link.calling():
            running = sorted(await self.r.smembers(self._key("running")))
            if not running:
                return []
            pipe = self.r.pipeline(transaction=False)
            for client_id in running:
                pipe.exists(self._key("lease", client_id))
            held = await pipe.execute()
        return [c for c, h in zip(running, held, strict=True) if not h]


# ── Events ──────────────────────────────────────────────────────────────────────────────────

_SEEN = """local now = tonumber(redis.call('GET', KEYS[1]) or '0')
if tonumber(ARGV[1]) > now then redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2]) end return 0"""
#: A stream with no reader for this long expires (a fresh event renews it).
STREAM_SECONDS = 7 * 86400
#: How often a subscriber records how far it has read (see `RedisEventHub.subscribe`).
SEEN_EVERY = 0.5


def stream_id(event_id: int) -> str:
    return f"{event_id // 1000}-{event_id % 1000}"


def event_id(entry_id: str) -> int:
    ms, _, n = entry_id.partition("-")
    return int(ms) * 1000 + int(n or 0)


class RedisEventHub(state.EventHub):
    """The event hub of an instance on a shared store: events go to Redis Streams, subscribers read them.

    `publish` stays synchronous (tokens are published from the model's stream): events are queued
    and one writer task sends them in order, a burst per round trip. Observers see the events this
    instance publishes.
    """

    def __init__(self, link: Link, buffer: int = state.EVENT_BUFFER):
        super().__init__(buffer=buffer)
        self.link = link
        self.r = link.client
        self._last: OrderedDict[str, int] = OrderedDict()
        #: The id of the last event written to each session's stream by this instance (readers tell gaps by it).
        self._written: OrderedDict[str, int] = OrderedDict()
        self._expiry_set: dict[str, float] = {}
        self._queue: asyncio.Queue[tuple[str, state.Event | None]] = asyncio.Queue()
        self._writer: asyncio.Task[None] | None = None
        self._idle = asyncio.Event()
        self._idle.set()
        self._wrote = 0.0

    def _key(self, client_id: str) -> str:
        return self.link.key("events", client_id)

    def _next_id(self, client_id: str) -> int:
        last = self._last.pop(client_id, 0)
        self._last[client_id] = nxt = max(time.time_ns() // 1000, last + 1)
        if len(self._last) > state.MAX_IDLE_CHANNELS * 10:
            self._last.popitem(last=False)
        return nxt

    def publish(self, client_id: str, name: str, data: dict[str, Any] | None = None) -> state.Event:
        turn = state.current_turn()
        event = state.Event(self._next_id(client_id), name, data or {}, turn.id if turn is not None else None)
        self._enqueue((client_id, event))
        if self._observers:
            self._notify(client_id, event)
        return event

    def _enqueue(self, item: tuple[str, state.Event | None]) -> None:
        if self._queue.qsize() >= MAX_QUEUED_EVENTS:
            self._queue.get_nowait()
            logger.error("Redis is unreachable and %d events are queued: the oldest is dropped", MAX_QUEUED_EVENTS)
        self._queue.put_nowait(item)
        self._idle.clear()
        if self._writer is None or self._writer.done():
            self._writer = asyncio.get_running_loop().create_task(self._write_forever(), name="event-writer")

    def last_id(self, client_id: str) -> int:
        """An id below every event this instance publishes from now on (what a request's reader starts after)."""
        return max(self._last.get(client_id, 0), time.time_ns() // 1000)

    def drop(self, client_id: str) -> None:
        self._last.pop(client_id, None)
        self._expiry_set.pop(client_id, None)
        self._enqueue((client_id, None))
        if self._observers:
            self._notify(client_id, None)

    async def _write_forever(self) -> None:
        while True:
            batch = [await self._queue.get()]
            # While a session streams (a write a moment ago), gather its next tokens for a moment: one
            # round trip, one entry; the first event of a burst goes at once.
            streaming = time.monotonic() - self._wrote < STREAMING_SECONDS
            await asyncio.sleep(COALESCE_SECONDS if streaming else 0)
            while not self._queue.empty():
                batch.append(self._queue.get_nowait())
            while True:
                try:
                    await self._write(batch)
                    break
                except (*_DOWN, RedisError) as exc:
                    self.link.unavailable(exc)
                    await asyncio.sleep(0.5)
            self._wrote = time.monotonic()
            if self._queue.empty():
                self._idle.set()

    @staticmethod
    def _entries(batch: list[tuple[str, state.Event | None]]) -> list[tuple[str, list[state.Event] | None]]:
        """The batch as stream writes: consecutive events of one session become one entry (None: a drop)."""
        entries: list[tuple[str, list[state.Event] | None]] = []
        for client_id, event in batch:
            if event is not None and entries and entries[-1][0] == client_id and entries[-1][1] is not None:
                entries[-1][1].append(event)
            else:
                entries.append((client_id, [event] if event is not None else None))
        return entries

    def _add(self, pipe: Any, client_id: str, events: list[state.Event]) -> None:
        prev = self._written.pop(client_id, 0)
        rows = []
        for e in events:
            rows.append([e.id, e.name, e.data, e.turn, prev])
            prev = e.id
        self._written[client_id] = prev
        if len(self._written) > state.MAX_IDLE_CHANNELS * 10:
            self._written.popitem(last=False)
        body = json.dumps(rows, ensure_ascii=False)
        pipe.xadd(self._key(client_id), {"events": body}, id=stream_id(events[-1].id), maxlen=self.buffer,
                  approximate=True)

    async def _write(self, batch: list[tuple[str, state.Event | None]]) -> None:
        """One round trip for the batch: an entry per run of one session's events, carrying the last one's id
        (a reader resuming inside an entry skips the events up to its cursor)."""
        entries = self._entries(batch)
        pipe = self.r.pipeline(transaction=False)
        for client_id, events in entries:
            if events is None:
                pipe.expire(self._key(client_id), DROPPED_STREAM_SECONDS)
                pipe.delete(self.link.key("seen", client_id))
            else:
                self._add(pipe, client_id, events)
        results = iter(await pipe.execute(raise_on_error=False))
        for client_id, events in entries:
            result = next(results)
            if events is None:
                next(results)
            elif isinstance(result, ResponseError):  # another instance wrote this stream further ahead
                await self._append_after_top(client_id, events)
            elif isinstance(result, Exception):
                raise result
        now = time.monotonic()  # a stream's expiry is pushed back at most once a minute
        touched = {c for c, ev in entries if ev and now - self._expiry_set.get(c, -60.0) >= 60}
        if touched:
            pipe = self.r.pipeline(transaction=False)
            for client_id in touched:
                pipe.expire(self._key(client_id), STREAM_SECONDS)
                self._expiry_set[client_id] = now
            await pipe.execute()
            while len(self._expiry_set) > state.MAX_IDLE_CHANNELS * 10:
                self._expiry_set.pop(next(iter(self._expiry_set)))

    async def _append_after_top(self, client_id: str, events: list[state.Event]) -> None:
        """Give `events` ids after the stream's newest entry and add them (again if another write wins)."""
        while True:
            top = await self.r.xrevrange(self._key(client_id), count=1)
            base = event_id(top[0][0]) + 1 if top else time.time_ns() // 1000
            events = [state.Event(base + n, e.name, e.data, e.turn) for n, e in enumerate(events)]
            self._last[client_id] = max(self._last.get(client_id, 0), events[-1].id)
            pipe = self.r.pipeline(transaction=False)
            self._add(pipe, client_id, events)
            (result,) = await pipe.execute(raise_on_error=False)
            if not isinstance(result, ResponseError):
                return

    async def subscribe(self, client_id: str, last_event_id: int | None = None, report_gaps: bool = False
                        ) -> AsyncIterator[state.Event]:
        key, seen_key = self._key(client_id), self.link.key("seen", client_id)
        with self.link.calling():
            if last_event_id is not None:
                cursor = last_event_id
            else:  # what no subscriber has seen yet; a session nobody followed: from now on
                seen = await self.r.get(seen_key)
                top = await self.r.xrevrange(key, count=1)
                cursor = int(seen) if seen else (event_id(top[0][0]) if top else 0)
        noted = time.monotonic()
        while not self.closed:
            with self.link.calling():
                reply = await self.r.xread({key: stream_id(cursor)}, count=500, block=BLOCK_MS)
            entries = reply[0][1] if reply else []
            last = ""
            for _, fields in entries:
                for ident, name, data, turn, *prev in json.loads(fields["events"]):
                    if ident > cursor:  # a reader resuming inside an entry skips what it had
                        # `prev`: the id the writer published before this one; above our cursor, the
                        # stream was trimmed past events this reader never got.
                        if report_gaps and prev and prev[0] > cursor:
                            yield state.Event(ident - 1, state.LOST, {})
                        cursor, last = ident, name
                        yield state.Event(ident, name, data or {}, turn)
            # What subscribers have seen: after a turn's end, else at most twice a second.
            if last and (last == "done" or time.monotonic() - noted > SEEN_EVERY):
                noted = time.monotonic()
                with self.link.calling():
                    await self.r.eval(_SEEN, 1, seen_key, cursor, STREAM_SECONDS)

    async def aclose(self) -> None:
        """Send what is queued (for a moment at most) and stop the writer."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(2):
                await self._idle.wait()
        if self._writer is not None:
            self._writer.cancel()


# ── Gates ───────────────────────────────────────────────────────────────────────────────────

_ANSWER = """if redis.call('EXISTS', KEYS[1]) == 0 or redis.call('HSETNX', KEYS[1], 'answered', '1') == 0 then
  return 0
end
redis.call('RPUSH', KEYS[2], ARGV[1]) redis.call('PEXPIRE', KEYS[2], ARGV[2]) return 1"""


class GateRelay:
    """Pending gates in Redis: a gate raised by a turn on one instance is listed and answered on any."""

    def __init__(self, link: Link):
        self.link = link
        self.r = link.client

    @contextlib.asynccontextmanager
    async def listening(self, gate_id: str, client_id: str, seconds: float, future: asyncio.Future[Any],
                        decision: Callable[[str, str, int, Any], Any]) -> AsyncIterator[None]:
        """While inside: the gate of `client_id` is listed for every instance, and an answer given on any
        sets `future` to `decision(word, by, minutes, content)`."""
        await self._raised(gate_id, client_id, seconds)
        delivering = asyncio.ensure_future(self._deliver(gate_id, future, decision))
        try:
            yield
        finally:
            delivering.cancel()
            await self._closed(gate_id)

    async def _raised(self, gate_id: str, client_id: str, seconds: float) -> None:
        key = self.link.key("gate", gate_id)
        with self.link.calling():
            pipe = self.r.pipeline(transaction=True)
            pipe.hset(key, mapping={"owner": client_id})
            pipe.pexpire(key, int((seconds + 60) * 1000))
            await pipe.execute()

    async def owner(self, gate_id: str) -> str | None:
        with self.link.calling():
            fields = await self.r.hgetall(self.link.key("gate", gate_id))
        return None if not fields or fields.get("answered") else fields.get("owner")

    async def answer(self, gate_id: str, answer: dict[str, Any]) -> bool:
        """Deliver an answer to the gate's turn, wherever it runs; False if unknown or already answered."""
        key = self.link.key("gate", gate_id)
        with self.link.calling():
            return bool(await self.r.eval(_ANSWER, 2, key, self.link.key("answer", gate_id), json.dumps(answer),
                                          60_000))

    async def _deliver(self, gate_id: str, future: asyncio.Future[Any], decision: Callable[[str, str, int, Any], Any]
                       ) -> None:
        answer = await self._wait(gate_id)
        if not future.done():
            future.set_result(decision(answer["word"], answer.get("by", ""), int(answer["minutes"]),
                                       answer.get("content")))

    async def _wait(self, gate_id: str) -> dict[str, Any]:
        """The answer given on any instance (waits until one comes; the caller bounds the time)."""
        key = self.link.key("answer", gate_id)
        while True:
            try:
                popped = await self.r.blpop([key], timeout=BLOCK_MS / 1000)
            except _DOWN as exc:
                self.link.unavailable(exc)
                await asyncio.sleep(0.5)
                continue
            if popped:
                return dict(json.loads(popped[1]))

    async def _closed(self, gate_id: str) -> None:
        with contextlib.suppress(*_DOWN, RedisError):
            await self.r.delete(self.link.key("gate", gate_id), self.link.key("answer", gate_id))


# ── Rate-limit windows and plugin values ────────────────────────────────────────────────────

_WINDOW = """if redis.call('SISMEMBER', KEYS[2], ARGV[5]) == 1 then return 'disabled' end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', tonumber(ARGV[1]) - tonumber(ARGV[2]))
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[3]) then
  if ARGV[4] == '1' then redis.call('SADD', KEYS[2], ARGV[5]) end
  return 'limit'
end
redis.call('ZADD', KEYS[1], ARGV[1], ARGV[6])
redis.call('PEXPIRE', KEYS[1], math.ceil(tonumber(ARGV[2]) * 1000))
return ''"""


class SharedLimits:
    """Rate-limit windows and disabled tool types in Redis (rate_limits.RateLimiter's shared half)."""

    def __init__(self, link: Link):
        self.link = link
        self.r = link.client

    async def hit(self, client_id: str, tool_type: str, limit: Any) -> str | None:
        """rate_limits.RateLimiter.hit for every instance: count one call under `limit` (a config.RateLimit, None:
        unlimited); None if allowed, else "limit" or "disabled"."""
        with self.link.calling():
            if limit is None or not limit.calls or not limit.window_seconds:
                off = await self.r.sismember(self.link.key("disabled", client_id), tool_type)
                return "disabled" if off else None
            why = await self.r.eval(_WINDOW, 2, self.link.key("rate", client_id, tool_type),
                                    self.link.key("disabled", client_id), time.time(), limit.window_seconds,
                                    limit.calls, "1" if limit.auto_disable else "0", tool_type, uuid.uuid4().hex)
        return why or None

    async def usage(self, client_id: str, windows: dict[str, float]) -> tuple[dict[str, int], set[str]]:
        """(calls per tool type within its window, the disabled types) of a session."""
        now = time.time()
        with self.link.calling():
            pipe = self.r.pipeline(transaction=False)
            for tool_type, seconds in windows.items():
                pipe.zcount(self.link.key("rate", client_id, tool_type), now - seconds, "+inf")
            pipe.smembers(self.link.key("disabled", client_id))
            *counts, off = await pipe.execute()
        return dict(zip(windows, (int(c) for c in counts), strict=True)), set(off)

    async def enable(self, client_id: str, tool_type: str) -> bool:
        with self.link.calling():
            return bool(await self.r.srem(self.link.key("disabled", client_id), tool_type))

    async def forget(self, client_id: str) -> None:
        with self.link.calling():
            keys = [k async for k in self.r.scan_iter(match=self.link.key("rate", client_id, "*"))]
            await self.r.delete(self.link.key("disabled", client_id), *keys)


class SharedValues:
    """Small values plugins keep for every instance (de-duplication keys, fingerprints, turn cursors)."""

    def __init__(self, link: Link):
        self.link = link
        self.r = link.client

    async def put(self, name: str, value: str, seconds: float, *, only_new: bool = False) -> bool:
        """Store `value` under `name` for `seconds`; with `only_new`, only if `name` is not set (then
        False says another instance set it first)."""
        with self.link.calling():
            return bool(await self.r.set(self.link.key("value", name), value, px=int(seconds * 1000), nx=only_new))

    async def get(self, name: str) -> str | None:
        with self.link.calling():
            return await self.r.get(self.link.key("value", name))

    async def take(self, name: str) -> str | None:
        """The value under `name`, removed (one instance gets it)."""
        with self.link.calling():
            return await self.r.getdel(self.link.key("value", name))

    async def drop(self, name: str) -> None:
        with self.link.calling():
            await self.r.delete(self.link.key("value", name))


_CLAIM = """if redis.call('EXISTS', KEYS[1]) == 0 then return {0, false} end
if redis.call('HSETNX', KEYS[1], 'closing', ARGV[1]) == 1 then return {1, false} end
return {0, redis.call('HGET', KEYS[1], 'closing')}"""


class SharedApprovals:
    """Routed gates (approvals.py) for every instance: their descriptions, the first answer, the approver windows.

    `approval:<id>` (a hash: `gate` its description, `closing` the first answer or the timeout, claimed once with
    HSETNX) lives until a while after its deadline, so a late answerer learns who answered; `approvals` (a sorted
    set by deadline) lists the open ones; `approver:<window>` marks a shell window that opted in.
    """

    #: How long a closed gate's record stays for late answerers.
    KEPT_SECONDS = 600

    def __init__(self, link: Link):
        self.link = link
        self.r = link.client

    async def add(self, gate_id: str, record: str, deadline: float) -> None:
        key = self.link.key("approval", gate_id)
        with self.link.calling():
            pipe = self.r.pipeline(transaction=True)
            pipe.hset(key, mapping={"gate": record})
            pipe.expireat(key, int(deadline + self.KEPT_SECONDS))
            pipe.zadd(self.link.key("approvals"), {gate_id: deadline})
            pipe.zremrangebyscore(self.link.key("approvals"), "-inf", time.time() - self.KEPT_SECONDS)
            await pipe.execute()

    async def get(self, gate_id: str) -> tuple[str | None, str | None]:
        """(description, closing) of a routed gate, None for what is not there."""
        with self.link.calling():
            found = await self.r.hmget(self.link.key("approval", gate_id), ["gate", "closing"])
        return found[0], found[1]

    async def claim(self, gate_id: str, closing: str) -> tuple[bool, str | None]:
        """(True, None) when `closing` is the first answer; else (False, the first one) — (False, None): unknown."""
        with self.link.calling():
            won, first = await self.r.eval(_CLAIM, 1, self.link.key("approval", gate_id), closing)
        return bool(won), first or None

    async def closed(self, gate_id: str) -> None:
        with contextlib.suppress(*_DOWN, RedisError):
            await self.r.zrem(self.link.key("approvals"), gate_id)

    async def open_ones(self) -> list[str]:
        """Descriptions of the routed gates still open (deadline not passed), soonest deadline first."""
        with self.link.calling():
            ids = await self.r.zrangebyscore(self.link.key("approvals"), time.time(), "+inf")
            if not ids:
                return []
            pipe = self.r.pipeline(transaction=False)
            for gate_id in ids:
                pipe.hmget(self.link.key("approval", gate_id), ["gate", "closing"])
            rows = await pipe.execute()
        return [g for g, c in rows if g and not c]

    async def set_window(self, window: str, on: bool, seconds: float) -> None:
        with self.link.calling():
            if on:
                await self.r.set(self.link.key("approver", window), "1", px=int(seconds * 1000))
            else:
                await self.r.delete(self.link.key("approver", window))

    async def window(self, window: str) -> bool:
        with self.link.calling():
            return bool(await self.r.exists(self.link.key("approver", window)))


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
        return lambda: self._handlers.pop(what, None) if self._handlers.get(what) is handler else None

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
            except (*_DOWN, RedisError) as exc:
                self.link.unavailable(exc)
                await asyncio.sleep(0.5)

    def _handled(self, work: asyncio.Future[Any]) -> None:
        self._handling.discard(work)
        if not work.cancelled() and work.exception() is not None:
            logger.error("acting on another instance's signal failed", exc_info=work.exception())

    async def close(self) -> None:
        if self._listener is not None:
            self._listener.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._listener


def open_store(url: str | None, data_dir: Path) -> stores.SessionStore:
    """A store from a `SESSION_STORE` setting: `redis://…` (several instances), else stores.open_store."""
    if is_redis_url(url):
        return RedisStore(Link(str(url)))
    return stores.open_store(url, data_dir)
