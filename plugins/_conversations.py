"""Which session a stateless chat request continues: one session per conversation, not per address.

Chat apps and SDKs (open-webui, Enchanted, the OpenAI and Ollama SDKs) resend the whole
conversation on every request. After each turn the proxy remembers a fingerprint of the
transcript as the client will send it back: the request's messages plus the answer exactly as it
was streamed. A request whose prior messages (all but its last) have a session's fingerprint
continues that session; any other request starts a new session seeded with those prior messages
(a new chat, an edited or regenerated message, a conversation begun before the session expired or
on another instance).

A fingerprint also covers the request's scope (client address, a digest of its API key, a
forwarded user): a scope only narrows a match, so two users with byte-identical transcripts
never share a session. A fingerprint is claimed when a request takes it, so two requests with the
same prior messages (two tabs, a resent request) never run on one session; and when two sessions
reach the same fingerprint, neither keeps it (their next requests each start afresh, seeded).

Fingerprints are stored in the session's settings (`FINGERPRINT`), so they persist with it and a
restart continues conversations; the index is rebuilt from the stored sessions on first use, and
a session's entry goes when the session does (`PluginSessions.on_forgotten`). With several
instances on one Redis the index is kept there instead (the plugin's `ctx.values`), so a conversation
continues on whichever instance its next request reaches; a claim there is atomic (GETDEL).

Not a plugin itself (no manifest entry); `plugin_proxy_llama` imports it as `plugins._conversations`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from typing import Any

import plugin_api

#: Session setting holding the fingerprint of the transcript the client will send next.
FINGERPRINT = "proxy_fingerprint"

Turn = tuple[str, str]  # (role, text) of one message as the client sends it


def content_text(content: Any) -> str:
    """The text of a message content: a string, or the text parts of a content list."""
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict) and p.get("type") == "text")
    return "" if content is None else str(content)


def fingerprint(scope: str, transcript: Iterable[Turn]) -> str:
    """A digest of `transcript` within `scope`; whitespace around each message's text does not count."""
    digest = hashlib.sha256(scope.encode())
    for role, text in transcript:
        digest.update(b"\x00" + json.dumps([role, text.strip()], ensure_ascii=False).encode())
    return digest.hexdigest()


def seed(transcript: Sequence[Turn]) -> list[dict[str, Any]]:
    """History for a new session from the client's prior messages (its user and assistant turns;
    the agent brings its own system prompt)."""
    return [{"role": role, "content": text} for role, text in transcript if role in ("user", "assistant") and text]


#: How long a fingerprint stays claimable in a shared index (a conversation idle longer starts afresh).
SHARED_SECONDS = 30 * 86400


class ConversationIndex:
    """fingerprint → client id of the session whose conversation it continues."""

    def __init__(self, sessions: plugin_api.PluginSessions, prefix: str, values: plugin_api.PluginValues | None = None):
        self.sessions = sessions
        self.prefix = prefix
        self.values = values
        self._by_print: dict[str, str] | None = None
        #: client id → its mark in `_by_print`, so forgetting a session is one lookup, not a scan of the index
        #: (every evicted proxy session is forgotten: with 10,000 sessions a scan was 10,000 steps each).
        self._mark_of: dict[str, str] = {}

    def _index(self) -> dict[str, str]:
        if self._by_print is None:
            self._by_print = {}
            for session in self.sessions.all():
                mark = session.settings.get(FINGERPRINT)
                if session.client_id.startswith(self.prefix) and isinstance(mark, str):
                    self._link(mark, session.client_id)
            self.sessions.on_forgotten(self.forget)
        return self._by_print

    async def claim(self, mark: str) -> str | None:
        """The client id of the live session whose conversation `mark` continues, taken out of the
        index (the turn about to run will leave a new one), or None."""
        if self.values is not None:
            taken = await self.values.take(f"fingerprint:{mark}")
            return taken if taken and await self.sessions.exists(taken) else None
        client_id = self._unlink(mark)
        session = self.sessions.get(client_id) if client_id else None
        if session is None or session.settings.get(FINGERPRINT) != mark:
            return None
        del session.settings[FINGERPRINT]
        return client_id

    async def remember(self, client_id: str, mark: str) -> None:
        """Record that `client_id`'s conversation now continues with `mark`, and store it with the session."""
        session = self.sessions.get(client_id)
        if session is None:
            return
        if self.values is not None:
            name = f"fingerprint:{mark}"
            if not await self.values.put(name, client_id, SHARED_SECONDS, only_new=True) \
                    and await self.values.get(name) != client_id:
                await self.values.drop(name)  # two conversations with one transcript: neither keeps it
            return
        index = self._index()
        other = index.get(mark)
        if other is not None and other != client_id:
            # Two conversations with one transcript: which one comes next cannot be told apart.
            self._unlink(mark)
            rival = self.sessions.get(other)
            if rival is not None:
                rival.settings.pop(FINGERPRINT, None)
                await self.sessions.save(rival)
            session.settings.pop(FINGERPRINT, None)
        else:
            stale = session.settings.get(FINGERPRINT)
            if isinstance(stale, str) and index.get(stale) == client_id:
                self._unlink(stale)
            self._link(mark, client_id)
            session.settings[FINGERPRINT] = mark
        await self.sessions.save(session)

    def forget(self, client_id: str) -> None:
        """A session is gone (deleted, expired, evicted): its fingerprint with it."""
        if self._by_print is None or not client_id.startswith(self.prefix):
            return
        mark = self._mark_of.get(client_id)
        if mark is not None:
            self._unlink(mark)

    def _link(self, mark: str, client_id: str) -> None:
        index = self._index() if self._by_print is None else self._by_print
        old = self._mark_of.get(client_id)
        if old is not None and old != mark and index.get(old) == client_id:
            del index[old]
        replaced = index.get(mark)
        if replaced is not None and replaced != client_id and self._mark_of.get(replaced) == mark:
            del self._mark_of[replaced]
        index[mark] = client_id
        self._mark_of[client_id] = mark

    def _unlink(self, mark: str) -> str | None:
        """Take `mark` out of the index; the client id it pointed at, or None."""
        client_id = self._index().pop(mark, None)
        if client_id is not None and self._mark_of.get(client_id) == mark:
            del self._mark_of[client_id]
        return client_id
