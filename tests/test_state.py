"""events.py and stores.py: the event hub (broadcast, replay, bounds) and the session stores."""

import asyncio

import pytest

import events
import sessions
import stores
import turns
from sessions import trim_history


async def take(it, n):
    return [await anext(it) for _ in range(n)]


async def test_every_subscriber_gets_every_event():
    hub = events.EventHub()
    a, b = hub.subscribe("s"), hub.subscribe("s")
    first_a, first_b = asyncio.ensure_future(take(a, 3)), asyncio.ensure_future(take(b, 3))
    await asyncio.sleep(0)
    hub.tok("s", "x"), hub.status("s", "working"), hub.tok("s", "y"), hub.done("s")
    ea, eb = await first_a, await first_b
    assert [e.name for e in ea] == ["tok", "status", "tok"] and ea == eb
    assert ea[0].id < ea[1].id < ea[2].id


async def test_tokens_no_subscriber_has_yet_are_one_event():
    """A burst of tokens reaches the subscribers as one event; a token some subscriber already has is never
    changed, and nothing is held back: the first token of a burst is there at once."""
    hub = events.EventHub()
    sub = hub.subscribe("s")
    reader = asyncio.ensure_future(anext(sub))
    await asyncio.sleep(0)
    hub.tok("s", "Once ")  # the reader waits: it is woken for this one
    hub.tok("s", "upon ")
    hub.tok("s", "a time.")
    first = await reader
    assert (first.name, first.data, first.pieces) == ("tok", {"text": "Once upon a time."}, 3)
    hub.tok("s", " The")  # the reader has the last event: a new one
    hub.tok("s", " end.")
    with turns.running(turns.Turn("s", "t2", "shell")):  # another request's text: its own event
        hub.tok("s", "!")
    hub.done("s")
    rest = await take(sub, 3)
    assert [(e.name, e.data.get("text"), e.turn) for e in rest] == [("tok", " The end.", None), ("tok", "!", "t2"),
                                                                    ("done", None, None)]
    assert [e.id for e in [first, *rest]] == list(range(first.id, first.id + 4))  # ids stay consecutive
    long = "x" * events.MAX_MERGED_TOK
    hub.tok("s", long), hub.tok("s", "y")
    assert [e.data["text"] for e in await take(sub, 2)] == [long, "y"]


async def test_replay_after_last_event_id_is_exact():
    hub = events.EventHub()
    ids = [hub.publish("s", "tok", {"text": str(i)}).id for i in range(5)]
    got = await take(hub.subscribe("s", ids[1]), 3)
    assert [e.data["text"] for e in got] == ["2", "3", "4"]


async def test_without_last_event_id_unseen_events_are_delivered_once():
    hub = events.EventHub()
    hub.tok("s", "before anyone listened")
    sub = hub.subscribe("s")
    assert (await anext(sub)).data["text"] == "before anyone listened"
    # A later subscriber starts after what was already delivered.
    late = hub.subscribe("s")
    hub.tok("s", "new")
    assert (await anext(late)).data["text"] == "new"


async def test_buffer_is_bounded():
    hub = events.EventHub()
    for i in range(events.EVENT_BUFFER + 50):
        hub.status("s", str(i))
    got = await anext(hub.subscribe("s", 0))
    assert got.data["text"] == "50"


async def test_sqlite_store_keeps_sessions_ids_and_history(tmp_path):
    path = tmp_path / "s.db"
    m = sessions.SessionManager(stores.SqliteStore(path))
    await m.open()
    a = await m.get_or_create("alice", "m1")
    b = await m.get_or_create("bob", "m2")
    a.history.append({"role": "user", "content": "hi"})
    await m.save(a)
    await m.delete("102")
    await m.close()
    m2 = sessions.SessionManager(stores.SqliteStore(path))
    await m2.open()
    assert [(s.client_id, s.shorthand, s.model) for s in m2.all()] == [("alice", 101, "m1")]
    assert m2.get("alice").history == [{"role": "user", "content": "hi"}]
    c = await m2.get_or_create("carol", "m1")
    assert c.shorthand == 103  # never reuses bob's 102
    assert b.shorthand == 102 and m2.resolve("101") == "alice" and m2.resolve("102") is None
    await m2.close()


async def test_what_a_store_writes_reads_back_as_it_was(tmp_path):
    """Records are written with orjson; what orjson refuses (an integer beyond 64 bits) goes through json."""
    m = sessions.SessionManager(stores.SqliteStore(tmp_path / "s.db"))
    await m.open()
    a = await m.get_or_create("alice", "m1")
    a.history += [{"role": "user", "content": "ü 😀 \u2028 \x01 \"quoted\""},
                  {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "name": "t",
                                                                        "args": {"n": 1.5e-7}}]}]
    b = await m.get_or_create("bob", "m1")
    b.history.append({"role": "assistant", "content": "", "tool_calls": [{"id": "c2", "name": "t",
                                                                           "args": {"big": 2**70}}]})
    await m.save(a)
    await m.save(b)
    await m.close()
    again = sessions.SessionManager(stores.SqliteStore(tmp_path / "s.db"))
    await again.open()
    assert again.get("alice").history == a.history and again.get("bob").history == b.history
    await again.close()


