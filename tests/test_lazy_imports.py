"""Heavy libraries are imported where they are used, not with the modules that might use them (issue 31,
item 4: idle RSS). Each check imports in a fresh interpreter and reads `sys.modules`; what the libraries
cost is measured by `make bench-growth` (docs/benchmarks.md, "Memory"), never asserted here.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT

#: Library → where it is imported instead (each costs megabytes of RSS once imported).
HEAVY = {
    "redis": "shared_link.Link: a redis:// SESSION_STORE",
    "sqlglot": "sql.py: the first SQL statement parsed (a db tool)",
    "langchain_openai": "agents.chat_model: the first OpenAI-type model built",
    "langchain_google_genai": "agents.chat_model: a GEMINI model",
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


def _imported_after(modules: list[str]) -> set[str]:
    """Which of HEAVY a fresh interpreter holds after importing `modules` (in order)."""
    code = ("import importlib, json, sys\n"
            f"for name in {modules!r}:\n"
            "    importlib.import_module(name)\n"
            f"print(json.dumps([m for m in {sorted(HEAVY)!r} if m in sys.modules]))\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return set(json.loads(result.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize("modules", [["build"], ["build", *(f"plugins.{p}" for p in PLUGINS)]],
                         ids=["core", "idle-plugins"])
def test_heavy_libraries_wait_until_they_are_used(modules: list[str]) -> None:
    imported = _imported_after(modules)
    assert not imported, "imported too early: " + "; ".join(f"{m} (belongs to {HEAVY[m]})" for m in sorted(imported))


def test_the_check_sees_an_import() -> None:
    assert _imported_after(["sql", "sqlglot"]) == {"sqlglot"}
