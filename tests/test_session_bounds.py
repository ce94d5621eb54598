"""Session bounds on a real SQLite file with an injected clock: expiry, caps, history, restarts."""

from __future__ import annotations

import asyncio
import json

import pytest

import build
import routes
import stores
from config import ConfigError, SessionsConfig, load_config
from sessions import TRUNCATED, SessionLimits, SessionManager, SessionPolicy
from tests.conftest import ConfigDir, openai_model
from tests.runtime import SHIPPED_NAMESPACES, ask

DAY = 86400.0


class Clock:
    """A clock the test moves by hand."""

    def __init__(self, now: float = 1_000_000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, days: float) -> None:
        self.now += days * DAY


def policy(**sessions) -> SessionPolicy:
    """The policy the server builds from `plugins-enabled.json` `sessions` (gate's client classes)."""
    return build.session_policy(SessionsConfig.model_validate(sessions), SHIPPED_NAMESPACES)


@pytest.fixture
async def manager():
    """Opens managers over SQLite files; closes whatever a test left open, failed or not."""
    opened: list[SessionManager] = []

    async def open_manager(path, clock, pol=None, **kw) -> SessionManager:
        """A manager over `path`, opened (bounds apply at its first `sweep()`, as in the server)."""
        m = SessionManager(stores.SqliteStore(path), pol or policy(), clock=clock, **kw)
        opened.append(m)
        await m.open()
        return m

    yield open_manager
    for m in opened:
        await m.close()


def stored_ids(m: SessionManager) -> set[str]:
    return {s.client_id for s in m.all()}


async def test_non_interactive_sessions_expire_after_their_idle_time_and_the_shell_never(manager, tmp_path):
    clock = Clock()
    m = await manager(tmp_path / "s.db", clock, policy(classes={"proxy": {"idle_days": 30}}))
    for cid in ("shell-1", "api-a", "api-swarm-b", "llama-10.0.0.1", "slack-C1-T1", "mcp-x"):
        await m.get_or_create(cid, "m")
    clock.advance(6.9)
    await m.get_or_create("api-fresh", "m")
    assert await m.sweep() == []
    clock.advance(0.2)  # 7.1 days after the first ones: past the default 7 days, not the proxy's 30
    assert sorted(await m.sweep()) == ["api-a", "api-swarm-b", "mcp-x", "slack-C1-T1"]
    assert stored_ids(m) == {"shell-1", "api-fresh", "llama-10.0.0.1"}
    clock.advance(365)
    await m.sweep()
    assert stored_ids(m) == {"shell-1"}  # interactive: never expires by default
    await m.close()
    again = await manager(tmp_path / "s.db", clock)
    assert stored_ids(again) == {"shell-1"}  # the store forgot them too
    await again.close()


async def test_activity_resets_the_idle_time(manager, tmp_path):
    clock = Clock()
    m = await manager(tmp_path / "s.db", clock)
    s = await m.get_or_create("api-a", "m")
    clock.advance(5)
    m.get_or_add("api-a", "m")  # a request arrives
    await m.save(s)
    clock.advance(5)
    assert await m.sweep() == [] and m.get("api-a") is s
    clock.advance(2.1)
    assert await m.sweep() == ["api-a"]
    await m.close()


async def test_restart_keeps_last_activity_and_applies_expiry_at_open(manager, tmp_path):
    clock = Clock()
    m = await manager(tmp_path / "s.db", clock)
    await m.get_or_create("api-old", "m")
    clock.advance(3)
    await m.get_or_create("api-new", "m")
    await m.close()
    clock.advance(5)  # the server was down; api-old is now 8 days idle, api-new 5
    m2 = await manager(tmp_path / "s.db", clock)
    assert await m2.sweep() == ["api-old"]  # the server's first sweep, when it starts
    assert stored_ids(m2) == {"api-new"}
    assert m2.get("api-new").updated == clock.now - 5 * DAY  # read back from the `updated` column
    await m2.close()


