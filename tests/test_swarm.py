"""agent_call between two real agent-mcp processes A and B (each with its own fake backend), plus its refusals.

A's model calls B through `agent_call`; B runs its own turn; the answer goes back to A's model and
A's answer to A's client. A spy HTTP server stands in for an agent that should never see A's
credentials.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

import build
import client_classes
import routes
import stores
import turns
from api_client import AgentClient
from config import ConfigError, load_config
from registry import ToolError
from tests.conftest import ConfigDir, free_port, openai_model
from tests.fakes.backend import FakeBackend, text, tool_call, tool_calls
from tests.fakes.openai_backend import FakeOpenAI
from tests.runtime import runtime, turn
from tools import find_agent, swarm_client_id, target_token

KEY_A, ADMIN_A, KEY_B = "key-of-a-111111", "admin-of-a-222222", "key-of-b-333333"


class SpyAgent(FakeBackend):
    """An HTTP server that records every request's headers and refuses them all (401)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[dict[str, str]] = []

    def routes(self) -> Sequence[BaseRoute]:
        return [Route("/{path:path}", self._spy, methods=["GET", "POST", "DELETE"])]

    async def _spy(self, request: Request) -> Response:
        self.seen.append(dict(request.headers))
        return JSONResponse({"error": "unauthorized"}, status_code=401)


def _instance(cfg: ConfigDir, backend: FakeOpenAI, port: int, env: dict[str, str]) -> ConfigDir:
    cfg.models = {"gpt": openai_model(backend)}
    cfg.plugins.append("plugin_client_api")
    cfg.plugin_config["plugin_client_api"] = {"port": port}
    cfg.env = env
    return cfg


def _tool_results(backend: FakeOpenAI) -> list[str]:
    """The tool results of the turn in the backend's latest request (those after the last user message)."""
    messages = backend.requests[-1].json["messages"]
    last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
    return [m["content"] for m in messages[last_user:] if m["role"] == "tool"]


def _messages(backend: FakeOpenAI) -> list[tuple[str, str]]:
    return [(m["role"], m.get("content") or "") for m in backend.requests[-1].json["messages"] if m["role"] != "system"]


