"""Rate limits follow the proven identity, not the session id: a caller that makes new client ids
(new chats, new API ids, new MCP sessions) shares one window and one `auto_disable`, in memory
and on the shared Redis store; another identity has a window of its own."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from pydantic import BaseModel

import gate_commands
import shared_store
import state
import turns
from tests.runtime import Recorder, add_plugin_tools, ask, runtime

MODELS = {"m": {"model_id": "x", "type": "OPENAI", "host": "http://127.0.0.1:9/v1", "env_key": None}}
LIMITS = {"vault": {"calls": 2, "window_seconds": 600, "auto_disable": False},
          "probe": {"calls": 1, "window_seconds": 600, "auto_disable": True}}
OPEN = {"db": {}, "tools": {"*": {"read": True, "write": True}}}


class _Args(BaseModel):
    key: str


def _tools(rt: state.Runtime) -> Recorder:
    rec = Recorder()
    add_plugin_tools(rt, "plugin_rate_test", [rec.tool("vault_get", _Args), rec.tool("probe_get", _Args)],
                     {"vault_get": {"type": "vault", "operation": "read"},
                      "probe_get": {"type": "probe", "operation": "read"}})
    return rec


async def _call(rt: state.Runtime, client_id: str, identity: str | None, tool: str) -> str:
    """One tool call as a request of `client_id` from the proxy or API, proven to be `identity`."""
    turn = ask(rt, client_id, "", {"identity": identity} if identity else None).turn()
    session, _ = rt.sessions.get_or_add(client_id, "m", turn.kind)
    turn = dataclasses.replace(turn, session=session)
    with turns.running(turn):
        return (await rt.pipeline.execute(turn, tool, {"key": "k"})).text


async def _rotating_ids_share_one_window(rt: state.Runtime, rec: Recorder) -> None:
    # Alice (a proxy key) opens a new chat for every call: new client ids, one identity.
    got = [await _call(rt, f"llama-alice-chat-{n}", "proxy:alice", "vault_get") for n in range(3)]
    assert got[0].startswith("ok") and got[1].startswith("ok"), got
    assert got[2].startswith("RATE LIMIT EXCEEDED"), got[2]
    assert "for this caller (all its sessions)" in got[2]
    # Bob, same client class, his own window; and the same ids under the API key are another class.
    assert (await _call(rt, "llama-bob-chat-0", "proxy:bob", "vault_get")).startswith("ok")
    assert (await _call(rt, "api-alice-chat-9", "api:key", "vault_get")).startswith("ok")
    # auto_disable holds for every new id of the identity, and deleting a session lifts nothing.
    assert (await _call(rt, "llama-alice-a", "proxy:alice", "probe_get")).startswith("ok")
    assert (await _call(rt, "llama-alice-b", "proxy:alice", "probe_get")).startswith("RATE LIMIT EXCEEDED")
    await rt.sessions.delete("llama-alice-a", remember=False)
    await rt.sessions.delete("llama-alice-b", remember=False)
    rt.rate_limiter.forget("llama-alice-b")
    assert (await _call(rt, "llama-alice-c", "proxy:alice", "probe_get")).startswith("TOOL DISABLED")
    assert [name for name, _ in rec.calls].count("vault_get") == 4
    assert [name for name, _ in rec.calls].count("probe_get") == 1


async def test_rotating_client_ids_under_one_identity_stay_rate_limited(tmp_path: Path) -> None:
    async with runtime(tmp_path, MODELS, gates=OPEN, rate_limits=LIMITS) as rt:
        await _rotating_ids_share_one_window(rt, _tools(rt))


async def test_rotating_client_ids_stay_rate_limited_on_the_shared_store(tmp_path: Path, redis_store: str) -> None:
    async with runtime(tmp_path, MODELS, gates=OPEN, rate_limits=LIMITS,
                       store=shared_store.open_store(redis_store, tmp_path)) as rt:
        assert rt.rate_limiter.shared is not None
        await _rotating_ids_share_one_window(rt, _tools(rt))


async def test_without_a_proven_identity_the_session_is_the_key(tmp_path: Path) -> None:
    """A request nobody vouched for (a plugin that proves nothing) keeps the per-session window."""
    async with runtime(tmp_path, MODELS, gates=OPEN, rate_limits=LIMITS) as rt:
        _tools(rt)
        for cid in ("llama-x1", "llama-x2"):
            assert (await _call(rt, cid, None, "vault_get")).startswith("ok")
            assert (await _call(rt, cid, None, "vault_get")).startswith("ok")
            assert "for this session" in await _call(rt, cid, None, "vault_get")


@pytest.mark.parametrize(("payload", "may"), [({"identity": "proxy:alice"}, False), ({"interactive": True,
                                                                                         "identity": "shell"}, True)])
async def test_only_an_operator_lifts_an_auto_disable(tmp_path: Path, payload: dict, may: bool) -> None:
    """`!ratelimit enable` from the disabled caller itself would make auto_disable stop nobody."""
    async with runtime(tmp_path, MODELS, gates=OPEN, rate_limits=LIMITS) as rt:
        _tools(rt)
        await _call(rt, "llama-alice-1", "proxy:alice", "probe_get")
        assert (await _call(rt, "llama-alice-2", "proxy:alice", "probe_get")).startswith("RATE LIMIT")
        client_id = "llama-alice-3" if not may else "me"
        turn = ask(rt, client_id, "", payload).turn()
        turn.session, _ = rt.sessions.get_or_add(client_id, "m", turn.kind)
        parts = gate_commands.Parts(rt.gate, rt.rate_limiter, rt.sessions, rt.tools)
        answer = await gate_commands.cmd_ratelimit(parts, turn, "enable probe proxy|proxy:alice")
        if may:
            assert answer == "probe tools are enabled again for 'proxy|proxy:alice'."
            assert (await _call(rt, "llama-alice-4", "proxy:alice", "probe_get")).startswith("RATE LIMIT EXCEEDED")
        else:
            assert answer.startswith("ERROR: !ratelimit enable is accepted only from the interactive shell")
            assert (await _call(rt, "llama-alice-4", "proxy:alice", "probe_get")).startswith("TOOL DISABLED")
