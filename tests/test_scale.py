"""Several instances on one Redis act as one server (issue 15), in one process: two runtimes, one store.

The same behaviour through real processes, kill -9, a Redis stopped under a running instance and
nginx in front are in test_scale_processes.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator

import pytest
from pydantic import BaseModel

import routes
import shared_link
import shared_store
import state
import stores
from events import Event
from plugin_api import PluginContext
from plugins._conversations import ConversationIndex
from plugins.plugin_client_api import ApiPlugin
from plugins.plugin_proxy_llama import LlamaProxyPlugin
from tests.conftest import openai_model
from tests.fakes.backend import text, tool_call
from tests.runtime import ALL_GATED, Recorder, add_plugin_tools, ask, runtime, shell_payload


class Query(BaseModel):
    query: str


@contextlib.asynccontextmanager
async def two(tmp_path, url: str, models, **kw) -> AsyncIterator[tuple[state.Runtime, state.Runtime]]:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    # One audit key for both, as the README says for instances sharing grants: each honours the other's grants.
    kw["env"] = {"AGENT_AUDIT_KEY_FILE": str(tmp_path / "audit-key"), **kw.get("env", {})}
    async with runtime(tmp_path / "a", models, store=shared_store.open_store(url, tmp_path / "a"), **kw) as a, \
            runtime(tmp_path / "b", models, store=shared_store.open_store(url, tmp_path / "b"), **kw) as b:
        yield a, b


async def until_done(sub: AsyncIterator[Event], turn_id: str | None = None) -> list[Event]:
    events = []
    async with asyncio.timeout(20):
        async for ev in sub:
            if turn_id is None or ev.turn == turn_id:
                events.append(ev)
                if ev.name == "done":
                    return events
    return events


def said(events: list[Event]) -> str:
    return "".join(e.data.get("text", "") for e in events if e.name == "tok")


async def test_history_ids_and_streams_are_one_across_instances(tmp_path, fake_openai, redis_store) -> None:
    async with two(tmp_path, redis_store, {"fake": openai_model(fake_openai)}) as (a, b):
        # A turn submitted on A streams to a subscriber on B.
        sub_b = b.hub.subscribe("alice", None)
        fake_openai.script(text("Hello ", "Alice."))
        ran = await routes.submit(a, ask(a, "alice", "my name is Alice", shell_payload(a, "alice", None)))
        events = await until_done(sub_b, ran.id)
        names = [e.name for e in events]  # (one `tok` or two: pieces that reach the server together are joined)
        assert names[0] == "user" and set(names[1:-1]) == {"tok"} and names[-1] == "done"
        assert said(events) == "Hello Alice."
        ids = [e.id for e in events]
        assert ids == sorted(ids) and len(set(ids)) == len(ids)
        # History written on A is read on B: B's turn sends it to the model.
        fake_openai.script(text("You are Alice."))
        ran = await routes.submit(b, ask(b, "alice", "what is my name?", shell_payload(b, "alice", None)))
        assert said(await until_done(sub_b, ran.id)) == "You are Alice."
        sent = [m["content"] for m in fake_openai.requests[-1].json["messages"][1:]]
        assert sent == ["my name is Alice", "Hello Alice.", "what is my name?"]
        # One list of sessions with unique shorthand ids, whichever instance created them.
        for rt, cid in ((a, "bob"), (b, "carol"), (a, "dave")):
            fake_openai.script(text("hi"))
            sub = rt.hub.subscribe(cid, rt.hub.last_id(cid))
            await until_done(sub, (await routes.submit(rt, ask(rt, cid, "hi", shell_payload(rt, cid, None)))).id)
            await sub.aclose()
        await a.sessions.refresh()
        await b.sessions.refresh()
        listing = [(s.shorthand, s.client_id) for s in a.sessions.all()]
        assert listing == [(s.shorthand, s.client_id) for s in b.sessions.all()]
        assert sorted(c for _, c in listing) == ["alice", "bob", "carol", "dave"]
        assert len({n for n, _ in listing}) == 4 and min(n for n, _ in listing) == stores.FIRST_SHORTHAND
        await sub_b.aclose()


async def test_a_stream_opened_before_its_message_gets_the_whole_turn_whichever_instance_ran_it(
        tmp_path, fake_openai, redis_store) -> None:
    # A client opens its stream on B (its response has started, its first read not yet), then sends its message,
    # which A runs to its end before B's stream reads at all (a loaded machine, a load balancer between them).
    async with two(tmp_path, redis_store, {"fake": openai_model(fake_openai)}) as (a, b):
        sub_b = b.hub.subscribe("early", None)
        fake_openai.script(text("Hi ", "there."))
        ran = await routes.submit(a, ask(a, "early", "hello", shell_payload(a, "early", None)))
        await ran.task
        await a.hub._idle.wait()  # every event of the turn is in Redis
        events = await until_done(sub_b, ran.id)
        names = [e.name for e in events]  # (one `tok` or two: pieces that reach the server together are joined)
        assert names[0] == "user" and set(names[1:-1]) == {"tok"} and names[-1] == "done"
        assert said(events) == "Hi there."
        await sub_b.aclose()


async def test_a_gate_raised_on_one_instance_is_answered_on_the_other(tmp_path, fake_openai, redis_store) -> None:
    recorder = Recorder()
    async with two(tmp_path, redis_store, {"fake": openai_model(fake_openai)}, gates=ALL_GATED) as (a, b):
        for rt in (a, b):
            add_plugin_tools(rt, "plugin_test", [recorder.tool("web_search", Query)], {"web_search": {"type": "read"}})
        fake_openai.script(tool_call("web_search", {"query": "redis"}), text("Found it."))
        sub_b = b.hub.subscribe("c1", None)
        ran = await routes.submit(a, ask(a, "c1", "search", shell_payload(a, "c1", None)))
        async with asyncio.timeout(20):
            async for ev in sub_b:
                if ev.name == "gate":
                    gate_id = ev.data["gate_id"]
                    break
        assert await b.gate.owner(gate_id) == "c1" and gate_id not in b.gate.pending
        assert await b.gate.resolve(gate_id, "allow", by="shell")
        assert not await b.gate.resolve(gate_id, "allow", by="shell")  # answered once
        events = await until_done(sub_b, ran.id)
        assert said(events) == "Found it." and recorder.calls == [("web_search", {"query": "redis"})]
        assert await b.gate.owner(gate_id) is None and not await b.gate.resolve(gate_id, "reject")
        await sub_b.aclose()


async def test_simultaneous_turns_on_two_instances_run_one_at_a_time(tmp_path, fake_openai, redis_store) -> None:
    async with two(tmp_path, redis_store, {"fake": openai_model(fake_openai)}) as (a, b):
        fake_openai.script(text("one ", "two ", delay=0.2), text("three ", "four", delay=0.2))
        sub = a.hub.subscribe("c1", None)
        # Queued, not replacing each other (as the proxy, Slack and MCP send): both are answered.
        first, second = await asyncio.gather(
            routes.submit(a, ask(a, "c1", "first", shell_payload(a, "c1", None)), cancel_running=False),
            routes.submit(b, ask(b, "c1", "second", shell_payload(b, "c1", None)), cancel_running=False))
        events = [e for e in await until_done_both(sub, {first.id, second.id}) if e.name in ("user", "tok", "done")]
        # Each turn's events come together: user, its tokens, done; then the other turn.
        turns = [e.turn for e in events]
        assert turns == sorted(turns, key=turns.index) and len(set(turns)) == 2
        await a.sessions.refresh()
        history = a.sessions.get("c1").history
        assert [m["role"] for m in history] == ["user", "assistant", "user", "assistant"]
        assert {history[0]["content"], history[2]["content"]} == {"first", "second"}
        await sub.aclose()


async def test_what_an_instance_published_before_sent_returns_comes_before_what_another_says_next(
        tmp_path, fake_openai, redis_store) -> None:
    # A turn's `done` waits in the writer's queue while it gathers a streamed answer; the turn lets its
    # session go only after `sent`, so the next turn's first event (here on the other instance) follows it.
    async with two(tmp_path, redis_store, {"fake": openai_model(fake_openai)}) as (a, b):
        for n in range(5):  # a race lost once in a few tries without the wait: tried a few times
            sub = a.hub.subscribe(f"c{n}", None)
            a.hub.publish(f"c{n}", "tok", {"text": "one "})
            await a.hub.sent()
            a.hub.publish(f"c{n}", "tok", {"text": "two"})  # within the streaming window: gathered for a moment
            a.hub.done(f"c{n}")
            await a.hub.sent()
            b.hub.publish(f"c{n}", "user", {"text": "next"})
            await b.hub.sent()
            names = []
            async with asyncio.timeout(10):
                async for ev in sub:
                    names.append(ev.name)
                    if ev.name == "user":
                        break
            assert names == ["tok", "tok", "done", "user"]
            await sub.aclose()


async def until_done_both(sub: AsyncIterator[Event], turns: set[str]) -> list[Event]:
    events, left = [], set(turns)
    async with asyncio.timeout(20):
        async for ev in sub:
            events.append(ev)
            if ev.name == "done":
                left.discard(ev.turn)
                if not left:
                    return events
    return events


async def test_rate_limit_windows_are_shared(tmp_path, fake_openai, redis_store) -> None:
    limits = {"search": {"calls": 2, "window_seconds": 60, "auto_disable": True}}
    async with two(tmp_path, redis_store, {"fake": openai_model(fake_openai)}, rate_limits=limits) as (a, b):
        outcomes = [await rt.rate_limiter.count("c1", "search") for rt in (a, b, a, b)]
        assert outcomes == [None, None, "limit", "disabled"]
        assert "DISABLED" in await b.rate_limiter.describe("c1", ["search"])
        assert await a.rate_limiter.reenable("c1", "search")
        assert not await b.rate_limiter.reenable("c1", "search")


async def test_a_turn_whose_instance_died_is_ended_by_another(tmp_path, fake_openai, redis_store) -> None:
    async with two(tmp_path, redis_store, {"fake": openai_model(fake_openai)}) as (a, b):
        # What a killed instance leaves: the session stored as running, its lease lapsed.
        session = await a.sessions.get_or_create("c1", "fake")
        session.history.append({"role": "user", "content": "lost question"})
        session.running = "deadturn"
        await a.sessions.save(session)
        sub = b.hub.subscribe("c1", None)
        assert await b.sessions.recover() == ["c1"]
        events = await until_done(sub, "deadturn")
        assert [e.name for e in events] == ["error", "done"] and "interrupted" in events[0].data["message"]
        await a.sessions.refresh()
        assert a.sessions.get("c1").running is None
        assert a.sessions.get("c1").history == [{"role": "user", "content": "lost question"}]
        await sub.aclose()


async def test_proxy_conversations_and_api_turns_are_known_to_every_instance(tmp_path, fake_openai,
                                                                             redis_store) -> None:
    async with two(tmp_path, redis_store, {"fake": openai_model(fake_openai)}) as (a, b):
        contexts = []
        for rt in (a, b):  # as the loader gives the proxy its context: its own namespace, values and sessions
            rt.client_namespaces["llama-"] = ("proxy", "plugin_proxy_llama")
            contexts.append(PluginContext(rt, LlamaProxyPlugin(), {}))
        on_a, on_b = (ConversationIndex(ctx.sessions, "llama-", ctx.values) for ctx in contexts)
        for rt, cid in ((a, "llama-one"), (a, "llama-two"), (b, "llama-three")):
            await rt.sessions.get_or_create(cid, "fake")
        await on_a.remember("llama-one", "mark-1")
        assert await on_b.claim("mark-1") == "llama-one"  # the next request of that chat reached B
        assert await on_a.claim("mark-1") is None  # claimed once
        # Two sessions with one transcript (on two instances): neither keeps the fingerprint.
        await on_a.remember("llama-two", "mark-2")
        await on_b.remember("llama-three", "mark-2")
        assert await on_a.claim("mark-2") is None and await on_b.claim("mark-2") is None
        # A session deleted on one instance is not continued on the other.
        await on_a.remember("llama-one", "mark-3")
        await a.sessions.delete("llama-one")
        assert await on_b.claim("mark-3") is None
        # An API turn submitted on A can be streamed by its id on B.
        api_a, api_b = ApiPlugin(), ApiPlugin()
        api_a.context, api_b.context = PluginContext(a, api_a, {}), PluginContext(b, api_b, {})
        await api_a._remember("turn-1", "api-x", 12345)
        assert await api_b._recall("turn-1") == ("api-x", 12345) and await api_b._recall("turn-2") is None


async def test_a_grant_given_on_one_instance_allows_there_and_is_revoked_from_the_other(tmp_path, fake_openai,
                                                                                      redis_store) -> None:
    recorder = Recorder()
    async with two(tmp_path, redis_store, {"fake": openai_model(fake_openai)}, gates=ALL_GATED) as (a, b):
        for rt in (a, b):
            add_plugin_tools(rt, "plugin_test", [recorder.tool("web_search", Query)], {"web_search": {"type": "read"}})
        sub = b.hub.subscribe("c1", None)

        async def search(rt: state.Runtime, answer: str | None) -> list[Event]:
            fake_openai.script(tool_call("web_search", {"query": "q"}), text("done"))
            ran = await routes.submit(rt, ask(rt, "c1", "search", shell_payload(rt, "c1", None)))
            events = []
            async with asyncio.timeout(20):
                async for ev in sub:
                    if ev.turn == ran.id:
                        events.append(ev)
                        if ev.name == "gate" and answer:
                            assert await b.gate.resolve(ev.data["gate_id"], answer, by="shell")
                        if ev.name == "done":
                            return events
            return events

        asked = await search(a, "allow_session")  # asked on A, answered on B: a grant of the session
        assert [e.name for e in asked].count("gate") == 1
        granted = await search(b, None)  # a turn of that session on B: the grant answers
        assert not [e for e in granted if e.name == "gate"] and any("allowed by grant" in e.data.get("text", "")
                                                                     for e in granted)
        listing = await routes.wait_turn(b, ask(b, "c1", "!grants", shell_payload(b, "c1", None)), 20)
        assert "this session" in listing["text"] and "granted by shell" in listing["text"]
        revoked = await routes.wait_turn(b, ask(b, "c1", "!grants revoke all", shell_payload(b, "c1", None)), 20)
        assert revoked["text"].startswith("Revoked")
        again = await search(a, "reject")  # on A the next call asks again
        assert [e.name for e in again].count("gate") == 1 and len(recorder.calls) == 2
        await sub.aclose()


async def test_revoking_all_grants_reaches_those_given_on_another_instance(tmp_path, fake_openai, redis_store) -> None:
    """agentctl's `grants revoke all` (POST /admin) and `!grants revoke all` are answered by one instance,
    which may never have met the session whose grant another instance gave."""
    from plugins import _shell_admin

    recorder = Recorder()
    async with two(tmp_path, redis_store, {"fake": openai_model(fake_openai)}, gates=ALL_GATED) as (a, b):
        for rt in (a, b):
            add_plugin_tools(rt, "plugin_test", [recorder.tool("web_search", Query)], {"web_search": {"type": "read"}})

        async def search(rt: state.Runtime, client: str, answer: str) -> list[str]:
            sub = rt.hub.subscribe(client, None)
            fake_openai.script(tool_call("web_search", {"query": "q"}), text("done"))
            ran = await routes.submit(rt, ask(rt, client, "search", shell_payload(rt, client, None)))
            names = []
            async with asyncio.timeout(20):
                async for ev in sub:
                    if ev.turn == ran.id:
                        names.append(ev.name)
                        if ev.name == "gate":
                            assert await rt.gate.resolve(ev.data["gate_id"], answer, by="shell")
                        if ev.name == "done":
                            break
            await sub.aclose()
            return names

        for client in ("c1", "c2"):  # grants of two sessions, given on A only
            assert (await search(a, client, "allow_session")).count("gate") == 1
        listing = await _shell_admin.handle(b, _shell_admin.AdminBody(action="grants"))
        assert sorted(g["session"] for g in listing["grants"]) == ["c1", "c2"]
        revoked = await _shell_admin.handle(b, _shell_admin.AdminBody(action="revoke", which="all"))
        assert len(revoked["revoked"]) == 2
        assert (await search(a, "c1", "reject")).count("gate") == 1  # A asks again
        assert (await search(a, "c2", "allow_session")).count("gate") == 1
        mine = await routes.wait_turn(b, ask(b, "c2", "!grants revoke all", shell_payload(b, "c2", None)), 20)
        assert mine["text"].startswith("Revoked"), mine  # B had not met c2's new grant
        assert (await search(a, "c2", "reject")).count("gate") == 1


async def test_a_session_deleted_on_one_instance_is_not_saved_again_by_its_turn_on_another(tmp_path, fake_openai,
                                                                                         redis_store) -> None:
    async with two(tmp_path, redis_store, {"fake": openai_model(fake_openai)}) as (a, b):
        # The answer never ends by itself (no hold.set()): only the delete ends A's turn, however slow B is.
        fake_openai.script(text("slow ", "answer", hold=threading.Event()))
        sub = a.hub.subscribe("c1", a.hub.last_id("c1"))
        ran = await routes.submit(a, ask(a, "c1", "take your time", shell_payload(a, "c1", None)))
        async with asyncio.timeout(20):
            async for ev in sub:
                if ev.name == "tok":
                    break
        await b.sessions.refresh()
        await routes.delete_session(b, "c1")  # while A's turn still runs: it is cancelled there
        async with asyncio.timeout(20):
            async for ev in sub:
                if ev.turn == ran.id and routes.ends_turn(ev):
                    break
        await asyncio.wait([ran.task], timeout=60)  # A's turn has cleaned up (its last save would come by now)
        assert ran.task.done()
        assert not await a.sessions.exists("c1") and a.sessions.get("c1") is None
        await b.sessions.refresh()
        assert b.sessions.all() == []
        await sub.aclose()


async def test_a_copy_of_a_deleted_session_another_instance_kept_never_overwrites_the_new_one(tmp_path, fake_openai,
                                                                                             redis_store) -> None:
    async with two(tmp_path, redis_store, {"fake": openai_model(fake_openai)}) as (a, b):
        fake_openai.script(text("noted"))
        sub = a.hub.subscribe("c1", a.hub.last_id("c1"))
        ran = await routes.submit(a, ask(a, "c1", "my secret", shell_payload(a, "c1", None)))
        await until_done(sub, ran.id)
        kept = a.sessions.get("c1")  # A learns of a deletion elsewhere only when it next reads the store
        await b.sessions.refresh()
        await routes.delete_session(b, "c1")
        anew = await b.sessions.get_or_create("c1", "fake")  # the client starts over, under the same id
        # A saves its copy without reading the store first (what a command or an MCP tool call on it does).
        await a.sessions.save(kept)
        assert a.sessions.get("c1") is None
        await b.sessions.refresh()
        stored = b.sessions.get("c1")
        assert stored.history == [] and stored.shorthand == anew.shorthand != kept.shorthand
        await sub.aclose()


async def test_a_task_cancelled_during_a_redis_call_ends_there(redis_store) -> None:
    """redis-py sends a command through asyncio.wait_for, which on Python 3.11 drops a cancellation that comes
    just as the send finishes. Such a task ran on: closing the store waited forever for its recovery loop."""
    link = shared_link.Link(redis_store)
    await link.open()

    async def calls() -> None:
        while True:
            with link.calling():
                await link.client.ping()

    try:
        for n in range(40):  # cancelled at 40 moments across a few round trips
            task = asyncio.create_task(calls())
            await asyncio.sleep(n * 0.000075)
            task.cancel()
            ended = (await asyncio.wait([task], timeout=2))[0]
            while not task.done():  # it ran on: ended for good before the test fails
                task.cancel()
                await asyncio.wait([task], timeout=0.1)
            assert ended, f"a task cancelled {n * 75} µs after it began its Redis calls ran on"
    finally:
        await link.close()


async def test_closing_ends_a_background_task_that_lost_its_cancellation() -> None:
    lost = 0

    async def loop() -> None:  # an instance's heartbeat or signal listener
        nonlocal lost
        while True:
            try:
                await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                if lost:
                    raise
                lost += 1  # as redis-py's asyncio.wait_for can: the cancellation is gone, the loop runs on
                asyncio.current_task().uncancel()

    task = asyncio.create_task(loop())
    await asyncio.sleep(0)
    await asyncio.wait_for(shared_link.stop_task(task), 5)
    assert task.cancelled() and lost == 1


async def test_a_new_message_or_a_stop_on_one_instance_ends_the_turn_running_on_another(tmp_path, fake_openai,
                                                                                      redis_store) -> None:
    async with two(tmp_path, redis_store, {"fake": openai_model(fake_openai)}) as (a, b):
        sub = b.hub.subscribe("c1", b.hub.last_id("c1"))

        async def first_token_of(rt: state.Runtime, text_: str) -> str:
            fake_openai.script(text("never ", "ending ", "story", delay=5))
            ran = await routes.submit(rt, ask(rt, "c1", text_, shell_payload(rt, "c1", None)))
            async with asyncio.timeout(20):
                async for ev in sub:
                    if ev.turn == ran.id and ev.name == "tok":
                        return ran.id
            return ran.id

        slow = await first_token_of(a, "tell me everything")
        fake_openai.script(text("short answer"))
        newer = await routes.submit(b, ask(b, "c1", "never mind", shell_payload(b, "c1", None)), cancel_running=True)
        events = await until_done_both(sub, {newer.id})
        assert {"text": "[cancelled]", "cancelled": True} in [e.data for e in events if e.turn == slow]
        assert said([e for e in events if e.turn == newer.id]) == "short answer"
        # A stop on B ends A's turn at once, with a `done` (clients waiting for one stop waiting).
        slow = await first_token_of(a, "and again")
        assert await routes.stop(b, "c1")
        events = await until_done(sub, slow)
        assert [e.name for e in events][-1] == "done" and "story" not in said(events)
        await sub.aclose()


@pytest.mark.parametrize(("url", "says"), [
    ("redis://db.example:6379/abc", "the database after the port must be a number"),
    ("redis://db.example:99999/0", "the port must be a number from 1 to 65535"),
    ("redis://:secret@db.example:6379/0?prefix=", "prefix= is empty"),
    ("redis:///0", "names no host"),
    ("postgres://user:secret@db.example/agent", "SESSION_STORE=postgres:… is not supported"),
    ("redis:/db.example", "use 'sqlite' (the default), 'sqlite:///<path>', 'memory', or redis://host:port/db"),
])
def test_a_session_store_url_redis_would_misread_is_refused_with_what_to_write(tmp_path, url, says) -> None:
    # redis-py itself would take "/abc" for database 0 and fail on the port with a traceback.
    with pytest.raises(stores.SessionError) as refused:
        shared_store.open_store(url, tmp_path)
    assert says in str(refused.value) and "secret" not in str(refused.value)


async def test_an_instance_that_lost_its_turn_lease_does_not_write_over_what_came_after(tmp_path, fake_openai,
                                                                                        redis_store) -> None:
    """A paused instance (a frozen VM, a stalled process) loses its lease; another ends its turn and runs the
    next. When the paused one wakes, its late answer must not replace the history written meanwhile."""
    hold = threading.Event()
    async with two(tmp_path, redis_store, {"fake": openai_model(fake_openai)}) as (a, b):
        fake_openai.script(text("late ", "answer", hold=hold))
        sub = b.hub.subscribe("c1", None)
        first = await routes.submit(a, ask(a, "c1", "first", shell_payload(a, "c1", None)))
        assert [e.name for e in [await anext(sub), await anext(sub)]] == ["user", "tok"]  # the model answers
        # What a pause longer than the lease looks like from outside: the lease is gone.
        link = a.sessions.store.link
        await link.client.delete(link.key("lease", "c1"))
        ended = await until_done(sub, first.id)  # another instance ends the turn it thinks is dead
        assert [e.name for e in ended][-2:] == ["error", "done"]
        second = await routes.submit(b, ask(b, "c1", "second", shell_payload(b, "c1", None)), cancel_running=False)
        assert said(await until_done(sub, second.id)) == "echo: second"
        hold.set()  # the paused instance wakes up
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(first.task, 20)
        await b.sessions.refresh()
        assert [m["content"] for m in b.sessions.get("c1").history] == ["first", "second", "echo: second"]
        await sub.aclose()


def test_the_redis_password_never_reaches_the_log(capsys) -> None:
    from tests.runtime import entry

    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        entry()._setup_logging("INFO", {"SESSION_STORE": "redis://:S3cret%2Fpass@db.example:6379/0"})
        logging.getLogger("agent_mcp.test").warning("connecting with S3cret/pass")
    finally:
        root.handlers[:], root.level = handlers, level
    err = capsys.readouterr().err
    assert "connecting with ***" in err and "S3cret" not in err