@pytest.mark.slow
async def test_two_agents_call_each_other_one_hop(tmp_path, start_server) -> None:
    port_a, port_b = free_port(), free_port()
    url_a, url_b = f"http://127.0.0.1:{port_a}", f"http://127.0.0.1:{port_b}"
    with FakeOpenAI() as fake_a, FakeOpenAI() as fake_b, SpyAgent() as spy:
        (tmp_path / "a").mkdir()
        (tmp_path / "b").mkdir()
        a = _instance(ConfigDir(tmp_path / "a"), fake_a, port_a,
                      {"API_KEY": KEY_A, "API_ADMIN_KEY": ADMIN_A, "B_TOKEN": KEY_B, "COPY_TOKEN": KEY_A})
        a.agents = {
            "b": {"url": url_b, "token_env": "B_TOKEN", "description": "the arithmetic agent"},
            "slow_b": {"url": url_b + "/", "token_env": "B_TOKEN", "timeout": 1},
            "spy": {"url": spy.url},
            "spy_with_my_key": {"url": spy.url + "/k", "token_env": "API_KEY"},
            "spy_with_my_admin_key": {"url": spy.url + "/a", "token_env": "API_ADMIN_KEY"},
            "spy_with_a_copy": {"url": spy.url + "/c", "token_env": "COPY_TOKEN"},
        }
        b = _instance(ConfigDir(tmp_path / "b"), fake_b, port_b, {"API_KEY": KEY_B})
        b.agents = {"a": {"url": url_a, "token_env": "A_TOKEN"}}
        # B lets its model call agent_call without asking, so that only the depth guard stops it.
        b.gates = {"db": {}, "tools": {"agent_call": {"read": True, "write": True}}}
        start_server(b)
        start_server(a)
        client = AgentClient(url_a, api_key=KEY_A, auto_approve_gates={"agent_call": True})

        # 1. A's model asks B; B answers from its own backend; A's model gets it and answers A's client.
        fake_b.script(text("Four", "."))
        fake_a.script(tool_call("agent_call", {"agent_url": "b", "message": "What is 2+2?"}), text("B says 4."))
        answer = await client.send("ask b what 2+2 is")
        assert answer == "Four.\n\nB says 4."  # B's answer relayed live, then A's own
        assert fake_b.requests[-1].last_user_text == "What is 2+2?"
        remote = swarm_client_id(client.client_id, url_b)
        assert _tool_results(fake_a) == [f"Answer of agent 'b' (its session {remote}):\nFour."]

        # 2. A second call (by URL this time, relay switched off) continues the same remote session.
        assert await client.send("!stream off") == ("agent_call streaming disabled — only the final result of "
                                                    "agent_call is shown (as a tool result).")
        fake_b.script(text("Twelve."))
        fake_a.script(tool_call("agent_call", {"agent_url": url_b + "/", "message": "Times 3?"}), text("B says 12."))
        assert await client.send("and times 3?") == "B says 12."
        assert _messages(fake_b) == [("user", "What is 2+2?"), ("assistant", "Four."), ("user", "Times 3?")]
        b_client = AgentClient(url_b, api_key=KEY_B)
        b_sessions = {s["client_id"]: s for s in await b_client.sessions()}
        assert list(b_sessions) == [remote] and remote.startswith("api-swarm-") and len(remote) == 18
        assert b_sessions[remote]["history_length"] == 4

        # 3. B's model tries to call onward (to A): the depth guard refuses before anything is sent.
        fake_b.script(tool_call("agent_call", {"agent_url": "a", "message": "loop"}), text("I cannot reach A."))
        fake_a.script(tool_call("agent_call", {"agent_url": "b", "message": "Ask A for me"}), text("Done."))
        assert await client.send("make b call a") == "Done."
        assert "at most 1 hop deep" in _tool_results(fake_b)[0]
        assert _tool_results(fake_a)[0].endswith("I cannot reach A.")
        a_sessions = [s["client_id"] for s in await client.sessions()]
        assert a_sessions == [client.client_id]  # nobody called A

        # 4. Refusals: URLs that are not configured, and this server's own credentials.
        before_b = len(fake_b.requests)
        fake_b.script(text("hello team"))
        calls = [
            ("agent_call", {"agent_url": f"{url_b}/elsewhere", "message": "x"}),
            ("agent_call", {"agent_url": "http://127.0.0.1:9/", "message": "x"}),
            ("agent_call", {"agent_url": "spy_with_my_key", "message": "x"}),
            ("agent_call", {"agent_url": "spy_with_my_admin_key", "message": "x"}),
            ("agent_call", {"agent_url": "spy_with_a_copy", "message": "x"}),
            ("agent_call", {"agent_url": "spy", "message": "x"}),
            ("agent_call", {"agent_url": "b", "message": "hi team", "target_client_id": "team"}),
        ]
        fake_a.script(tool_calls(calls), text("Reported."))
        assert await client.send("try them all") == "Reported."
        results = _tool_results(fake_a)
        for refused in results[:2]:
            assert (
                "is not a configured agent" in refused and "b: the arithmetic agent" in refused and url_b not in refused
            )
        for refused in results[2:5]:
            assert "one of this server's own credentials, which are never sent" in refused
        assert "refused the credentials (HTTP 401)" in results[5]
        assert results[6] == "Answer of agent 'b' (its session api-swarm-team):\nhello team"
        assert len(spy.seen) == 1 and "authorization" not in spy.seen[0]  # only the tokenless call got there
        assert len(fake_b.requests) == before_b + 1
        assert "api-swarm-team" in {s["client_id"] for s in await b_client.sessions()}

        # 5. A timeout returns what arrived so far.
        release = threading.Event()
        fake_b.script(text("Partly ", "done", hold=release))
        fake_a.script(tool_call("agent_call", {"agent_url": "slow_b", "message": "slow"}), text("Too slow."))
        try:
            assert await client.send("ask the slow one") == "Too slow."
        finally:
            release.set()
        assert _tool_results(fake_a) == ["ERROR: agent_call to 'slow_b' failed: no answer within 1 s (the timeout "
                                         "of 'slow_b' in agents.json)\nPartial answer:\nPartly "]

    for headers in spy.seen:
        assert not any(secret in value for value in headers.values() for secret in (KEY_A, ADMIN_A, KEY_B))


# ── in-process: ids, targets, credentials, !stream ─────────────────────────────────────────


def test_swarm_ids_are_stable_and_keep_their_prefix() -> None:
    one = swarm_client_id("api-caller", "http://h:1")
    assert one == swarm_client_id("api-caller", "http://h:1") and one.startswith("api-swarm-") and len(one) == 18
    assert one != swarm_client_id("api-other", "http://h:1") != swarm_client_id("api-caller", "http://h:2")
    assert swarm_client_id("c", "u", "team") == "api-swarm-team"
    assert swarm_client_id("c", "u", "api-team") == "api-swarm-team"
    assert swarm_client_id("c", "u", "api-swarm-x") == "api-swarm-x"


def test_agents_json_is_validated(tmp_path) -> None:
    cfg = ConfigDir(tmp_path)
    cfg.models = {"m": {"model_id": "x", "type": "OPENAI", "host": "http://127.0.0.1:1"}}
    for agents, problem in [
        ({"b": {"url": "ftp://x"}}, "field 'agents.b.url': Value error, must start with http:// or https://"),
        ({"b": {"url": "http://x", "timeout": 0}}, "field 'agents.b.timeout'"),
        ({"b": {"url": "http://x", "token_env": "not a name"}}, "field 'agents.b.token_env'"),
        ({"b c": {"url": "http://x"}}, "agent names may use letters"),
    ]:
        cfg.agents = agents
        cfg.write()
        with pytest.raises(ConfigError, match=r"agents\.json") as caught:
            load_config(tmp_path)
        assert problem in str(caught.value)
    cfg.agents = {"b": {"url": "http://127.0.0.1:9/"}}
    cfg.write()
    agents = load_config(tmp_path).agents
    assert agents["b"].url == "http://127.0.0.1:9" and agents["b"].timeout == 120
    assert find_agent(agents, "b") == find_agent(agents, "http://127.0.0.1:9/") == ("b", agents["b"])
    assert find_agent(agents, "http://127.0.0.1:9/x") is None