async def test_cap_evicts_the_least_recently_active_of_the_class_only(manager, tmp_path):
    clock = Clock()
    m = await manager(tmp_path / "s.db", clock, policy(non_interactive={"max_sessions": 3}))
    for cid in ("api-1", "api-2", "api-3", "slack-1"):
        await m.get_or_create(cid, "m")
        clock.advance(0.01)
    first = m.get("api-1")
    m.get_or_add("api-1", "m")
    await m.save(first)  # api-1 is now the most recently active
    clock.advance(0.01)
    await m.get_or_create("api-4", "m")  # over the cap of 3: the LRU api session goes
    assert stored_ids(m) == {"api-1", "api-3", "api-4", "slack-1"}
    await m.close()
    m2 = await manager(tmp_path / "s.db", clock, policy(non_interactive={"max_sessions": 3}))
    assert await m2.sweep() == [] and stored_ids(m2) == {"api-1", "api-3", "api-4", "slack-1"}
    await m2.close()
    # A lower cap after a restart applies at the first sweep: the least recently active go.
    m3 = await manager(tmp_path / "s.db", clock, policy(non_interactive={"max_sessions": 1}))
    assert await m3.sweep() == ["api-3", "api-1"] and stored_ids(m3) == {"api-4", "slack-1"}
    await m3.close()


async def test_interactive_sessions_have_their_own_cap(manager, tmp_path):
    clock = Clock()
    m = await manager(tmp_path / "s.db", clock, policy(interactive={"idle_days": None, "max_sessions": 2}))
    for cid in ("alice", "bob", "carol"):
        await m.get_or_create(cid, "m")
        clock.advance(1)
    assert stored_ids(m) == {"bob", "carol"}
    await m.close()


async def test_a_busy_session_is_neither_expired_nor_evicted(manager, tmp_path):
    clock = Clock()
    running: set[str] = set()
    m = await manager(tmp_path / "s.db", clock, policy(non_interactive={"max_sessions": 2}),
                      is_busy=running.__contains__)
    locked = await m.get_or_create("api-locked", "m")
    await m.get_or_create("api-queued", "m")
    running.add("api-queued")  # a request waits for the session (routes: rt.active_tasks)
    clock.advance(10)
    async with locked.lock:  # a turn runs on it
        assert await m.sweep() == []  # both idle for 10 days, but busy
        await m.get_or_create("api-new", "m")  # over the cap, but both older ones are busy
        assert stored_ids(m) == {"api-locked", "api-queued", "api-new"}
    running.clear()
    assert sorted(await m.sweep()) == ["api-locked", "api-queued"]
    assert stored_ids(m) == {"api-new"}
    await m.close()


async def test_a_sweep_uses_the_classes_known_when_it_runs(manager, tmp_path):
    """Classes declared after the sessions were loaded (plugins load later) decide the sweep."""
    clock = Clock()
    owners: dict[str, str] = {}
    limits = {"interactive": SessionLimits(None, 10), "other": SessionLimits(DAY, 10)}
    pol = SessionPolicy(
        classify=lambda s: owners.get(s.client_id.split("-")[0], "other"), limits=limits.__getitem__
    )
    m = await manager(tmp_path / "s.db", clock, pol)
    await m.get_or_create("term-1", "m")
    await m.close()
    clock.advance(2)
    m2 = await manager(tmp_path / "s.db", clock, pol)  # loaded while no plugin has declared `term-`
    owners["term"] = "interactive"
    assert await m2.sweep() == [] and stored_ids(m2) == {"term-1"}


async def test_a_sweep_skips_sessions_deleted_while_it_runs(manager, tmp_path):
    clock = Clock()
    m = await manager(tmp_path / "s.db", clock)
    for cid in ("api-a", "api-b"):
        await m.get_or_create(cid, "m")
    clock.advance(8)
    deleting = asyncio.ensure_future(m.delete("api-b"))  # runs while the sweep waits for the store
    assert await m.sweep() == ["api-a"]
    assert (await deleting).client_id == "api-b" and m.all() == []


async def test_shorthand_ids_are_never_reused_after_expiry_eviction_and_restart(manager, tmp_path):
    clock = Clock()
    pol = policy(non_interactive={"max_sessions": 1})
    m = await manager(tmp_path / "s.db", clock, pol)
    a = await m.get_or_create("api-a", "m")
    clock.advance(1)
    b = await m.get_or_create("api-b", "m")  # evicts api-a (101)
    clock.advance(8)
    await m.sweep()  # expires api-b (102)
    assert (a.shorthand, b.shorthand) == (101, 102) and m.all() == [] and m.resolve("101") is None
    await m.close()
    m2 = await manager(tmp_path / "s.db", clock, pol)
    assert (await m2.get_or_create("api-c", "m")).shorthand == 103
    await m2.close()


