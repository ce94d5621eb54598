"""An in-process runtime on a temporary config dir, small tools with gate declarations, turn helpers."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import importlib.util
import json
import shutil
from collections.abc import AsyncIterator, Awaitable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

from langchain_core.tools import StructuredTool
from pydantic import BaseModel

import build
import client_classes
import routes
import state
import stores
import tracing
import turns
from config import DEFAULTS_DIR, load_config
from events import Event
from tests.conftest import ROOT, ConfigDir

#: gate-defaults.json with every gate on / off.
ALL_GATED: dict[str, Any] = {"db": {}, "tools": {}}
ALL_OPEN: dict[str, Any] = {"db": {"*": {"read": True, "write": True, "ddl": True}},
                            "tools": {"*": {"read": True, "write": True}}}


#: The client-id namespaces the shipped client plugins declare (CLIENT_NAMESPACES), by owner.
SHIPPED_NAMESPACES = {"api-": (client_classes.API, "plugin_client_api"),
                      "api-swarm-": (client_classes.SWARM, "plugin_client_api"),
                      "llama-": (client_classes.PROXY, "plugin_proxy_llama"),
                      "slack-": (client_classes.SLACK, "plugin_client_slack"),
                      "mcp-": (client_classes.MCP, "plugin_client_mcp")}


def shell_payload(rt: state.Runtime, client_id: str, payload: dict[str, Any] | None) -> dict[str, Any] | None:
    """`payload`, vouched interactive as the shell endpoint does when `client_id` is a bare (shell.py) id."""
    if payload is None and client_classes.client_class(client_id, rt.client_namespaces) == client_classes.UNKNOWN:
        return {"interactive": True}
    return payload


def ask(rt: state.Runtime, client_id: str, text: str, payload: dict[str, Any] | None = None) -> routes.Request:
    """The typed request a client plugin would build for `client_id`, the test standing in for the plugin that
    owns the id's namespace (its class; the shell's when `payload` says `interactive`); `payload` keys are
    the request's fields (model, default_model, admin, interactive, identity)."""
    payload = payload or {}
    owner = client_classes.client_class(client_id, rt.client_namespaces)
    kind = client_classes.SHELL if payload.get("interactive") is True else owner
    return routes.Request(client_id, kind, text, **payload)


def request_turn(rt: state.Runtime, client_id: str) -> turns.Turn:
    """The turn a request of `client_id` runs as (a bare id: a vouched shell.py request), with its session."""
    turn = ask(rt, client_id, "", shell_payload(rt, client_id, None)).turn()
    turn.session = rt.sessions.get(client_id)
    return turn


@contextlib.contextmanager
def as_request(rt: state.Runtime, client_id: str) -> Iterator[None]:
    """Within: the context a request of `client_id` runs in (a bare id: a vouched shell.py request)."""
    with turns.running(request_turn(rt, client_id)):
        yield


async def execute(rt: state.Runtime, client_id: str, name: str, args: dict[str, Any]) -> str:
    """One tool call through the runtime's tool pipeline (`rt.pipeline`), as the request `as_request` set up for
    `client_id`, else as a request nobody vouched for (the class of the id's namespace): the text the model reads."""
    current = turns.current_turn()
    turn = current if current is not None and current.client_id == client_id else ask(rt, client_id, "").turn()
    turn = dataclasses.replace(turn, session=rt.sessions.get(client_id))
    return (await rt.pipeline.execute(turn, name, args)).text


