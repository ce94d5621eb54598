"""Load the real data_tool plugins into an in-process runtime, for tests against the local service fakes."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

import build
import state
import stores
from config import load_config
from plugin_api import BasePlugin
from plugin_checks import PluginReport
from registry import ToolError
from tests.conftest import ConfigDir

# Settings the plugins read from the environment: a developer's real keys must not leak into a test.
SERVICE_ENV = ("TAVILY_API_KEY", "TAVILY_BASE_URL", "XAI_API_KEY", "XAI_BASE_URL", "GEMINI_API_KEY",
               "GOOGLE_GEMINI_BASE_URL", "GOOGLE_API_KEY", "FOLDER_ID", "DRIVE_BASE_URL", "DRIVE_CA_BUNDLE",
               "DDGS_PROXY", "TAVILY_HTTP_PROXY", "TAVILY_HTTPS_PROXY",
               "MYSQL_HOST", "MYSQL_PORT", "MYSQL_USER", "MYSQL_PASS", "MYSQL_DB")
PROXY_ENV = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy")
# Every tool auto-allowed, so tests of the tools themselves never stop at a gate.
NO_GATES = {"db": {"*": {"read": True, "write": True, "ddl": True},
                   "__meta__": {"read": True, "write": True, "ddl": True}},
            "tools": {"*": {"read": True, "write": True}}}
UNUSED_MODEL = {"model_id": "unused", "type": "OPENAI", "host": "http://127.0.0.1:9/v1", "env_key": None}


def isolate_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Remove service keys, base URLs and proxies from this test's environment."""
    for var in SERVICE_ENV + PROXY_ENV:
        monkeypatch.delenv(var, raising=False)


def write_config(path: Path, plugins: dict[str, dict[str, Any]], env: dict[str, str],
                 models: dict[str, Any] | None = None, shell: bool = False,
                 gates: dict[str, Any] | None = None) -> ConfigDir:
    """A config dir enabling `plugins` (name → plugin_config) with `.env` = `env` and every gate open
    (or `gates` as gate-defaults.json)."""
    cfg = ConfigDir(path)
    cfg.models = models or {"unused": UNUSED_MODEL}
    cfg.plugins = (["plugin_client_shellpy"] if shell else []) + list(plugins)
    cfg.plugin_config = {name: conf for name, conf in plugins.items() if conf}
    cfg.env = env
    cfg.gates = NO_GATES if gates is None else gates
    return cfg.write()


@asynccontextmanager
async def plugin_runtime(path: Path, plugins: dict[str, dict[str, Any]], env: dict[str, str],
                         gates: dict[str, Any] | None = None) -> AsyncIterator[state.Runtime]:
    """A runtime with `plugins` loaded (each with its plugin_config), shut down on exit."""
    write_config(path, plugins, env, gates=gates)
    rt = await build.build_runtime(load_config(path), store=stores.MemoryStore())
    try:
        assert rt.plugins is not None
        await rt.plugins.load_all()
        yield rt
    finally:
        await build.close_runtime(rt)


def report(rt: state.Runtime, name: str) -> PluginReport:
    assert rt.plugins is not None
    return rt.plugins.reports[name]


def plugin(rt: state.Runtime, name: str) -> BasePlugin:
    """The loaded plugin instance called `name` (fails with its load report if it did not load)."""
    assert rt.plugins is not None
    for p in rt.plugins.loaded:
        if p.PLUGIN_NAME == name:
            return p
    raise AssertionError(f"{name} did not load: {rt.plugins.reports[name].line()}")


async def call_tool(rt: state.Runtime, name: str, **args: Any) -> str:
    """Call a tool's executor with validated arguments (what `execute_tool` does after its checks)."""
    tool = rt.tools.get(name)
    assert tool is not None, f"tool {name} is not registered: {rt.tools.names()}"
    parsed = tool.args_schema.model_validate(args)
    try:
        return await tool.coroutine(**parsed.model_dump())
    except ToolError as exc:  # the result the pipeline makes of a tool's own failure
        return f"ERROR: {exc}"