async def test_targets_never_get_this_servers_credentials(tmp_path, fake_openai) -> None:
    # (API_KEY itself as a target's token is refused by the e2e test above, where the API plugin runs.)
    env = {"API_KEY": "own-api-key", "OPENAI_API_KEY": "sk-model", "PEER_TOKEN": "peer-token", "SAME": "sk-model",
           "COPY_TOKEN": "own-api-key", "EMPTY_TOKEN": ""}
    agents = {n: {"url": f"http://127.0.0.1:9/{n}", "token_env": e}
              for n, e in [("peer", "PEER_TOKEN"), ("copy", "COPY_TOKEN"), ("model", "OPENAI_API_KEY"),
                           ("same", "SAME"), ("unset", "EMPTY_TOKEN")]}
    models = {"gpt": openai_model(fake_openai, env_key="OPENAI_API_KEY")}
    async with runtime(tmp_path, models, env=env, agents=agents) as rt:
        def token(name: str) -> tuple[str | None, str | None]:
            assert rt.plugins is not None
            return target_token(rt.config, rt.plugins.client_credentials, name, rt.config.agents[name])

        assert token("peer") == ("peer-token", None)
        for name in ("copy", "model", "same"):
            assert token(name)[0] is None and "never sent" in str(token(name)[1])
        assert token("unset")[0] is None and "EMPTY_TOKEN" in str(token("unset")[1])


async def test_stream_command_and_the_depth_guard(tmp_path, fake_openai) -> None:
    async with runtime(tmp_path, {"gpt": openai_model(fake_openai)},
                       agents={"b": {"url": "http://127.0.0.1:9"}}) as rt:
        assert (await turn(rt, "!stream"))[0] == "agent_call streaming: enabled"
        assert (await turn(rt, "!stream maybe"))[0] == "ERROR: Invalid arguments\nUsage: !stream [on|off]"
        assert (await turn(rt, "!stream off"))[0].startswith("agent_call streaming disabled")
        assert rt.sessions.get("c1").settings["agent_call_stream"] is False
        assert (await turn(rt, "!stream"))[0] == "agent_call streaming: disabled"
        assert (await turn(rt, "!stream on"))[0].startswith("agent_call streaming enabled")
        assert "!stream [on|off]" in (await turn(rt, "!help"))[0]
        entry = rt.tools.entry("agent_call")
        assert entry is not None and entry.gate == {"type": "agent_call", "operation": "write"}
        assert entry.tool.description.endswith("Agents: b") and "127.0.0.1" not in entry.tool.description
        # A swarm session may not call further, whatever the target.
        call = entry.tool.coroutine
        assert call is not None
        with pytest.raises(ToolError, match=r"^agent_call refused: it runs only as a tool call of a request"):
            await call(agent_url="b", message="x")  # outside a request: fails closed
        with turns.running(routes.Request("api-1", client_classes.API).turn()), \
                pytest.raises(ToolError, match="failed: cannot reach"):  # an API client's request: it tries
            await call(agent_url="b", message="x")
        with turns.running(routes.Request("api-swarm-12345678", client_classes.SWARM).turn()), \
                pytest.raises(ToolError, match=r"^agent_call refused: this conversation is itself an agent_call"):
            await call(agent_url="b", message="x")


async def test_api_plugin_refuses_an_admin_key_equal_to_the_api_key(tmp_path, fake_openai) -> None:
    cfg = ConfigDir(tmp_path)
    cfg.models = {"gpt": openai_model(fake_openai)}
    cfg.plugins.append("plugin_client_api")
    for settings, env, reason in [
        ({}, {"API_KEY": "same-key-123", "API_ADMIN_KEY": "same-key-123"}, "API_ADMIN_KEY must differ from API_KEY"),
        ({"port": "high"}, {}, "plugin_config.plugin_client_api in plugins-enabled.json: port:"),
        ({"tokn_env": "X"}, {}, "tokn_env: Extra inputs are not permitted"),
    ]:
        cfg.plugin_config["plugin_client_api"] = settings
        cfg.env = env
        cfg.write()
        rt = await build.build_runtime(load_config(tmp_path), store=stores.MemoryStore())
        try:
            report = await rt.plugins.load("plugin_client_api")
        finally:
            await build.close_runtime(rt)
        assert report.status == "failed" and reason in report.reasons[0], report.reasons
