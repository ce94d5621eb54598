"""The data_tool plugins inside a real server: missing keys are reported, shipped defaults are safe, and a
model's tool calls reach the services through the plugins."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from config import CODE_DIR, DEFAULTS_DIR, RateLimit
from tests.conftest import openai_model
from tests.fakes.backend import text, tool_call
from tests.fakes.drive import FOLDER, FakeDrive
from tests.fakes.search import FakeTavily
from tests.fakes.tls import make_localhost_tls
from tests.plugin_host import SERVICE_ENV, isolate_env, plugin_runtime, write_config
from tests.runtime import execute
from tests.test_plugin_storage_googledrive import USER_TOKEN
from tests.turns import answer, run_turn

DATA_PLUGINS = ("plugin_storage_googledrive", "plugin_search_google", "plugin_search_ddgs", "plugin_search_tavily",
                "plugin_search_xai", "plugin_urlextract_tavily", "plugin_database_mysql")


def test_every_plugin_missing_its_key_the_server_starts_and_says_why(tmp_path, fake_openai, start_server):
    cfg = write_config(tmp_path, {name: {} for name in DATA_PLUGINS}, {},
                       models={"fake": openai_model(fake_openai)}, shell=True)
    server = start_server(cfg, env=dict.fromkeys(SERVICE_ENV, ""))  # whatever the developer's shell exports
    plugins = server.health()["plugins"]
    assert plugins["plugin_search_ddgs"] == {"status": "loaded", "reasons": []}
    why = {name: plugins[name]["status"] + ": " + "; ".join(plugins[name]["reasons"]) for name in DATA_PLUGINS}
    missing = {"plugin_search_tavily": "TAVILY_API_KEY", "plugin_urlextract_tavily": "TAVILY_API_KEY",
               "plugin_search_xai": "XAI_API_KEY", "plugin_search_google": "GEMINI_API_KEY",
               "plugin_storage_googledrive": "FOLDER_ID", "plugin_database_mysql": "MYSQL_USER"}
    for name, var in missing.items():
        assert why[name].startswith("invalid: environment variable") and var in why[name], why[name]
        assert ".env" in why[name]
    assert "config file credentials.json not found" in why["plugin_storage_googledrive"]

    help_text = answer(run_turn(server, "c1", "!help"))
    assert "Plugins not loaded:\n" in help_text
    assert f"  plugin_search_xai [invalid]: {plugins['plugin_search_xai']['reasons'][0]}" in help_text
    tools = help_text.split("Tools:\n", 1)[1]
    assert "ddgs_search" in tools and "tavily_search" not in tools and "google_drive" not in tools

    out = server.stop()
    for name in DATA_PLUGINS[:2] + DATA_PLUGINS[3:]:
        assert f"plugin {name} [invalid]:" in out

    # The operator's CLI reads the same files and gives the same reasons.
    ctl = subprocess.run(
        [sys.executable, str(CODE_DIR / "agentctl.py"), "--config-dir", str(cfg.path), "--json", "list"],
        capture_output=True,
        text=True,
        env={**os.environ, **dict.fromkeys(SERVICE_ENV, "")},
        timeout=30,
        check=True,
    )
    rows = {r["name"]: r for r in json.loads(ctl.stdout)["plugins"]}
    assert rows["plugin_search_ddgs"]["status"] == "ready"
    for name in missing:
        assert rows[name]["status"] == "problems" and rows[name]["problems"] == plugins[name]["reasons"]


async def test_shipped_defaults_keep_keyed_plugins_off(tmp_path, monkeypatch):
    isolate_env(monkeypatch)
    blocks = json.loads((DEFAULTS_DIR / "plugins-enabled.json").read_text())  # shipped, not this checkout's copy
    assert set(DATA_PLUGINS) <= set(blocks["enabled_plugins"])
    configs = {name: blocks["plugin_config"][name] for name in DATA_PLUGINS}
    async with plugin_runtime(tmp_path, configs, {}) as rt:
        assert rt.plugins is not None
        status = {name: rt.plugins.reports[name].status for name in DATA_PLUGINS}
        assert rt.tools.get("ddgs_search") is not None
    assert status == {name: "loaded" if name == "plugin_search_ddgs" else "disabled" for name in DATA_PLUGINS}


def test_model_tool_calls_reach_tavily_and_drive_through_the_server(tmp_path, fake_openai, start_server,
                                                                     monkeypatch):
    isolate_env(monkeypatch)
    (tmp_path / "tls").mkdir()
    with FakeTavily() as tavily, FakeDrive(make_localhost_tls(tmp_path / "tls")) as drive:
        drive.add("Shared", parent="", mime=FOLDER, file_id="FOLDER1")
        drive.add("notes.txt", "remember the milk", parent="FOLDER1", file_id="NOTES")
        cfg_dir = tmp_path / "cfg"
        cfg_dir.mkdir()
        (cfg_dir / "credentials.json").write_text(json.dumps(
            {"type": "authorized_user", "client_id": "c", "client_secret": "s", "refresh_token": "r",
             "token": "test-token", "expiry": "2999-01-01T00:00:00Z"}))
        cfg = write_config(cfg_dir, {
            "plugin_search_tavily": {"base_url": tavily.url},
            "plugin_storage_googledrive": {"base_url": drive.endpoint, "ca_bundle": str(drive.tls.ca),
                                           "num_retries": 0},
        }, {"TAVILY_API_KEY": "tvly-test", "FOLDER_ID": "FOLDER1"},
            models={"fake": openai_model(fake_openai)}, shell=True)
        server = start_server(cfg)
        fake_openai.script(
            tool_call("tavily_search", {"query": "capital of France"}),
            tool_call("google_drive", {"operation": "read", "file_name": "notes.txt"}),
            text("Paris; and ", "remember the milk."),
        )
        events = run_turn(server, "c1", "What is the capital of France, and what do my notes say?")
    assert answer(events) == "Paris; and remember the milk."
    results = [m["content"] for m in fake_openai.requests[-1].json["messages"] if m["role"] == "tool"]
    assert results[0].startswith("Tavily search results for: capital of France\n\nAnswer: Paris is the capital")
    assert results[1] == "'notes.txt' (id: NOTES):\nremember the milk"
    status = [e.text for e in events if e.name == "status"]
    assert any(s.startswith("[tavily_search ▶]") for s in status)
    assert any(s.startswith("[google_drive ◀] 'notes.txt' (id: NOTES):") for s in status)
    assert tavily.calls[0].json["query"] == "capital of France"
    offered = {t["function"]["name"] for t in fake_openai.requests[0].json["tools"]}
    assert {"tavily_search", "google_drive"} <= offered


async def test_drive_gate_follows_the_operation_and_drive_calls_are_rate_limited(tmp_path, monkeypatch):
    isolate_env(monkeypatch)
    (tmp_path / "tls").mkdir()
    cfg_dir = tmp_path / "cfg"
    cfg_dir.mkdir()
    (cfg_dir / "credentials.json").write_text(json.dumps(USER_TOKEN))
    gates = {"tools": {"*": {"read": False, "write": False}, "google_drive": {"read": True, "write": False}}}
    with FakeDrive(make_localhost_tls(tmp_path / "tls")) as drive:
        drive.add("Shared", parent="", mime=FOLDER, file_id="FOLDER1")
        drive.add("notes.txt", "keep me", parent="FOLDER1", file_id="NOTES")
        conf = {"base_url": drive.endpoint, "ca_bundle": str(drive.tls.ca), "num_retries": 0}
        async with plugin_runtime(cfg_dir, {"plugin_storage_googledrive": conf}, {"FOLDER_ID": "FOLDER1"},
                                  gates=gates) as rt:
            rt.rate_limiter.limits["drive"] = RateLimit(calls=2, window_seconds=3600)
            # A proxy client cannot answer a gate: reads are open by gate-defaults, writes are refused.
            read = await execute(rt, "llama-1", "google_drive", {"operation": "read", "file_id": "NOTES"})
            delete = await execute(rt, "llama-1", "google_drive",
                                               {"operation": "delete", "file_id": "NOTES"})
            third = await execute(rt, "llama-1", "google_drive", {"operation": "list"})
    assert read == "'notes.txt' (id: NOTES):\nkeep me"
    assert delete.startswith("TOOL CALL REJECTED: google_drive")
    assert drive.files["NOTES"].trashed is False and not any(c.method == "PATCH" for c in drive.calls)
    assert third.startswith("RATE LIMIT EXCEEDED: google_drive (drive)")  # the gate type is the rate-limit type