@contextlib.asynccontextmanager
async def runtime(path: Path, models: dict[str, Any], *, env: dict[str, str] | None = None,
                  gates: dict[str, Any] | None = None, rate_limits: dict[str, Any] | None = None,
                  agents: dict[str, Any] | None = None, plugins: tuple[str, ...] = (),
                  store: stores.SessionStore | None = None, approvals: dict[str, Any] | None = None,
                  spans: tracing.Tracing | None = None) -> AsyncIterator[state.Runtime]:
    """A runtime with its own copy of the system prompt (tools may edit it) and memory sessions
    (or `store`'s), and its traces in `spans` when given.

    `plugins` (shipped plugin names) are enabled and loaded; each must load.
    """
    cfg = ConfigDir(path)
    cfg.models = models
    cfg.plugins += plugins
    cfg.env = env or {}
    cfg.gates = gates
    cfg.agents = agents
    cfg.write()
    shutil.copytree(DEFAULTS_DIR / ".system_prompt", path / ".system_prompt", dirs_exist_ok=True)
    extra = {"rate_limits": rate_limits, "approvals": approvals}
    if any(v is not None for v in extra.values()):
        enabled = json.loads((path / "plugins-enabled.json").read_text())
        enabled.update({k: v for k, v in extra.items() if v is not None})
        (path / "plugins-enabled.json").write_text(json.dumps(enabled))
    rt = await build.build_runtime(load_config(path), store=store or stores.MemoryStore(), spans=spans)
    rt.client_namespaces.update(SHIPPED_NAMESPACES)  # as if every shipped client plugin were loaded
    try:
        for name in plugins:
            assert rt.plugins is not None
            report = await rt.plugins.load(name)
            assert report.status == "loaded", report.line()
        yield rt
    finally:
        await build.close_runtime(rt)


class Recorder:
    """Test tools that record their calls: `calls` holds (tool name, arguments) in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def tool(self, name: str, schema: type[BaseModel], reply: str = "ok") -> StructuredTool:
        async def run(**kwargs: Any) -> str:
            self.calls.append((name, kwargs))
            return f"{reply}: {json.dumps(kwargs, sort_keys=True)}"

        return StructuredTool.from_function(coroutine=run, name=name, description=f"Test tool {name}.",
                                            args_schema=schema)


def add_plugin_tools(rt: state.Runtime, plugin: str, tools: list[StructuredTool], gates: dict[str, Any]) -> None:
    """Register tools and their gate declarations the way the plugin loader does."""
    rt.tools.register_plugin_tools(plugin, {"lc": tools})
    rt.tools.register_gate_tools(plugin, gates)


async def turn(rt: state.Runtime, text: str, client_id: str = "c1", payload: dict[str, Any] | None = None,
               answer: str | None = None) -> tuple[str, list[Event]]:
    """Submit and collect the events up to the turn's `done`, answering gates with `answer` if given."""
    sub = rt.hub.subscribe(client_id, rt.hub.last_id(client_id))
    await routes.submit(rt, ask(rt, client_id, text, shell_payload(rt, client_id, payload)))
    events = []
    async for ev in sub:
        events.append(ev)
        if ev.name == "gate" and answer:
            await rt.gate.resolve(ev.data["gate_id"], answer)
        if ev.name == "done":
            break
    await sub.aclose()
    return "".join(e.data.get("text", "") for e in events if e.name == "tok"), events


async def with_events(rt: state.Runtime, client_id: str, work: Awaitable[Any], answer: str | None = None
                      ) -> tuple[Any, list[Event]]:
    """Run `work`, collecting the session's events meanwhile and answering gates with `answer`."""
    sub = rt.hub.subscribe(client_id, rt.hub.last_id(client_id))
    with as_request(rt, client_id):  # the task copies this context
        task = asyncio.ensure_future(work)
    task.add_done_callback(lambda _: rt.hub.publish(client_id, "status", {"text": "", "end_of_test": True}))
    events = []
    async for ev in sub:
        if ev.data.get("end_of_test"):
            break
        events.append(ev)
        if ev.name == "gate" and answer:
            await rt.gate.resolve(ev.data["gate_id"], answer)
    await sub.aclose()
    return await task, events


@functools.cache
def entry() -> ModuleType:
    """agent-mcp.py as a module (its file name is not an importable one)."""
    spec = importlib.util.spec_from_file_location("agent_mcp_entry", ROOT / "agent-mcp.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
