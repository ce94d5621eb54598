"""gate.py and rate_limits.py: the gate matrix, gate state layering, decisions, the rate limiter."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from pydantic import BaseModel

import client_classes
import gate
import rate_limits
import routes
import stores
import turns
from config import GateDefaults, RateLimit
from events import EventHub
from tests.conftest import openai_model
from tests.fakes.backend import text, tool_call
from tests.runtime import (
    ALL_GATED,
    ALL_OPEN,
    Recorder,
    add_plugin_tools,
    as_request,
    ask,
    execute,
    runtime,
    turn,
    with_events,
)

# ── Clients ─────────────────────────────────────────────────────────────────────────────────

CLIENTS = {"shell": "4f1c2a9e-shell", "api": "api-1a2b3c4d", "swarm": "api-swarm-1a2b3c4d",
           "proxy": "llama-127.0.0.1", "slack": "slack-C123-1700000000.1", "mcp": "mcp-worker"}


async def test_client_classes_come_from_the_namespaces_plugins_declare(tmp_path, fake_openai) -> None:
    async with runtime(tmp_path, {"fake": openai_model(fake_openai)}) as rt:
        spaces = rt.client_namespaces
        classes = {kind: client_classes.client_class(cid, spaces) for kind, cid in CLIENTS.items()}
        # A bare id belongs to no plugin: only the shell endpoint's vouching makes a request the shell's.
        assert classes == {**{k: k for k in CLIENTS}, "shell": client_classes.UNKNOWN}
        assert ask(rt, CLIENTS["shell"], "", {"interactive": True}).turn().kind == client_classes.SHELL
        # the shell acts anywhere
        assert ask(rt, "api-x", "", {"interactive": True}).turn().kind == client_classes.SHELL
        rt.client_namespaces.clear()  # no plugin loaded: nobody vouches for any id
        assert {client_classes.client_class(cid, spaces) for cid in CLIENTS.values()} == {client_classes.UNKNOWN}


async def test_may_administer_follows_the_request_not_the_client_id() -> None:
    assert not client_classes.may_administer(None)  # outside a request: nobody
    # the class alone gives nothing
    assert not client_classes.may_administer(turns.Turn("c1", "t1", client_classes.SHELL))
    for vouched in ({"interactive": True}, {"admin": True}):
        assert client_classes.may_administer(turns.Turn("api-x", "t1", client_classes.UNKNOWN, **vouched))


# ── The matrix: gate type × client × gate on/off ────────────────────────────────────────────


class _Args(BaseModel):
    sql: str = ""
    query: str = ""
    url: str = ""
    operation: str = "list"
    section: str = ""


GATE_TYPES: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    # gate type: (tool, its declaration, the call's arguments)
    "db": ("db_query", {"type": "db"}, {"sql": "SELECT * FROM users"}),
    "search": ("web_search", {"type": "search"}, {"query": "weather"}),
    "extract": ("url_extract", {"type": "extract"}, {"url": "https://example.org"}),
    "drive": ("google_drive", {"type": "drive", "operation": lambda a: "write" if a["operation"] in
                               ("create", "append", "delete") else "read"}, {"operation": "delete"}),
    "system": ("prompt_tool", {"type": "system", "operation": "write"}, {"section": "behavior"}),
    "plugin (mcp)": ("mcp_call", {"type": "mcp", "operation": "write"}, {"query": "x"}),
}


@pytest.fixture(params=["on", "off"])
async def matrix_rt(request, tmp_path, fake_openai):
    gates = ALL_GATED if request.param == "on" else ALL_OPEN
    async with runtime(tmp_path, {"fake": openai_model(fake_openai)}, gates=gates,
                       env={"GATE_TIMEOUT": "30", "API_GATE_TIMEOUT": "30"}) as rt:
        recorder = Recorder()
        add_plugin_tools(rt, "plugin_test_matrix", [recorder.tool(t, _Args) for t, _, _ in GATE_TYPES.values()],
                         {t: spec for t, spec, _ in GATE_TYPES.values()})
        rt.recorder = recorder  # type: ignore[attr-defined]
        rt.gates_on = request.param == "on"  # type: ignore[attr-defined]
        yield rt


@pytest.mark.parametrize("client", list(CLIENTS))
@pytest.mark.parametrize("gate_type", list(GATE_TYPES))
async def test_gate_matrix(matrix_rt, gate_type: str, client: str) -> None:
    rt, client_id = matrix_rt, CLIENTS[client]
    tool, _, args = GATE_TYPES[gate_type]
    await rt.sessions.get_or_create(client_id, "fake")
    result, events = await with_events(rt, client_id, execute(rt, client_id, tool, args), answer="allow")
    gates = [e for e in events if e.name == "gate"]
    if not rt.gates_on:
        expect_ran, expect_event = True, False
    else:
        expect_event = client in ("shell", "api", "mcp")  # the others cannot answer: rejected without asking
        expect_ran = expect_event  # the test answers "allow"
    assert bool(gates) == expect_event
    assert (rt.recorder.calls == [(tool, {**_Args().model_dump(), **args})]) == expect_ran, result
    if expect_ran:
        assert result.startswith("ok: ")
    else:
        assert result.startswith("TOOL CALL REJECTED") and "cannot give it" in result
    if gates:
        payload = gates[0].data
        assert set(payload) == {"gate_id", "tool_name", "tool_args", "tables", "timeout_seconds", "grants", "shape"}
        assert payload["grants"] == ["allow_for", "allow_session", "allow_pattern"]
        assert payload["tool_name"] == tool and payload["timeout_seconds"] == 30
        expected_op = "read" if gate_type in ("db", "search", "extract") else "write"
        assert payload["tool_args"]["operation_type"] == expected_op
        assert payload["tables"] == (["users"] if gate_type == "db" else [])
    assert rt.gate.pending == {}


# ── Decisions, timeouts, cancellation ───────────────────────────────────────────────────────


@pytest.fixture
async def grt(tmp_path, fake_openai):
    async with runtime(tmp_path, {"fake": openai_model(fake_openai)}, gates={
        "db": {"*": {"read": False, "write": False}, "__meta__": {"read": True, "write": False},
               "audit": {"read": True, "write": False}},
        "tools": {"*": {"read": False, "write": False}, "get_system_info": {"read": True, "write": False}},
    }, env={"GATE_TIMEOUT": "0.3", "API_GATE_TIMEOUT": "0.2"}) as rt:
        recorder = Recorder()
        add_plugin_tools(
            rt,
            "plugin_test_gates",
            [recorder.tool("db_query", _Args), recorder.tool("web_search", _Args)],
            {"db_query": {"type": "db"}, "web_search": {"type": "search"}},
        )
        rt.recorder = recorder  # type: ignore[attr-defined]
        yield rt


async def test_reject_and_timeouts_tell_the_model(grt) -> None:
    await grt.sessions.get_or_create("c1", "fake")
    result, events = await with_events(grt, "c1", execute(grt, "c1", "web_search", {"query": "q"}), "reject")
    assert result.startswith("TOOL CALL REJECTED: the user rejected your web_search request")
    assert any(e.name == "status" and e.data.get("decision") == "reject" for e in events)
    result, events = await with_events(grt, "c1", execute(grt, "c1", "web_search", {"query": "q"}))
    assert "within 0.3 s" in result and [e.data["timeout_seconds"] for e in events if e.name == "gate"] == [0.3]
    assert any(e.data.get("decision") == "timeout" for e in events)
    result, events = await with_events(grt, "api-00000001", execute(grt, "api-00000001", "web_search",
                                                                                {"query": "q"}))
    assert "within 0.2 s" in result and [e.data["timeout_seconds"] for e in events if e.name == "gate"] == [0.2]
    # MCP sessions are answered by a person (a human token): they wait as long as the shell does.
    result, events = await with_events(grt, "mcp-w", execute(grt, "mcp-w", "web_search", {"query": "q"}))
    assert "within 0.3 s" in result and [e.data["timeout_seconds"] for e in events if e.name == "gate"] == [0.3]
    assert grt.recorder.calls == [] and grt.gate.pending == {}


async def test_allow_for_this_session_is_remembered_and_persisted(grt) -> None:
    await grt.sessions.get_or_create("c1", "fake")
    other = await grt.sessions.get_or_create("c2", "fake")
    call = {"sql": "SELECT * FROM users JOIN orders ON users.id = orders.uid"}
    result, events = await with_events(grt, "c1", execute(grt, "c1", "db_query", call), "allow_session")
    assert result.startswith("ok") and [e.data["tables"] for e in events if e.name == "gate"] == [["orders", "users"]]
    [grant] = grt.gate.grants.active("c1")  # a grant of the session, persisted with its tables and permission
    assert (grant.scope, grant.keys, grant.op, grant.expires) == ("allow_session", ("orders", "users"), "read", None)
    # Same session: no gate; a write on the same table is still gated; another session is still gated.
    result, events = await with_events(grt, "c1", execute(grt, "c1", "db_query", {"sql": "SELECT 1 FROM users"}))
    assert result.startswith("ok") and not [e for e in events if e.name == "gate"]
    _, events = await with_events(grt, "c1", execute(grt, "c1", "db_query", {"sql": "DELETE FROM users"}),
                                  "reject")
    assert [e.data["tool_args"]["operation_type"] for e in events if e.name == "gate"] == ["write"]
    _, events = await with_events(grt, "c2", execute(grt, "c2", "db_query", call), "reject")
    assert [e for e in events if e.name == "gate"] and other.settings == {} and grt.gate.grants.active("c2") == []
    # An unanalysable statement is never remembered for the session.
    _, events = await with_events(grt, "c1", execute(grt, "c1", "db_query", {"sql": "CALL p()"}),
                                  "allow_session")
    assert [g.keys for g in grt.gate.grants.active("c1")] == [("orders", "users")]
    assert any("never granted beyond this call" in e.data.get("text", "") for e in events)


async def test_defaults_metadata_and_specific_tables(grt) -> None:
    await grt.sessions.get_or_create("c1", "fake")
    for sql in ("SHOW TABLES", "DESCRIBE users", "SELECT * FROM audit"):  # auto-allowed reads
        result, events = await with_events(grt, "c1", execute(grt, "c1", "db_query", {"sql": sql}))
        assert result.startswith("ok") and not [e for e in events if e.name == "gate"], sql
    _, events = await with_events(grt, "c1", execute(grt, "c1", "db_query",
                                                                 {"sql": "SELECT * FROM audit, secrets"}), "reject")
    assert [e.data["tables"] for e in events if e.name == "gate"] == [["audit", "secrets"]]


def test_layering_specific_beats_wildcard_and_session_beats_defaults() -> None:
    keeper = gate.GateKeeper(GateDefaults.model_validate({
        "db": {"*": {"read": True, "write": True}, "payroll": {"read": True, "write": False}},
        "tools": {"*": {"read": False}, "web_search": {"read": True}},
    }), EventHub())
    session = stores.Session("c1", 101, "fake")
    assert keeper.allowed(session, "db", "orders", "write")  # wildcard
    assert not keeper.allowed(session, "db", "payroll", "write")  # specific entry beats the wildcard
    # Unknown tables ("*"): allowed only if the explicitly gated tables would be too.
    assert not keeper.allowed(session, "db", "*", "write") and keeper.allowed(session, "db", "*", "read")
    keeper.set_override(session, "db", "payroll", "write", True)
    assert keeper.allowed(session, "db", "payroll", "write") and keeper.allowed(session, "db", "*", "write")
    keeper.set_override(session, "db", "*", "read", False)  # session wildcard: tables without own entry
    assert not keeper.allowed(session, "db", "orders", "read") and keeper.allowed(session, "db", "payroll", "read")
    assert keeper.allowed(session, "tools", "web_search", "read") and not keeper.allowed(session, "tools", "x", "read")
    assert not keeper.allowed(None, "tools", "x", "write")


def test_operation_callables_fail_closed() -> None:
    def boom(args: dict[str, Any]) -> str:
        raise KeyError("operation")

    assert gate.resolve_operation({"type": "drive", "operation": boom}, {}) == "write"
    assert gate.resolve_operation({"type": "drive", "operation": lambda a: "delete"}, {}) == "write"
    assert gate.resolve_operation({"type": "search"}, {}) == "read"


def test_bad_gate_timeout_is_a_config_error() -> None:
    from config import ConfigError

    with pytest.raises(ConfigError, match="GATE_TIMEOUT"):
        gate.GateKeeper.from_env(GateDefaults(), EventHub(), {"GATE_TIMEOUT": "soon"})
    assert gate.GateKeeper.from_env(GateDefaults(), EventHub(), {}).timeout == gate.DEFAULT_GATE_TIMEOUT


async def test_a_new_submit_cancels_a_waiting_gate_and_cleans_it(grt, fake_openai) -> None:
    grt.gate.timeout = 30
    fake_openai.script(tool_call("web_search", {"query": "q"}))
    sub = grt.hub.subscribe("c1", grt.hub.last_id("c1"))
    await routes.submit(grt, ask(grt, "c1", "search something", {"interactive": True}))
    async for ev in sub:
        if ev.name == "gate":
            break
    assert len(grt.gate.pending) == 1
    out, events = await turn(grt, "never mind")
    assert out == "echo: never mind" and events[0].data.get("cancelled") is True
    assert grt.gate.pending == {} and grt.recorder.calls == []
    await sub.aclose()


async def test_at_model_bypasses_gates_only_for_the_shell(grt, fake_openai) -> None:
    for client_id, bypass in (("c1", True), ("slack-C1-1.2", False), ("llama-10.0.0.1", False),
                              ("api-12345678", False)):
        fake_openai.script(tool_call("web_search", {"query": client_id}), text("done"))
        _, events = await turn(grt, "@fake search please", client_id=client_id)
        tool_msg = [m for m in fake_openai.requests[-1].json["messages"] if m["role"] == "tool"][-1]["content"]
        assert tool_msg.startswith("ok") == bypass, (client_id, tool_msg)
        gated = [e for e in events if e.name == "gate"]
        assert bool(gated) == client_id.startswith("api-"), client_id  # only the API client gets asked
    assert [args["query"] for _, args in grt.recorder.calls] == ["c1"]


# ── Commands that change gates ──────────────────────────────────────────────────────────────


GATE_COMMANDS = [  # in order, on one session: (command, a line or text its output must contain)
    ("!autoAIdb", "audit: read=auto-allow, write=gated"),
    ("!autoAIdb users read true", "autoAIdb users read: auto-allow (gate OFF) for this session."),
    ("!autoAIdb write true", "every table (* and __meta__) write: auto-allow"),
    ("!autoAIdb orders false", "orders read+write: gated (gate ON)"),
    ("!autoaidb status", "users: read=auto-allow (this session), write=auto-allow"),
    ("!autoaidb status", "orders: read=gated (this session), write=gated (this session)"),
    ("!autoAIdb users maybe", "ERROR: Invalid arguments\nUsage:"),
    ("!autogate search true", "autogate search (web_search) read+write: auto-allow (gate OFF) for this session."),
    ("!autogate read true", "autogate DEFAULT (*) read: auto-allow"),
    ("!autogate web_search write false", "web_search write: gated"),
    ("!autogate", "DEFAULT (*): read=auto-allow (this session), write=gated"),
    ("!autogate", "web_search: read=auto-allow (this session), write=gated (this session)"),
    ("!autogate", "db:  (gated per table: see !autoAIdb)"),
    ("!autogate search", "search:\n    web_search: read=auto-allow"),
    (
        "!autogate nosuch true",
        "ERROR: Unknown tool or gate type 'nosuch'\nGate types: agent_call, db, llm_call, search, system",
    ),
    ("!autogate db true", "ERROR: database tools are gated per table: use !autoAIdb"),
    # reads are open through `!autogate read true` above
    ("!autoAISysPrompt", "autoAISysPrompt read:  OFF (auto-allow)\nautoAISysPrompt write: ON (human gates)"),
    ("!autoAISysPrompt true", "autoAISysPrompt write (update_system_prompt): auto-allow"),
    ("!autoAISysPrompt read", "ERROR: Missing boolean value"),
    ("!autoAISysPrompt", "write: OFF (auto-allow)"),
]


async def test_gate_commands_from_the_shell(grt) -> None:
    for command, expected in GATE_COMMANDS:
        out, _ = await turn(grt, command)
        assert expected in out, (command, out)
    assert grt.sessions.get("c1").settings["gates"]["db"]["users"] == {"read": True}
    # The changed gates really apply: the search runs without asking now.
    result, events = await with_events(grt, "c1", execute(grt, "c1", "web_search", {"query": "q"}))
    assert result.startswith("ok") and not [e for e in events if e.name == "gate"]


@pytest.mark.parametrize("client_id", ["slack-C1-1.2", "llama-10.0.0.1", "api-12345678", "api-swarm-12345678"])
async def test_non_interactive_clients_cannot_change_gates(grt, client_id: str) -> None:
    for command in ("!autoAIdb users true", "!autoAIdb read true", "!autogate search true", "!autogate read true",
                    "!autoAISysPrompt write true", "!llm_call fake true", "!llm_timeout 5"):
        out, _ = await turn(grt, command, client_id=client_id)
        assert out.startswith(f"ERROR: !{command.split()[0][1:]} is accepted only from the interactive shell"), out
    session = grt.sessions.get(client_id)
    assert "gates" not in session.settings
    assert grt.config.models["fake"].tool_call_available is False
    # Reading the state is fine.
    out, _ = await turn(grt, "!autogate", client_id=client_id)
    assert out.startswith("Tool gates of this session")


async def test_admin_api_client_may_change_gates(grt) -> None:
    out, _ = await turn(grt, "!autogate search true", client_id="api-12345678", payload={"admin": True})
    assert "auto-allow" in out
    out, _ = await turn(grt, "!autogate search false", client_id="api-12345678", payload={"admin": "yes"})
    assert out.startswith("ERROR")  # only the boolean True set by the plugin counts


async def test_plugin_commands_use_the_same_check(grt) -> None:
    """A privileged plugin command (the coming `!db`) refuses non-interactive clients with
    client_classes.may_administer."""

    async def db(turn: turns.Turn, args: str) -> str:
        return "ran " + args if client_classes.may_administer(turn) else client_classes.refusal("!db", turn)

    grt.commands["db"] = turns.Command(db, owner="plugin_test_db")
    out, _ = await turn(grt, "!db SELECT 1")
    assert out == "ran SELECT 1"
    for client_id in ("slack-C1-1.2", "llama-10.0.0.1", "api-12345678"):
        out, _ = await turn(grt, "!db DROP TABLE users", client_id=client_id)
        assert out.startswith("ERROR: !db is accepted only from the interactive shell"), client_id
    out, _ = await turn(grt, "!db SELECT 2", client_id="api-12345678", payload={"admin": True})
    assert out == "ran SELECT 2"


# ── Rate limiter ────────────────────────────────────────────────────────────────────────────


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_rate_limit_windows_slide_with_the_clock() -> None:
    clock = Clock()
    limiter = rate_limits.RateLimiter({"search": RateLimit(calls=2, window_seconds=10)}, EventHub(), clock=clock)
    assert [limiter.hit("a", "search") for _ in range(3)] == [None, None, "limit"]
    assert limiter.hit("b", "search") is None  # per session
    assert limiter.hit("a", "db") is None  # types without a limit are unlimited
    clock.now += 5
    assert limiter.hit("a", "search") == "limit"  # the refused call was not counted either
    clock.now += 5.001
    assert limiter.hit("a", "search") is None and limiter.hit("a", "search") is None
    assert limiter.hit("a", "search") == "limit"


def test_zero_means_unlimited() -> None:
    limiter = rate_limits.RateLimiter({"system": RateLimit(calls=0, window_seconds=0)}, EventHub(), clock=Clock())
    assert all(limiter.hit("a", "system") is None for _ in range(100))


def test_auto_disable_and_enable() -> None:
    clock = Clock()
    limiter = rate_limits.RateLimiter({"llm_call": RateLimit(calls=1, window_seconds=20, auto_disable=True)},
                                      EventHub(), clock=clock)
    assert limiter.hit("a", "llm_call") is None
    assert limiter.hit("a", "llm_call") == "limit"
    clock.now += 60
    assert limiter.hit("a", "llm_call") == "disabled"  # stays off after the window
    assert limiter.hit("b", "llm_call") is None  # only for that session
    assert limiter.enable("a", "llm_call") and not limiter.enable("a", "llm_call")
    assert limiter.hit("a", "llm_call") is None


def test_old_windows_are_pruned() -> None:
    clock = Clock()
    limiter = rate_limits.RateLimiter({"search": RateLimit(calls=5, window_seconds=10)}, EventHub(), clock=clock)
    for i in range(rate_limits.SWEEP_EVERY * 4):
        limiter.hit(f"client-{i}", "search")
    assert len(limiter.windows) <= rate_limits.SWEEP_EVERY * 4
    clock.now += 11
    for _ in range(rate_limits.SWEEP_EVERY):
        limiter.hit("steady", "search")
        clock.now += 11
    assert set(limiter.windows) == {("steady", "search")}
    limiter.forget("steady")
    assert limiter.windows == {}


async def test_rate_limit_in_the_pipeline_and_reenable_command(tmp_path, fake_openai) -> None:
    limits = {"llm_call": {"calls": 1, "window_seconds": 20, "auto_disable": True},
              "search": {"calls": 1, "window_seconds": 10, "auto_disable": False}}
    async with runtime(tmp_path, {"fake": openai_model(fake_openai, tool_call_available=True)},
                       gates=ALL_OPEN, rate_limits=limits) as rt:
        clock = Clock()
        rt.rate_limiter.clock = clock
        recorder = Recorder()
        add_plugin_tools(rt, "plugin_test_rl", [recorder.tool("web_search", _Args)], {"web_search": {"type": "search"}})
        await rt.sessions.get_or_create("c1", "fake")
        assert (await execute(rt, "c1", "web_search", {"query": "a"})).startswith("ok")
        result, events = await with_events(rt, "c1", execute(rt, "c1", "web_search", {"query": "b"}))
        assert result.startswith("RATE LIMIT EXCEEDED: web_search (search) — limit is 1 calls in 10 s")
        assert any(e.data.get("text", "").startswith("[RATE LIMITED] web_search") for e in events)
        fake_openai.script(text("summary"))
        args = {"model": "fake", "prompt": "summarise"}
        assert await execute(rt, "c1", "llm_clean_text", args) == "summary"
        result = await execute(rt, "c1", "llm_clean_text", args)
        assert (
            "All llm_call tools are now disabled for this session" in result and "!ratelimit enable llm_call" in result
        )
        clock.now += 100
        assert (await execute(rt, "c1", "llm_clean_text", args)).startswith("TOOL DISABLED")
        out, _ = await turn(rt, "!ratelimit")
        assert "llm_call" in out and "DISABLED for this session" in out and "1 calls / 10 s" in out
        out, _ = await turn(rt, "!ratelimit enable llm_call")
        assert out == "llm_call tools are enabled again for this session."
        fake_openai.script(text("again"))
        assert await execute(rt, "c1", "llm_clean_text", args) == "again"
        assert [name for name, _ in recorder.calls] == ["web_search"]


async def test_gate_waits_do_not_block_other_sessions(grt) -> None:
    grt.gate.timeout = 30
    await grt.sessions.get_or_create("c1", "fake")
    sub = grt.hub.subscribe("c1", grt.hub.last_id("c1"))
    with as_request(grt, "c1"):
        waiting = asyncio.ensure_future(execute(grt, "c1", "web_search", {"query": "slow"}))
    gate_id = next(iter([ev async for ev in _until_gate(sub)])).data["gate_id"]
    assert (await execute(grt, "c2", "get_system_info", {})).startswith("Local time")
    assert await grt.gate.resolve(gate_id, "allow") and not await grt.gate.resolve(gate_id, "allow")
    assert (await waiting).startswith("ok") and grt.gate.pending == {}
    with pytest.raises(ValueError, match="decision must be one of"):
        await grt.gate.resolve(gate_id, "maybe")
    await sub.aclose()


async def _until_gate(events):
    async for ev in events:
        if ev.name == "gate":
            yield ev
            return


def test_system_schemas_are_allowed_only_by_their_own_keys() -> None:
    keeper = gate.GateKeeper(GateDefaults.model_validate({"db": {"*": {"read": True, "write": True}}, "tools": {}}),
                             EventHub())
    assert keeper.allowed(None, "db", "users", "read") and keeper.allowed(None, "db", "shop.users", "write")
    for key in ("mysql.user", "information_schema.tables", "performance_schema.threads", "sys.session"):
        assert not keeper.allowed(None, "db", key, "read"), key  # `*` never reaches the server's own schemas
    session = stores.Session("c1", 101, "fake")
    keeper.set_override(session, "db", "mysql.user", "read", True)  # what `!autoAIdb mysql.user read true` does
    assert keeper.allowed(session, "db", "mysql.user", "read") and not keeper.allowed(
        session, "db", "mysql.user", "write"
    )
    # An unqualified entry is not a qualified one: allowing `users` leaves `shop.users` to `*` (here: gated).
    narrow = gate.GateKeeper(GateDefaults.model_validate({"db": {"users": {"read": True}}, "tools": {}}),
                             EventHub())
    assert narrow.allowed(None, "db", "users", "read") and not narrow.allowed(None, "db", "shop.users", "read")


async def test_autoaidb_takes_a_schema_qualified_table(grt) -> None:
    out, _ = await turn(grt, "!autoAIdb mysql.user read true")
    assert out == "autoAIdb mysql.user read: auto-allow (gate OFF) for this session."
    session = grt.sessions.get("c1")
    assert grt.gate.allowed(session, "db", "mysql.user", "read")
