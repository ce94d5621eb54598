"""What keeps memory and per-request work flat as work grows (bench/growth.py measures the costs):
the proxy's conversation index forgets evicted sessions, and the session count needs no listing."""

from __future__ import annotations

from plugin_scope import PluginSessions, Scope
from plugins._conversations import FINGERPRINT, ConversationIndex
from sessions import SessionLimits, SessionManager, SessionPolicy
from stores import MemoryStore


def manager(cap: int) -> SessionManager:
    policy = SessionPolicy(limits=lambda kind: SessionLimits(max_sessions=cap))
    return SessionManager(MemoryStore(), policy)


def proxy_index(sessions: SessionManager) -> ConversationIndex:
    """The proxy's index on the sessions the proxy plugin reaches (its `ctx.sessions`)."""
    scope = Scope("plugin_proxy_llama", {"llama-": ("proxy", "plugin_proxy_llama")}, sessions, everything=False)
    return ConversationIndex(PluginSessions(sessions, scope), "llama-")


async def test_the_conversation_index_holds_only_live_sessions_as_sessions_are_evicted() -> None:
    sessions = manager(cap=10)
    await sessions.open()
    index = proxy_index(sessions)
    for i in range(50):
        await sessions.get_or_create(f"llama-{i}", "fake")  # beyond 10, the least recently active goes
        await index.remember(f"llama-{i}", f"mark-{i}")
    assert sessions.count() == 10 == len(sessions.all())
    live = {s.client_id for s in sessions.all()}
    assert set(index._index().values()) == live and set(index._mark_of) == live
    assert await index.claim("mark-0") is None  # evicted: its conversation starts anew
    assert await index.claim("mark-49") == "llama-49"
    assert "llama-49" not in index._mark_of and FINGERPRINT not in sessions.get("llama-49").settings


async def test_a_conversation_that_moves_on_leaves_one_mark_and_a_deleted_one_none() -> None:
    sessions = manager(cap=100)
    await sessions.open()
    index = proxy_index(sessions)
    for cid in ("llama-a", "llama-b", "llama-c"):
        await sessions.get_or_create(cid, "fake")
    await index.remember("llama-a", "a-1")
    await index.remember("llama-a", "a-2")  # the next turn of that chat
    assert index._index() == {"a-2": "llama-a"}
    # Two chats with one transcript: neither keeps it, and neither is found by it.
    await index.remember("llama-b", "same")
    await index.remember("llama-c", "same")
    assert await index.claim("same") is None
    await sessions.delete("llama-a")
    assert index._index() == {} and "llama-a" not in index._mark_of
    assert await index.claim("a-2") is None
