"""Event streams in Redis for several instances: every subscriber, on any instance, sees every event.

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
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator
from typing import Any

from events import EVENT_BUFFER, LOST, MAX_IDLE_CHANNELS, Event, EventHub
from shared_link import BLOCK_MS, Link
from turns import current_turn

logger = logging.getLogger("agent_mcp.shared")

#: A deleted session's stream lingers this long, so its subscribers read what it had sent.
DROPPED_STREAM_SECONDS = 30
#: While events keep coming (one written less than STREAMING_SECONDS ago), the writer gathers them this
#: long before a round trip, so a streamed answer costs a few writes instead of one per token.
COALESCE_SECONDS = 0.005
STREAMING_SECONDS = 0.05
#: Events an instance keeps queued for Redis while it is unreachable; beyond this the oldest go.
MAX_QUEUED_EVENTS = 20_000
#: How long `sent` waits for Redis (unreachable longer: a turn ends without its events' order across instances).
SENT_WAIT_SECONDS = 5.0


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


class RedisEventHub(EventHub):
    """The event hub of an instance on a shared store: events go to Redis Streams, subscribers read them.

    `publish` stays synchronous (tokens are published from the model's stream): events are queued
    and one writer task sends them in order, a burst per round trip. Observers see the events this
    instance publishes.
    """

    def __init__(self, link: Link, buffer: int = EVENT_BUFFER):
        super().__init__(buffer=buffer)
        self.link = link
        self.r = link.client
        self._last: OrderedDict[str, int] = OrderedDict()
        #: The id of the last event written to each session's stream by this instance (readers tell gaps by it).
        self._written: OrderedDict[str, int] = OrderedDict()
        self._expiry_set: dict[str, float] = {}
        self._queue: asyncio.Queue[tuple[str, Event | None]] = asyncio.Queue()
        self._writer: asyncio.Task[None] | None = None
        self._idle = asyncio.Event()
        self._idle.set()
        self._wrote = 0.0
        #: Events queued and events written (or dropped) so far; `sent` waits for the second to reach the first.
        self._queued = self._done = 0
        self._senders: list[tuple[int, asyncio.Future[None]]] = []

    def _key(self, client_id: str) -> str:
        return self.link.key("events", client_id)

    def _next_id(self, client_id: str) -> int:
        last = self._last.pop(client_id, 0)
        self._last[client_id] = nxt = max(time.time_ns() // 1000, last + 1)
        if len(self._last) > MAX_IDLE_CHANNELS * 10:
            self._last.popitem(last=False)
        return nxt

    def publish(self, client_id: str, name: str, data: dict[str, Any] | None = None) -> Event:
        turn = current_turn()
        event = Event(self._next_id(client_id), name, data or {}, turn.id if turn is not None else None)
        self._enqueue((client_id, event))
        if self._observers:
            self._notify(client_id, event)
        return event

    def _enqueue(self, item: tuple[str, Event | None]) -> None:
        if self._queue.qsize() >= MAX_QUEUED_EVENTS:
            self._queue.get_nowait()
            self._count_done(1)
            logger.error("Redis is unreachable and %d events are queued: the oldest is dropped", MAX_QUEUED_EVENTS)
        self._queue.put_nowait(item)
        self._queued += 1
        self._idle.clear()
        if self._writer is None or self._writer.done():
            self._writer = asyncio.get_running_loop().create_task(self._write_forever(), name="event-writer")

    async def sent(self) -> None:
        """Wait until the events published so far are in Redis: a turn's `done` is written before its session's
        lease goes, so what the next turn says (perhaps on another instance) comes after it in the stream."""
        if self._done >= self._queued:
            return
        waiter = asyncio.get_running_loop().create_future()
        self._senders.append((self._queued, waiter))
        try:
            async with asyncio.timeout(SENT_WAIT_SECONDS):
                await waiter
        except TimeoutError:
            logger.warning("events not written to Redis within %g s: a turn ends without waiting for them",
                           SENT_WAIT_SECONDS)

    def _count_done(self, n: int) -> None:
        self._done += n
        if self._senders:
            waiting = []
            for upto, waiter in self._senders:
                if upto > self._done:
                    waiting.append((upto, waiter))
                elif not waiter.done():
                    waiter.set_result(None)
            self._senders = waiting

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
                except self.link.failed as exc:
                    self.link.unavailable(exc)
                    await asyncio.sleep(0.5)
            self._wrote = time.monotonic()
            self._count_done(len(batch))
            if self._queue.empty():
                self._idle.set()

    @staticmethod
    def _entries(batch: list[tuple[str, Event | None]]) -> list[tuple[str, list[Event] | None]]:
        """The batch as stream writes: consecutive events of one session become one entry (None: a drop)."""
        entries: list[tuple[str, list[Event] | None]] = []
        for client_id, event in batch:
            if event is not None and entries and entries[-1][0] == client_id and entries[-1][1] is not None:
                entries[-1][1].append(event)
            else:
                entries.append((client_id, [event] if event is not None else None))
        return entries

    def _add(self, pipe: Any, client_id: str, events: list[Event]) -> None:
        prev = self._written.pop(client_id, 0)
        rows = []
        for e in events:
            rows.append([e.id, e.name, e.data, e.turn, prev])
            prev = e.id
        self._written[client_id] = prev
        if len(self._written) > MAX_IDLE_CHANNELS * 10:
            self._written.popitem(last=False)
        body = json.dumps(rows, ensure_ascii=False)
        pipe.xadd(self._key(client_id), {"events": body}, id=stream_id(events[-1].id), maxlen=self.buffer,
                  approximate=True)

    async def _write(self, batch: list[tuple[str, Event | None]]) -> None:
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
            elif isinstance(result, self.link.refused):  # another instance wrote this stream further ahead
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
            while len(self._expiry_set) > MAX_IDLE_CHANNELS * 10:
                self._expiry_set.pop(next(iter(self._expiry_set)))

    async def _append_after_top(self, client_id: str, events: list[Event]) -> None:
        """Give `events` ids after the stream's newest entry and add them (again if another write wins)."""
        while True:
            top: list[tuple[str, dict[str, str]]] = await self.r.xrevrange(self._key(client_id), count=1)  # type: ignore[assignment]  # decoded: str (Link.client)
            base = event_id(top[0][0]) + 1 if top else time.time_ns() // 1000
            events = [Event(base + n, e.name, e.data, e.turn) for n, e in enumerate(events)]
            self._last[client_id] = max(self._last.get(client_id, 0), events[-1].id)
            pipe = self.r.pipeline(transaction=False)
            self._add(pipe, client_id, events)
            (result,) = await pipe.execute(raise_on_error=False)
            if not isinstance(result, self.link.refused):
                return

    async def subscribe(self, client_id: str, last_event_id: int | None = None, report_gaps: bool = False
                        ) -> AsyncGenerator[Event, None]:
        key, seen_key = self._key(client_id), self.link.key("seen", client_id)
        with self.link.calling():
            if last_event_id is not None:
                cursor = last_event_id
            else:  # what no subscriber has seen yet (as the one-process hub): a session nobody followed, all of
                # what its stream keeps. (From its newest event on, a client that opened its stream, then sent
                # its message, lost the first events when another instance ran the turn before this read.)
                seen = await self.r.get(seen_key)
                cursor = int(seen) if seen else 0
        noted = time.monotonic()
        while not self.closed:
            with self.link.calling():
                reply: list[tuple[str, list[tuple[str, dict[str, str]]]]] = await self.r.xread(
                    {key: stream_id(cursor)}, count=500, block=BLOCK_MS)  # type: ignore[assignment]  # decoded: str (Link.client)
            entries = reply[0][1] if reply else []
            last = ""
            for _, fields in entries:
                for ident, name, data, turn, *prev in json.loads(fields["events"]):
                    if ident > cursor:  # a reader resuming inside an entry skips what it had
                        # `prev`: the id the writer published before this one; above our cursor, the
                        # stream was trimmed past events this reader never got.
                        if report_gaps and prev and prev[0] > cursor:
                            yield Event(ident - 1, LOST, {})
                        cursor, last = ident, name
                        yield Event(ident, name, data or {}, turn)
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
        self._count_done(self._queued - self._done)  # nobody waits for what is not sent now
