"""The per-session event hub: bounded, replayable event sequences with broadcast wake-ups.

Every subscriber of a session sees every event; a client that reconnects with `Last-Event-ID`
gets what it missed. Several instances on one Redis use `shared_events.RedisEventHub` instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict, deque
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any

from turns import current_turn

logger = logging.getLogger("agent_mcp.state")

EVENT_BUFFER = 2000
#: The name of the marker `EventHub.subscribe(..., report_gaps=True)` yields where a subscriber lost
#: events (it fell more than EVENT_BUFFER events behind); `data["missed"]` says how many, if known.
LOST = "lost"
#: Channels without subscribers kept for replay; beyond this the least recently used go.
MAX_IDLE_CHANNELS = 1000
#: The longest text unread `tok` events are joined into (EventHub.tok); a longer answer goes on in a new event.
MAX_MERGED_TOK = 4096


@dataclass(frozen=True, slots=True)
class Event:
    """One output event of a session: `tok`, `status`, `gate`, `done` or `error`.

    `turn` is the id of the request that produced it (None outside a request).
    """

    id: int
    name: str
    data: dict[str, Any]
    turn: str | None = None
    #: The model's pieces a `tok` event holds (EventHub.tok joins those no subscriber has yet); never sent.
    pieces: int = 1


class _Channel:
    """A bounded, replayable event sequence of one session with broadcast wake-ups."""

    __slots__ = ("_wake", "events", "last_id", "seen", "start", "subscribers")

    def __init__(self, buffer: int = EVENT_BUFFER) -> None:
        self.subscribers = 0
        # Ids start at the current time in microseconds so that they keep increasing across
        # restarts: a client that reconnects with an old Last-Event-ID gets everything new.
        self.last_id = time.time_ns() // 1000
        self.start = self.last_id  # below its first event
        self.seen = self.last_id  # highest id handed to any subscriber
        self.events: deque[Event] = deque(maxlen=buffer)
        self._wake = asyncio.Event()

    def publish(self, name: str, data: dict[str, Any]) -> Event:
        self.last_id += 1
        turn = current_turn()
        event = Event(self.last_id, name, data, turn.id if turn is not None else None)
        self.events.append(event)
        wake, self._wake = self._wake, asyncio.Event()
        wake.set()
        return event

    def extend_tok(self, text: str) -> Event | None:
        """Append `text` to the newest event if it is a `tok` of the current turn that no subscriber has
        been handed yet (and stays under MAX_MERGED_TOK): the merged event, else None.

        Tokens published in one burst (the model's chunks that arrived together) then reach the
        subscribers as one event: one JSON encoding, one SSE frame, one write per burst instead of
        per token; a token nobody waits for is never held back (the first of a burst goes alone)."""
        if not self.events:
            return None
        last = self.events[-1]
        turn = current_turn()
        if (last.name != "tok" or last.id <= self.seen or last.turn != (turn.id if turn is not None else None)
                or len(last.data["text"]) + len(text) > MAX_MERGED_TOK):
            return None
        event = self.events[-1] = Event(last.id, "tok", {"text": last.data["text"] + text}, last.turn, last.pieces + 1)
        return event

    def after(self, cursor: int) -> Event | None:
        """The first buffered event with an id above `cursor` (skipping what fell out of the buffer)."""
        if cursor >= self.last_id or not self.events:
            return None
        index = max(0, cursor + 1 - self.events[0].id)
        return self.events[index]


#: Called with (client id, event) on every publish, and with (client id, None) when a session's
#: channel is dropped (the session was deleted). Runs synchronously in the publisher's task.
HubObserver = Callable[[str, Event | None], None]


class EventHub:
    """Per-session output events. Every subscriber sees every event; reconnects replay by id.

    Observers (`observe()`) see every event of every session as it is published (the MCP server
    uses this to learn when gates open and close and when turns end); an observer that raises is
    logged and never disturbs the publisher.
    """

    def __init__(self, max_idle_channels: int = MAX_IDLE_CHANNELS, buffer: int = EVENT_BUFFER) -> None:
        #: Least recently used first: a publish or a subscriber leaving moves a channel to the end (_use), so
        #: the idle channels to forget are the first idle ones, found without sorting them all per new session.
        self._channels: OrderedDict[str, _Channel] = OrderedDict()
        #: How many of those channels have subscribers (the rest are idle).
        self._followed = 0
        #: Events kept per session for readers that fall behind or reconnect (AGENT_EVENT_BUFFER).
        self.buffer = buffer
        self.max_idle_channels = max_idle_channels
        self._observers: list[HubObserver] = []
        self.closed = False

    def observe(self, observer: HubObserver) -> Callable[[], None]:
        """Call `observer` with every event published from now on; returns the function that stops it."""
        self._observers.append(observer)

        def stop() -> None:
            with contextlib.suppress(ValueError):
                self._observers.remove(observer)

        return stop

    def _notify(self, client_id: str, event: Event | None) -> None:
        for observer in list(self._observers):
            try:
                observer(client_id, event)
            except Exception:
                logger.exception("event hub observer %r failed", observer)

    def _channel(self, client_id: str) -> _Channel:
        ch = self._channels.get(client_id)
        if ch is None:
            ch = self._channels[client_id] = _Channel(self.buffer)
            if len(self._channels) > self.max_idle_channels:
                self._evict_idle()
        return ch

    def _evict_idle(self) -> None:
        """Forget the least recently used channels nobody follows, so streams of unknown ids cannot grow memory."""
        excess = len(self._channels) - self._followed - self.max_idle_channels
        if excess <= 0:
            return
        stale = []
        for cid, ch in self._channels.items():
            if ch.subscribers == 0:
                stale.append(cid)
                if len(stale) == excess:
                    break
        for cid in stale:
            del self._channels[cid]

    def _use(self, client_id: str, ch: _Channel) -> None:
        """`ch` (the channel of `client_id`, unless it was dropped meanwhile) becomes the most recently used."""
        if self._channels.get(client_id) is ch:
            self._channels.move_to_end(client_id)

    def _follow(self, client_id: str, ch: _Channel) -> None:
        ch.subscribers += 1
        if ch.subscribers == 1 and self._channels.get(client_id) is ch:
            self._followed += 1

    def _unfollow(self, client_id: str, ch: _Channel) -> None:
        ch.subscribers -= 1
        if ch.subscribers == 0 and self._channels.get(client_id) is ch:
            self._followed -= 1

    def publish(self, client_id: str, name: str, data: dict[str, Any] | None = None) -> Event:
        ch = self._channel(client_id)
        event = ch.publish(name, data or {})
        self._use(client_id, ch)
        if self._observers:
            self._notify(client_id, event)
        return event

    def last_id(self, client_id: str) -> int:
        return self._channel(client_id).last_id

    async def aclose(self) -> None:
        """Release what the hub holds (a shared hub: its writer, after sending what is queued)."""

    def close(self) -> None:
        """The server stops: every subscription ends after the events it has not yet received."""
        self.closed = True
        for ch in self._channels.values():
            ch._wake.set()

    def drop(self, client_id: str) -> None:
        ch = self._channels.pop(client_id, None)
        if ch is not None:
            if ch.subscribers:
                self._followed -= 1
            ch._wake.set()  # wake its subscribers so they move to the session's next channel
        if self._observers:
            self._notify(client_id, None)

    async def subscribe(self, client_id: str, last_event_id: int | None = None, report_gaps: bool = False
                        ) -> AsyncGenerator[Event, None]:
        """Events after `last_event_id`; without one, every event no subscriber has seen yet, then live.

        A subscriber that falls more than `buffer` events behind misses the oldest; with
        `report_gaps` a `LOST` marker event (turn None) comes where they are missing, so a reader that
        must not present a gapped answer as whole (run_turn) can tell.
        """
        ch = self._channel(client_id)
        cursor = ch.seen if last_event_id is None else last_event_id
        self._follow(client_id, ch)
        try:
            while True:
                event = ch.after(cursor)
                if event is None and self._channels.get(client_id) is not ch:
                    # Session deleted: what it had sent was delivered; go on with the id's new channel, all of
                    # it (another subscriber that moved first may have seen its first events already).
                    self._unfollow(client_id, ch)
                    ch = self._channel(client_id)
                    self._follow(client_id, ch)
                    cursor = ch.start
                    continue
                if event is None:
                    if self.closed:
                        return
                    await ch._wake.wait()
                    continue
                if report_gaps and event.id > cursor + 1:  # ids of one channel are consecutive
                    yield Event(event.id - 1, LOST, {"missed": event.id - cursor - 1})
                cursor = event.id
                if cursor > ch.seen:
                    ch.seen = cursor
                yield event
        finally:
            self._unfollow(client_id, ch)
            self._use(client_id, ch)

    # Typed helpers, one per event kind of the wire contract.
    def tok(self, client_id: str, text: str) -> None:
        """Answer text; joins the session's newest `tok` event while no subscriber has it yet (_Channel.extend_tok)."""
        if not text:
            return
        # (A hub that publishes elsewhere, such as shared_events.RedisEventHub, keeps no channels: nothing to join.)
        ch = self._channels.get(client_id)
        event = ch.extend_tok(text) if ch is not None else None
        if event is None:
            self.publish(client_id, "tok", {"text": text})
            return
        self._channels.move_to_end(client_id)
        if self._observers:
            self._notify(client_id, event)

    def status(self, client_id: str, text: str) -> None:
        self.publish(client_id, "status", {"text": text})

    def gate(self, client_id: str, payload: dict[str, Any]) -> None:
        self.publish(client_id, "gate", payload)

    def done(self, client_id: str) -> None:
        self.publish(client_id, "done", {})

    async def sent(self) -> None:
        """Wait until every event published so far reaches every subscriber's source (here: at once)."""

    def error(self, client_id: str, message: str, kind: str | None = None) -> None:
        """An `error` event; `kind` ("timeout": the model did not answer in time, "backend": the model
        call failed) lets a plugin answer in its protocol's terms (the proxy: 504 / 502)."""
        self.publish(client_id, "error", {"message": message, **({"kind": kind} if kind else {})})
