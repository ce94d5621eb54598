"""Slack events in: which messages are the agent's to answer, each once."""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: Client ids of this plugin's sessions start with this (its client-id namespace).
PREFIX = "slack-"
#: Subtypes that are ordinary user messages; every other subtype is housekeeping (edits, joins…).
USER_SUBTYPES = (None, "file_share", "thread_broadcast")
CHANNEL_ID = re.compile(r"^[A-Z0-9]{2,32}$")
SLACK_TS = re.compile(r"^\d{1,12}\.\d{1,9}$")
SEEN_MEMORY = 4096


@dataclass(frozen=True)
class InboundMessage:
    """A Slack message the agent answers."""

    channel: str
    thread_ts: str  # root of the thread the answer goes to
    ts: str
    user: str
    text: str

    @property
    def client_id(self) -> str:
        return f"{PREFIX}{self.channel}-{self.thread_ts}"


class _Seen:
    """A bounded memory of keys: `add()` is True the first time a key is seen."""

    def __init__(self, size: int = SEEN_MEMORY):
        self.size = size
        self._keys: OrderedDict[Any, None] = OrderedDict()

    def __contains__(self, key: Any) -> bool:
        return key in self._keys

    def add(self, key: Any) -> bool:
        if key in self._keys:
            return False
        self._keys[key] = None
        if len(self._keys) > self.size:
            self._keys.popitem(last=False)
        return True


class EventFilter:
    """Decides which Events API payloads become requests; each Slack message is handled at most once.

    Slack redelivers an event when an ack is late or a connection is replaced (same `event_id`),
    and a mention in a channel the bot reads arrives twice, as `app_mention` and as `message`
    (same channel and `ts`): both are deduplicated.
    """

    def __init__(self, bot_user_id: str, bot_id: str | None, is_bot_thread: Callable[[str], bool]):
        self.bot_user_id = bot_user_id
        self.bot_id = bot_id
        self.is_bot_thread = is_bot_thread
        self._events = _Seen()
        self._messages = _Seen()
        self._mention = re.compile(rf"<@{re.escape(bot_user_id)}(?:\|[^>]*)?>")

    def accept(self, payload: dict[str, Any]) -> InboundMessage | str:
        """The message to answer, or why the payload is ignored."""
        if payload.get("type") != "event_callback":
            return f"payload type {payload.get('type')!r}"
        event_id = payload.get("event_id")
        if event_id and not self._events.add(event_id):
            return "repeated delivery of an event"
        event = payload.get("event") or {}
        kind, subtype = event.get("type"), event.get("subtype")
        if kind not in ("app_mention", "message"):
            return f"event type {kind!r}"
        if subtype not in USER_SUBTYPES:
            return f"message subtype {subtype!r}"
        if event.get("bot_id") or event.get("user") == self.bot_user_id:
            return "a bot's message"
        channel, ts, user = event.get("channel"), event.get("ts"), event.get("user")
        thread_ts = event.get("thread_ts") or ts
        if not (isinstance(channel, str) and CHANNEL_ID.match(channel) and isinstance(ts, str) and SLACK_TS.match(ts)
                and isinstance(thread_ts, str) and SLACK_TS.match(thread_ts) and user):
            return "event without a valid channel, ts or user"
        message = InboundMessage(channel, thread_ts, ts, str(user), self._clean(str(event.get("text") or "")))
        if kind == "message" and event.get("channel_type") != "im":
            # Channel messages are answered only inside threads the bot takes part in; mentions
            # elsewhere come as app_mention.
            if thread_ts == ts or not self.is_bot_thread(message.client_id):
                return "channel message outside the bot's threads"
        if not self._messages.add((channel, ts)):
            return "message already handled (mention and message of one post)"
        return message

    def _clean(self, text: str) -> str:
        text = self._mention.sub("", text)
        return text.replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&").strip()