def turn(n: int, tools: int = 0) -> list[dict]:
    """One turn: a question, `tools` native tool calls with their results, a text tool call, the answer."""
    out: list[dict] = [{"role": "user", "content": f"q{n}"}]
    for i in range(tools):
        out.append({"role": "assistant", "content": "", "tool_calls": [{"id": f"c{n}.{i}", "name": "t", "args": {}}]})
        out.append({"role": "tool", "tool_call_id": f"c{n}.{i}", "name": "t", "content": "r"})
    if tools:
        out.append({"role": "assistant", "content": "<tool_code>t()</tool_code>"})
        out.append({"role": "user", "content": "[Tool result for t]:\nr", "tool_results": True})
    out.append({"role": "assistant", "content": f"a{n}"})
    return out


def assert_whole_turns(history: list[dict]) -> None:
    """Starts at a question, and every tool result follows the assistant message that called it."""
    assert history[0]["role"] == "user" and not history[0].get("tool_results")
    called: set[str] = set()
    for msg in history:
        called |= {c["id"] for c in msg.get("tool_calls", [])}
        if msg["role"] == "tool":
            assert msg["tool_call_id"] in called


@pytest.mark.parametrize("cap", [2, 5, 9, 10, 11, 17, 40])
async def test_history_cap_drops_the_oldest_whole_turns(manager, tmp_path, cap):
    clock = Clock()
    m = await manager(tmp_path / "s.db", clock, policy(max_history_messages=cap))
    s = await m.get_or_create("alice", "m")
    turns = [turn(n, tools=n % 3) for n in range(6)]  # 2, 6 and 10 messages
    s.history.extend(msg for t in turns for msg in t)
    whole = list(s.history)
    await m.save(s)
    assert_whole_turns(s.history)
    expected: list[dict] = []  # the most recent whole turns that fit; the newest turn alone when none does
    for t in reversed(turns):
        if len(expected) + len(t) > cap:
            break
        expected = t + expected
    assert s.history == (expected or turns[-1])
    assert len(whole) > cap or s.history == whole
    await m.close()
    m2 = await manager(tmp_path / "s.db", clock)
    assert m2.get("alice").history == s.history
    await m2.close()


async def test_overlong_stored_messages_are_cut(manager, tmp_path):
    clock = Clock()
    m = await manager(tmp_path / "s.db", clock, policy(max_message_chars=1000))
    s = await m.get_or_create("alice", "m")
    s.history += [{"role": "user", "content": "x" * 5000}, {"role": "assistant", "content": "short"}]
    await m.save(s)
    assert s.history[0]["content"] == "x" * 1000 + TRUNCATED and s.history[1]["content"] == "short"
    await m.close()


def test_settings_are_checked_with_the_file_and_field_named(tmp_path):
    cfg = ConfigDir(tmp_path)
    cfg.models = {"m": {"model_id": "x", "type": "OPENAI"}}
    cfg.write()
    enabled = json.loads((tmp_path / "plugins-enabled.json").read_text())
    enabled["sessions"] = {"classes": {"api": {"idle_days": 0}}, "max_history_messages": 1}
    (tmp_path / "plugins-enabled.json").write_text(json.dumps(enabled))
    with pytest.raises(ConfigError) as err:
        load_config(tmp_path)
    text = str(err.value)
    assert "plugins-enabled.json" in text
    assert "field 'sessions.classes.api.idle_days'" in text and "field 'sessions.max_history_messages'" in text


def test_a_class_name_that_names_no_client_class_is_reported(caplog):
    policy(classes={"prxy": {"idle_days": 1}, "proxy": {"idle_days": 2}})
    assert "field 'sessions.classes': prxy name no client class" in caplog.text


