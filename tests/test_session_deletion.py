"""A session is deleted one way (routes.delete_session), whoever asks (issue 30: there were three).

Each entry point is driven in process and watched: the shell endpoint's and the API's DELETE, the MCP
server's tool (read from its source: it needs an MCP connection), `!session <other> delete`, a request
deleting its own session, and the proxy's throwaway task sessions. No module besides routes.py calls
the session manager's `delete`.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest
from starlette.requests import Request

import routes
import state
import stores
from tests.conftest import ROOT, free_port
from tests.plugin_host import plugin, plugin_runtime
from tests.runtime import ask, shell_payload
from tests.source import parse

ADMIN = "admin-key-for-the-deletion-test"


@pytest.fixture
async def rt(tmp_path: Path) -> Any:
    plugins = {"plugin_client_shellpy": {"port": free_port()}, "plugin_client_api": {"port": free_port()},
               "plugin_proxy_llama": {"port": free_port(), "keys_required": False}}
    async with plugin_runtime(tmp_path, plugins, {"API_KEY": "api-key", "API_ADMIN_KEY": ADMIN}) as runtime:
        yield runtime


@pytest.fixture
def deletions(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, bool, bool]]:
    """Every call of routes.delete_session, as (client id, remember, announce); the call goes through."""
    calls: list[tuple[str, bool, bool]] = []
    original = routes.delete_session

    async def watched(rt: state.Runtime, client_id: str, *, remember: bool = True,
                      announce: bool = True) -> stores.Session | None:
        calls.append((client_id, remember, announce))
        return await original(rt, client_id, remember=remember, announce=announce)

    monkeypatch.setattr(routes, "delete_session", watched)
    return calls


async def _answer(rt: state.Runtime, client_id: str, text: str) -> str:
    """Run `text` as an interactive request of `client_id` to its end: its answer."""
    answer = await routes.wait_turn(rt, ask(rt, client_id, text, shell_payload(rt, client_id, None)), 30)
    assert answer["status"] == "complete", answer
    return str(answer["text"])


def _request(sid: str, headers: dict[str, str] | None = None) -> Request:
    return Request({"type": "http", "method": "DELETE", "path": f"/session/{sid}", "path_params": {"sid": sid},
                    "headers": [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]})


async def test_every_entry_point_deletes_through_routes_delete_session(rt, deletions) -> None:
    for client_id in ("shell-a", "shell-b", "shell-c", "api-d"):
        await _answer(rt, client_id, "!reset")
    assert (await _answer(rt, "shell-a", "!session shell-b delete")).startswith("Deleted session")
    assert (await _answer(rt, "shell-a", "!session shell-a delete")).startswith("Deleted session")
    assert deletions == [("shell-b", True, True), ("shell-a", False, True)]  # its own: once it has answered

    response = await plugin(rt, "plugin_client_shellpy").delete_session(_request("shell-c"))
    assert response.status_code == 200 and deletions[-1] == ("shell-c", True, True)
    response = await plugin(rt, "plugin_client_api").delete_session(_request("api-d", {"X-Admin-Key": ADMIN}))
    assert response.status_code == 200 and deletions[-1] == ("api-d", True, True)

    # The proxy's background task prompts run on a session of their own, deleted once answered, unannounced.
    proxy = plugin(rt, "plugin_proxy_llama")
    events = proxy._then_forget(routes.run_turn(rt, ask(rt, "llama-x-task-1", "!help")), "llama-x-task-1")
    assert [ev.name async for ev in events][-1] == "done"
    assert deletions[-1] == ("llama-x-task-1", False, False)
    assert not [s.client_id for s in rt.sessions.all()]


async def test_a_session_already_gone_only_loses_its_event_channel(rt, deletions) -> None:
    seen: list[tuple[str, str | None]] = []
    rt.hub.observe(lambda client_id, ev: seen.append((client_id, ev.name if ev is not None else None)))
    assert await routes.delete_session(rt, "nobody") is None
    assert seen == [("nobody", None)]  # its channel dropped, nothing announced


def _calls_sessions_delete(tree: ast.AST) -> list[ast.AST]:
    """Calls of `<…>.sessions.delete(…)` in `tree`."""
    return [node for node in ast.walk(tree) if isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute) and node.func.attr == "delete"
            and isinstance(node.func.value, ast.Attribute) and node.func.value.attr == "sessions"]


def test_only_routes_delete_session_calls_the_session_managers_delete() -> None:
    callers = {}
    for path in [*ROOT.glob("*.py"), *ROOT.glob("plugins/*.py")]:
        tree = parse(path.read_text())
        for function in ast.walk(tree):
            if isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef) and _calls_sessions_delete(function):
                callers.setdefault(path.name, set()).add(function.name)
    assert callers == {"routes.py": {"delete_session"}}
    # The MCP server's delete tool (not driven above: it needs an MCP connection) is one of its callers, through
    # the plugin's context.
    mcp = parse((ROOT / "plugins/_mcp_tools.py").read_text())
    tool = next(f for f in ast.walk(mcp) if isinstance(f, ast.AsyncFunctionDef) and f.name == "delete_session")
    assert "ctx.delete_session(" in ast.unparse(tool)
    door = parse((ROOT / "plugin_api.py").read_text())
    method = next(f for f in ast.walk(door) if isinstance(f, ast.AsyncFunctionDef) and f.name == "delete_session")
    assert "routes.delete_session(" in ast.unparse(method)
