"""Client classes are declared by plugins; an id nobody owns gets the least privilege (issue 13, item 3).

A third-party client plugin is dropped into the config dir and calls `routes.process_request`
directly (the spec's path). Its own namespace gets the class it declared; an id outside every
namespace gets nothing: no ★ commands, no `@model` gate bypass, gates rejected without asking.
Only a request the token-authenticated shell endpoint vouched for skips gates with `@model`.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import textwrap
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

import build
import client_classes
import routes
import sessions
import state
import stores
from config import DEFAULTS_DIR, load_config
from events import Event
from tests.conftest import ConfigDir, openai_model
from tests.fakes.backend import hang, text, tool_call
from tests.runtime import Recorder, add_plugin_tools, ask

ACME = textwrap.dedent('''
    from plugin_api import BasePlugin
    from starlette.routing import Route


    class AcmePlugin(BasePlugin):
        PLUGIN_NAME = "plugin_client_acme"
        PLUGIN_TYPE = "client_interface"
        CLIENT_NAMESPACES = {"acme-": "api"}

        def init(self, config):
            return True

        def shutdown(self):
            pass

        def get_routes(self):
            return [Route("/", lambda request: None)]

        async def ask(self, client_id, text):
            """What a plugin of the spec does: hand its typed request to process_request; `ctx.request` states
            the class its own namespaces declare (none: the least privilege)."""
            await self.ctx.process_request(self.ctx.request(client_id, text))
''')


@pytest.fixture
async def acme(tmp_path: Path, fake_openai: Any):
    cfg = ConfigDir(tmp_path)
    cfg.models = {"fake": openai_model(fake_openai)}
    cfg.gates = {"db": {}, "tools": {}}  # everything gated
    # Granted every session, so it may run a request of an id no plugin vouches for (which then gets the least
    # privilege); without the grant such a request is refused (test_plugin_scope.py).
    cfg.add_plugin("plugin_client_acme", ACME, type_="client_interface", grants=["all-sessions"])
    cfg.write()
    shutil.copytree(DEFAULTS_DIR / ".system_prompt", tmp_path / ".system_prompt")
    rt = await build.build_runtime(load_config(tmp_path), store=stores.MemoryStore())
    assert rt.plugins is not None
    report = await rt.plugins.load("plugin_client_acme")
    assert report.status == "loaded", report.line()
    recorder = Recorder()
    add_plugin_tools(rt, "plugin_test", [recorder.tool("web_search", _Query)], {"web_search": {"type": "search"}})
    rt.recorder = recorder  # type: ignore[attr-defined]
    try:
        yield rt, rt.plugins.loaded[-1]
    finally:
        await build.close_runtime(rt)


class _Query(BaseModel):
    query: str


async def _ask(rt: state.Runtime, plugin: Any, client_id: str, message: str) -> tuple[str, list[Event]]:
    sub = rt.hub.subscribe(client_id, rt.hub.last_id(client_id))
    await plugin.ask(client_id, message)
    events = []
    async for ev in sub:
        events.append(ev)
        if ev.name == "done":
            break
    await sub.aclose()
    return "".join(e.data.get("text", "") for e in events if e.name == "tok"), events


async def test_a_declared_namespace_gets_its_class_and_a_foreign_one_is_refused(acme) -> None:
    rt, _ = acme
    assert rt.client_namespaces["acme-"] == (client_classes.API, "plugin_client_acme")
    assert client_classes.client_class("acme-7", rt.client_namespaces) == client_classes.API
    assert client_classes.client_class("stranger", rt.client_namespaces) == client_classes.UNKNOWN
    with pytest.raises(ValueError, match="overlaps 'acme-' of plugin_client_acme"):
        rt.plugins._declare_namespaces("plugin_other", type("P", (), {"CLIENT_NAMESPACES": {"acme-x": "api"}})())
    await rt.plugins.shutdown_all()
    assert "acme-" not in rt.client_namespaces  # gone with its plugin


@pytest.mark.parametrize(("client_id", "label"), [("acme-7", "an API client"),
                                                   ("stranger-1", "a client no plugin vouches for")])
async def test_privileged_commands_are_refused_to_plugin_clients(acme, client_id: str, label: str) -> None:
    rt, plugin = acme
    out, _ = await _ask(rt, plugin, client_id, "!autoAIdb write true")
    assert out.startswith("ERROR: !autoAIdb is accepted only from the interactive shell") and label in out
    assert rt.sessions.get(client_id).settings.get("gates") is None  # nothing changed
    out, _ = await _ask(rt, plugin, client_id, "!session")
    assert f"] {client_id}:" in out and out.count("ID [") == 1  # its own session only


async def test_an_unowned_id_gets_no_at_model_bypass_and_its_gates_are_rejected(acme, fake_openai) -> None:
    rt, plugin = acme
    fake_openai.script(tool_call("web_search", {"query": "x"}), text("done"))
    _, events = await _ask(rt, plugin, "stranger-1", "@fake search please")
    tool_msg = [m for m in fake_openai.requests[-1].json["messages"] if m["role"] == "tool"][-1]["content"]
    assert tool_msg.startswith("TOOL CALL REJECTED") and "a client no plugin vouches for" in tool_msg
    assert not [e for e in events if e.name == "gate"]  # rejected without asking anyone
    assert rt.recorder.calls == []
    assert rt.sessions.get("stranger-1").settings[sessions.CLIENT_CLASS] == client_classes.UNKNOWN  # bounded as such


async def test_only_a_vouched_shell_request_skips_gates_with_at_model(acme, fake_openai) -> None:
    rt, _ = acme
    for payload, ran in ((None, False), ({"admin": True}, False), ({"interactive": True}, True)):
        fake_openai.script(tool_call("web_search", {"query": json.dumps(payload)}), text("done"))
        answer = await routes.wait_turn(rt, ask(rt, "c1", "@fake search please", payload), 30)
        assert answer["status"] == "complete"
        assert bool(rt.recorder.calls) == ran, payload
    assert [c[1]["query"] for c in rt.recorder.calls] == ['{"interactive": true}']


async def test_a_direct_process_request_is_tracked_cancellable_and_has_a_turn_id(acme, fake_openai) -> None:
    rt, plugin = acme
    fake_openai.script(hang(30))
    sub = rt.hub.subscribe("acme-1", rt.hub.last_id("acme-1"))
    task = asyncio.create_task(plugin.ask("acme-1", "take your time"))
    await asyncio.sleep(0)  # the task runs up to its first wait: it registers itself before any
    assert list(rt.active_tasks["acme-1"]) == [task]
    await routes.cancel_active_task(rt, "acme-1")  # what a newer request or a delete does
    assert task.cancelled() and "acme-1" not in rt.active_tasks
    events = []
    async for ev in sub:
        events.append(ev)
        if routes.ends_turn(ev):
            break
    await sub.aclose()
    assert events[-1].data.get("cancelled") is True
    assert all(ev.turn for ev in events) and len({ev.turn for ev in events}) == 1
