"""What a newcomer touches to add a client plugin, a gated tool and a setting (issue 30, item 1).

Each lives in tests/examples/ as the one file a newcomer writes; the config dir gets the file and
its manifest entry (two files), and the setting is one field of the plugin's settings plus its
value in plugins-enabled.json. Nothing of the code base changes: no core module, no shipped plugin,
no registry of classes or tools. The examples import nothing of the core but the plugin surface.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette

import build
import sessions
import stores
from config import DEFAULTS_DIR, load_config
from tests.conftest import ROOT, ConfigDir, openai_model
from tests.fakes.backend import text, tool_call
from tests.test_architecture import LIBRARIES, PLUGIN_SURFACE, _all_imports

EXAMPLES = Path(__file__).parent / "examples"
NEW_FILES = {"plugin_client_echo": "client_interface", "plugin_tool_words": "data_tool"}


def test_the_examples_import_only_the_plugin_surface() -> None:
    core = {p.stem for p in ROOT.glob("*.py")}
    for name in NEW_FILES:
        assert _all_imports(EXAMPLES / f"{name}.py") & core <= set(PLUGIN_SURFACE) | set(LIBRARIES), name


def _touched(config_dir: Path) -> list[str]:
    """The code and plugin declarations in a config dir (settings files aside)."""
    return sorted(str(p.relative_to(config_dir)) for p in config_dir.rglob("*") if p.is_file()
                  and (p.parent.name == "plugins" or p.name == "plugin-manifest.json"))


@pytest.fixture
async def newcomer(tmp_path: Path, fake_openai: Any):
    """A server with the two new plugins dropped into its config dir, all gates closed, `max_words` set."""
    cfg = ConfigDir(tmp_path)
    cfg.models = {"fake": openai_model(fake_openai)}
    cfg.gates = {"db": {}, "tools": {}}
    for name, kind in NEW_FILES.items():
        cfg.add_plugin(name, (EXAMPLES / f"{name}.py").read_text(), type_=kind)
    cfg.plugin_config["plugin_tool_words"] = {"max_words": 3}  # the new setting, set by the operator
    cfg.write()
    shutil.copytree(DEFAULTS_DIR / ".system_prompt", tmp_path / ".system_prompt")
    assert _touched(tmp_path) == ["plugin-manifest.json", "plugins/plugin_client_echo.py",
                                  "plugins/plugin_tool_words.py"]
    rt = await build.build_runtime(load_config(tmp_path), store=stores.MemoryStore())
    assert rt.plugins is not None
    for name in NEW_FILES:
        report = await rt.plugins.load(name)
        assert report.status == "loaded", report.line()
    try:
        yield rt, next(p for p in rt.plugins.loaded if p.PLUGIN_NAME == "plugin_client_echo")
    finally:
        await build.close_runtime(rt)


async def test_a_new_client_plugin_runs_a_new_gated_tool_with_a_new_setting(newcomer, fake_openai) -> None:
    rt, echo = newcomer
    assert rt.client_namespaces["echo-"] == ("api", "plugin_client_echo")  # declared by the plugin alone
    fake_openai.script(tool_call("count_words", {"text": "one two three four five"}), text("counted"))
    gates = rt.hub.subscribe("echo-ann", rt.hub.last_id("echo-ann"))

    async def allow_the_gate() -> dict[str, Any]:
        async for ev in gates:
            if ev.name == "gate":
                await rt.gate.resolve(ev.data["gate_id"], "allow", by="test")
                return ev.data
        raise AssertionError("no gate")

    answering = asyncio.create_task(allow_the_gate())
    app = Starlette(routes=echo.get_routes())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://echo") as http:
        got = await http.post("/ask", json={"name": "ann", "text": "count these"}, timeout=30)
    assert got.json() == {"status": "complete", "text": "counted"}
    asked = await answering
    await gates.aclose()
    assert asked["tool_name"] == "count_words"  # the new tool is gated as it declared, for the new client
    tool_result = [m for m in fake_openai.requests[-1].json["messages"] if m["role"] == "tool"][-1]["content"]
    assert tool_result.startswith("3 words (asked by echo-ann)")  # the setting capped it; the turn is the client's
    assert rt.sessions.get("echo-ann").settings[sessions.CLIENT_CLASS] == "api"  # the class its plugin stated