def test_store_setting():
    assert isinstance(stores.open_store("memory", None), stores.MemoryStore)
    with pytest.raises(stores.SessionError, match="SESSION_STORE=postgres:… is not supported"):
        stores.open_store("postgres://x", None)


def test_trim_never_separates_tool_call_from_result():
    h = [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "1", "name": "t", "args": {}}]},
        {"role": "tool", "tool_call_id": "1", "content": "r"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "a2"},
    ]
    assert trim_history(h, 10) == h
    assert trim_history(h, 4) == h[4:]  # would start at the tool result: moves to the next user message
    assert trim_history(h[:4], 2) == h[:4]  # one turn longer than the limit stays whole


async def test_idle_channels_are_bounded_but_followed_ones_stay():
    hub = events.EventHub(max_idle_channels=3)
    followed = hub.subscribe("watched")
    hub.publish("watched", "tok", {"text": "x"})
    assert (await anext(followed)).data == {"text": "x"}
    for i in range(10):
        hub.publish(f"probe-{i}", "tok", {"text": "y"})
    assert len(hub._channels) == 4 and "watched" in hub._channels  # 3 idle + the followed one
    assert {"probe-7", "probe-8", "probe-9"} <= set(hub._channels)
    await followed.aclose()  # now idle, and the most recently used of the old ones
    hub.publish("late", "done", {})
    assert set(hub._channels) == {"probe-9", "watched", "late"}


async def test_idle_bound_counts_followers_of_dropped_and_moved_channels():
    """A session deleted while followed: its follower moves to the id's new channel, and the idle bound
    still counts exactly the channels nobody follows (least recently used first, a join counts as use)."""
    hub = events.EventHub(max_idle_channels=2)
    followed = hub.subscribe("s")
    hub.publish("s", "tok", {"text": "a"})
    assert (await anext(followed)).data == {"text": "a"}
    hub.drop("s")  # deleted while followed
    hub.publish("s", "tok", {"text": "b"})  # the id's new channel
    assert (await anext(followed)).data == {"text": "b"}
    for name in ("p1", "p2", "p3"):
        hub.publish(name, "tok", {"text": "y"})
    hub.tok("p2", "z")  # joined into p2's unread tok: p2 is used again
    hub.publish("p4", "tok", {"text": "y"})
    assert set(hub._channels) == {"s", "p2", "p4"}  # "s" followed; p1 and p3 were the least recently used
    await followed.aclose()
    hub.publish("p5", "tok", {"text": "y"})
    assert set(hub._channels) == {"s", "p5"}


def test_observers_see_every_event_and_dropped_sessions(caplog):
    hub = events.EventHub()
    seen: list[tuple[str, str | None]] = []

    def broken(client_id, event):
        raise RuntimeError("observer bug")

    hub.observe(broken)
    stop = hub.observe(lambda cid, ev: seen.append((cid, ev.name if ev else None)))
    event = hub.publish("s", "gate", {"gate_id": "g1"})
    hub.done("t")
    hub.drop("s")
    # The broken observer is logged; the publisher and the other observers carry on.
    assert seen == [("s", "gate"), ("t", "done"), ("s", None)]
    assert event.data == {"gate_id": "g1"} and "observer bug" in caplog.text
    stop()  # an observer that stopped sees nothing more; stopping twice is harmless
    stop()
    hub.done("t")
    assert seen[-1] == ("s", None)


async def test_a_turn_that_saves_at_once_is_marked_running_by_that_save(tmp_path):
    """`hold(saves_at_once=True)` (an LLM turn: it stores its user message first thing) leaves the mark to that
    save: two saves of the whole session a turn instead of three. A new session too: its first save holds the
    user message, so a store that refuses it leaves the message in the session kept in memory (issue 40)."""
    path = tmp_path / "s.db"
    m = sessions.SessionManager(stores.SqliteStore(path))
    await m.open()
    written: list[str | None] = []
    save = m.store.save

    async def counting(session, last, **kw):
        written.append(session.running)
        return await save(session, last, **kw)

    m.store.save = counting
    new, _ = m.get_or_add("fresh", "m1")
    async with m.hold(new, "t0", saves_at_once=True):
        assert written == []
        new.history.append({"role": "user", "content": "hello"})
        await m.save(new)
    assert written == ["t0", None]
    old = m.get("fresh")
    written.clear()
    async with m.hold(old, "t1", saves_at_once=True):
        assert written == []
        old.history.append({"role": "user", "content": "hi"})
        await m.save(old)  # what dispatch_llm does first
    assert written == ["t1", None]
    written.clear()
    async with m.hold(old, "t2"):
        pass
    assert written == ["t2", None]
    await m.close()