async def test_the_server_expires_through_the_delete_path(manager, tmp_path, fake_openai):
    """build_runtime wires the bounds: expiry drops the event channel and rate-limit windows, spares running turns."""
    cfg = ConfigDir(tmp_path)
    cfg.models = {"fake": openai_model(fake_openai)}
    cfg.write()
    enabled = json.loads((tmp_path / "plugins-enabled.json").read_text())
    enabled["sessions"] = {"non_interactive": {"idle_days": 1}}
    (tmp_path / "plugins-enabled.json").write_text(json.dumps(enabled))
    rt = await build.build_runtime(load_config(tmp_path), store=stores.SqliteStore(tmp_path / "sessions.sqlite3"))
    rt.client_namespaces.update(SHIPPED_NAMESPACES)
    clock = Clock()
    rt.sessions.clock = clock
    try:
        for cid in ("api-running", "api-idle", "me"):  # the sweep looks at api-running first
            shell = {"interactive": True} if cid == "me" else None  # as the shell endpoint vouches
            answer = await routes.wait_turn(rt, ask(rt, cid, "!help", shell), 30)
            assert answer["status"] == "complete"
        rt.rate_limiter.disabled["api-idle"] = {"search"}
        assert "api-idle" in rt.hub._channels
        clock.advance(2)
        # A request submitted (in rt.active_tasks) that has not yet touched its session.
        queued = await routes.submit(rt, ask(rt, "api-running", "!help"), cancel_running=False)
        assert await rt.sessions.sweep() == ["api-idle"]
        assert "api-idle" not in rt.hub._channels and "api-idle" not in rt.rate_limiter.disabled
        assert rt.sessions.get("me") is not None  # the shell
        await queued.task
        assert rt.sessions.get("api-running").updated == clock.now  # its request was activity
    finally:
        await build.close_runtime(rt)
    reopened = await manager(tmp_path / "sessions.sqlite3", clock)
    assert stored_ids(reopened) == {"api-running", "me"}


async def test_the_sweeper_runs_every_sweep_interval_until_close(manager, tmp_path):
    clock = Clock()
    swept = asyncio.Event()
    m = await manager(tmp_path / "s.db", clock, policy(sweep_minutes=0.0001))
    await m.get_or_create("api-a", "m")
    clock.advance(8)
    m.forgotten.append(lambda cid: swept.set())
    m.start_sweeping()
    await swept.wait()
    assert m.get("api-a") is None
    await m.close()
    assert m._sweeper is None


async def test_the_mcp_approval_store_keeps_the_newest_decisions_and_every_open_gate(tmp_path):
    from plugins._mcp_approvals import ApprovalStore

    store = ApprovalStore(tmp_path / "mcp-approvals.sqlite3", kept=3)
    reopened = ApprovalStore(tmp_path / "mcp-approvals.sqlite3", kept=2)
    try:
        await _decide_and_reopen(store, reopened)
    finally:
        await store.close()
        await reopened.close()


async def _decide_and_reopen(store, reopened) -> None:
    await store.open()
    for i in range(6):
        await store.record_open({"gate_id": f"g{i}", "session": "api-a", "tool_name": "t", "request": {},
                                 "opened_at": float(i)})
    for i in range(5):  # g5 stays open
        await store.record_decision(f"g{i}", "reject", "test", 100.0 + i)
    assert [r["gate_id"] for r in await store.history()] == ["g4", "g3", "g2"]
    async with store._conn().execute("SELECT gate_id FROM approvals WHERE decision IS NULL") as cur:
        assert [row[0] async for row in cur] == ["g5"]
    await store.close()
    await reopened.open()  # g5 becomes 'abandoned' (decided now), and the cap applies at open
    assert [r["gate_id"] for r in await reopened.history()] == ["g5", "g4"]


async def test_why_a_session_went_is_told_once_and_throwaway_ones_are_not_remembered(manager, tmp_path):
    clock = Clock()
    m = await manager(tmp_path / "s.db", clock, policy(classes={"api": {"idle_days": 1}}))
    for cid in ("api-deleted", "api-throwaway", "api-idle"):
        await m.get_or_create(cid, "m")
    await m.delete("api-deleted")
    await m.delete("api-throwaway", remember=False)
    clock.advance(2)
    assert await m.sweep() == ["api-idle"]
    assert [await m.take_gone(c) for c in ("api-deleted", "api-throwaway", "api-idle")] == ["deleted", None, "expired"]
    assert await m.take_gone("api-deleted") is None  # told once
