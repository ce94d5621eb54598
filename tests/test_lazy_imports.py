"""Heavy libraries are imported where they are used, not with the modules that might use them (issue 31,
item 4: idle RSS). Each check runs in a fresh interpreter and reads `sys.modules`; what the libraries
cost is measured by `make bench-growth` (docs/benchmarks.md, "Memory"), never asserted here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import ROOT
from tests.plugin_host import PROXY_ENV, SERVICE_ENV

#: Library → where it is imported instead (each costs megabytes of RSS once imported).
HEAVY = {
    "redis": "shared_link.Link: a redis:// SESSION_STORE",
    "sqlglot": "sql.py: the first SQL statement parsed (a db tool)",
    "openai": "models.built_model: the default model before the ports listen (Agent.warm), another at its first "
              "use (or plugin_search_xai with its key)",
    "langchain_openai": "models.built_model: the default model before the ports listen, another at its first use",
    "langchain_google_genai": "models.built_model: a GEMINI model used",
    "google.genai": "plugin_search_google",
    "googleapiclient": "plugin_storage_googledrive",
    "mcp": "plugin_client_mcp: the first request to its port; plugin_mcp_client: a server in mcp-servers.json",
    "mcp_types": "plugin_client_mcp: the first request to its port; plugin_mcp_client: a server in mcp-servers.json",
    "jsonschema": "plugins/_mcp_servers.py: a connected MCP server's tools",
    "ddgs": "plugin_search_ddgs: its first search",
    "primp": "plugin_search_ddgs: its first search",
    "lxml": "plugin_search_ddgs: its first search",
    "slack_sdk": "plugin_client_slack",
    "tavily": "the Tavily plugins",
    "aiomysql": "database.py: plugin_database_mysql",
    "websockets": "nothing: no front door speaks WebSocket",
}

#: Plugins an idle server with every plugin enabled loads without keys.
PLUGINS = ["plugin_client_shellpy", "plugin_client_api", "plugin_proxy_llama", "plugin_client_metrics",
           "plugin_search_ddgs", "plugin_mcp_client", "plugin_client_mcp"]


def _held_after(code: str) -> set[str]:
    """Which of HEAVY a fresh interpreter holds after running `code` (no service keys in its environment)."""
    code += f"\nimport json, sys\nprint(json.dumps([m for m in {sorted(HEAVY)!r} if m in sys.modules]))\n"
    env = {k: v for k, v in os.environ.items() if k not in SERVICE_ENV + PROXY_ENV}
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    return set(json.loads(result.stdout.strip().splitlines()[-1]))


def _imported_after(modules: list[str]) -> set[str]:
    """Which of HEAVY a fresh interpreter holds after importing `modules` (in order)."""
    return _held_after(f"import importlib\nfor name in {modules!r}:\n    importlib.import_module(name)")


def _too_early(imported: set[str]) -> str:
    return "imported too early: " + "; ".join(f"{m} (belongs to {HEAVY[m]})" for m in sorted(imported))


@pytest.mark.parametrize("modules", [["build"], ["build", *(f"plugins.{p}" for p in PLUGINS)]],
                         ids=["core", "idle-plugins"])
def test_heavy_libraries_wait_until_they_are_used(modules: list[str]) -> None:
    imported = _imported_after(modules)
    assert not imported, _too_early(imported)


#: What agent-mcp.serve does before its ports listen, on a runtime with every plugin of the manifest enabled
#: (keys absent, as `make bench-growth` measures idle RSS): the plugins started, each model's context window
#: and reachability looked up, the default model (OpenAI-type) built, which brings `openai` in.
_STARTED = textwrap.dedent("""
    import asyncio, json
    from pathlib import Path
    import models, tempfile
    from tests.conftest import free_port
    from tests.plugin_host import plugin_runtime

    async def main():
        names = json.loads(Path("plugin-manifest.json").read_text())["plugins"]
        conf = {name: {"port": free_port()} if name.startswith(("plugin_client_", "plugin_proxy_")) else {}
                for name in names}
        with tempfile.TemporaryDirectory() as tmp:
            async with plugin_runtime(Path(tmp), conf, {}) as rt:
                assert {rt.plugins.reports[name].status for name in LOADED} == {"loaded"}
                for key, cfg in rt.config.models.items():
                    await models.model_window(rt.windows, key, cfg)
                    await models.unreachable(cfg, rt.config.env)
                USE
    asyncio.run(main())
""").replace("LOADED", repr(PLUGINS))


def test_a_started_server_with_every_plugin_holds_only_its_default_models_library() -> None:
    imported = _held_after(_STARTED.replace("USE", "pass"))
    assert not imported, _too_early(imported)
    warm = "await rt.agent.warm(rt.config.default_model); assert rt.config.default_model in rt.llms"
    assert _held_after(_STARTED.replace("USE", warm)) == {"openai", "langchain_openai"}


def test_the_check_sees_an_import() -> None:
    assert _imported_after(["sql", "sqlglot"]) == {"sqlglot"}
