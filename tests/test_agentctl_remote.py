"""agentctl against a running server: its writes go through the server (at once, audited there), never to
the server's files; with the server stopped it writes them itself. A real server process, the real CLI."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from typing import Any

import httpx

import agentctl_remote
import audit_log
import grants
from shell_client import ShellClient
from tests.conftest import ROOT, AgentServer, free_port, openai_model
from tests.fakes.backend import text, tool_call
from tests.test_grants import BASE, DB_PLUGIN
from tests.waiting import until_sync


def _agentctl(server: AgentServer, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(ROOT / "agentctl.py"), "--config-dir", str(server.cfg.path), *args],
                          capture_output=True, text=True, timeout=60, env=env)


async def _turn(client: ShellClient, message: str, answer: str | None) -> list[Any]:
    """One turn; every gate answered with `answer`. The events, in order."""
    events = []
    await client.submit(message)
    async for ev in client.events():
        events.append(ev)
        if ev.name == "gate" and answer:
            await client.gate_response(ev.data["gate_id"], answer)
        if ev.name == "done":
            return events
    return events


def _asked(events: list[Any]) -> bool:
    return any(ev.name == "gate" for ev in events)


def test_agentctl_revoke_while_the_server_runs_is_in_force_at_once_and_the_chain_stays_whole(
        config_dir, fake_openai, start_server) -> None:
    config_dir.models = {"fake": openai_model(fake_openai)}
    config_dir.add_plugin("plugin_test_db", DB_PLUGIN)
    server: AgentServer = start_server(config_dir, wait=False)
    server.wait_ready(60)  # slow to start on a busy machine
    fake_openai.script(tool_call("db_query", {"sql": BASE}), text("renamed"),
                       tool_call("db_query", {"sql": BASE.replace("1", "2")}), text("again"),
                       tool_call("db_query", {"sql": BASE.replace("1", "3")}), text("asked"))

    async def run() -> None:
        async with ShellClient(server.url, "remote-1", token=server.token) as client:
            await client.connect(max_wait=10)
            assert _asked(await _turn(client, "rename", "allow_session"))
            assert not _asked(await _turn(client, "rename again", None))  # the grant answers
            listed = _agentctl(server, "grants")
            assert listed.returncode == 0 and "remote-1: [g" in listed.stdout and "used 1×" in listed.stdout
            grant_id = listed.stdout.split("[", 1)[1].split("]", 1)[0]
            revoked = _agentctl(server, "grants", "revoke", grant_id)
            assert revoked.returncode == 0, revoked.stderr
            assert f"revoked {grant_id}" in revoked.stdout and "by the running server" in revoked.stdout
            assert "No active grants." in _agentctl(server, "grants").stdout
            third = await _turn(client, "once more", "reject")  # in force at once: the next call asks
            assert _asked(third)

    asyncio.run(run())
    verified = _agentctl(server, "audit-verify")  # while it runs
    assert verified.returncode == 0 and "chain intact and matches its head" in verified.stdout, verified.stderr
    log = server.stop()
    assert "UNIQUE constraint" not in log and "Traceback" not in log
    verified = _agentctl(server, "audit-verify")
    assert verified.returncode == 0 and "chain intact" in verified.stdout, verified.stderr
    records = list(audit_log.read_audit(server.data_dir / grants.AUDIT_FILE))
    revokes = [r for r in records if r["event"] == "revoke"]
    assert [(r["actor"], r["grant_id"]) for r in revokes] == [("agentctl", grant_id_of(records))]
    assert records[-1]["event"] == "decision" and records[-1]["outcome"] == "rejected"  # after the revoke
    server.start(wait=False).wait_ready(60)  # the revoked grant stays revoked after a restart
    assert "No active grants." in _agentctl(server, "grants").stdout


def grant_id_of(records: list[dict[str, Any]]) -> str:
    return next(r["grant_id"] for r in records if r["event"] == "grant")


def test_gate_policy_from_agentctl_is_applied_saved_and_audited_by_the_running_server(
        config_dir, fake_openai, start_server) -> None:
    config_dir.models = {"fake": openai_model(fake_openai)}
    config_dir.add_plugin("plugin_test_db", DB_PLUGIN)
    config_dir.gates = {"db": {"*": {"read": False, "write": False}}, "tools": {"*": {"read": False, "write": False}}}
    server: AgentServer = start_server(config_dir, wait=False)
    server.wait_ready(60)  # slow to start on a busy machine
    gates_file = server.cfg.path / "gate-defaults.json"
    fake_openai.script(tool_call("db_query", {"sql": BASE}), text("one"),
                       tool_call("db_query", {"sql": BASE}), text("two"))

    async def run() -> None:
        async with ShellClient(server.url, "remote-2", token=server.token) as client:
            await client.connect(max_wait=10)
            assert _asked(await _turn(client, "rename", "allow"))
            done = _agentctl(server, "gate-set", "db", "users", "write", "true")
            assert done.returncode == 0, done.stderr
            assert "The running server saved and applied it" in done.stdout and "Restart" not in done.stdout
            assert not _asked(await _turn(client, "rename again", None))  # in force at once

    asyncio.run(run())
    assert json.loads(gates_file.read_text())["db"]["users"] == {"read": False, "write": True, "ddl": False}
    server.stop()
    policy = [r for r in audit_log.read_audit(server.data_dir / grants.AUDIT_FILE) if r["event"] == "policy"]
    # The new entry for users: write auto-allowed, read and DDL gated explicitly (gated through * before).
    assert [(r["actor"], r["tables"], r["op"], r["outcome"]) for r in policy] == [
        ("agentctl", ["users"], "read", "gate-defaults.json: gated"),
        ("agentctl", ["users"], "write", "gate-defaults.json: auto-allow"),
        ("agentctl", ["users"], "ddl", "gate-defaults.json: gated")]


def test_a_running_server_that_refuses_agentctl_gets_no_file_written_behind_its_back(
        config_dir, fake_openai, start_server) -> None:
    """agentctl with a wrong token: the server answers 401, so agentctl refuses instead of writing the file."""
    config_dir.models = {"fake": openai_model(fake_openai)}
    server: AgentServer = start_server(config_dir, wait=False)
    server.wait_ready(60)  # slow to start on a busy machine
    gates_file = server.cfg.path / "gate-defaults.json"
    before = gates_file.read_bytes() if gates_file.exists() else None
    env = {**os.environ, "AGENT_SHELL_TOKEN": "not-the-token"}
    refused = _agentctl(server, "gate-set", "*", "read", "true", env=env)
    assert refused.returncode == 2 and "refuses agentctl (HTTP 401)" in refused.stderr, refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1
    assert (gates_file.read_bytes() if gates_file.exists() else None) == before
    revoke = _agentctl(server, "grants", "revoke", "all", env=env)
    assert revoke.returncode == 2 and "nothing was changed" in revoke.stderr


def test_with_the_endpoint_off_a_running_server_still_keeps_agentctl_out_of_its_log(
        config_dir, fake_openai) -> None:
    """The shell endpoint disabled, another client up: the audit log's lock says the server runs."""
    config_dir.models = {"fake": openai_model(fake_openai)}
    config_dir.plugins.append("plugin_client_api")
    config_dir.plugin_config["plugin_client_api"] = {"port": free_port()}
    config_dir.plugin_config["plugin_client_shellpy"] = {"enabled": False}
    server = AgentServer(config_dir.write())
    server.start(wait=False)
    try:
        lock = server.data_dir / (grants.AUDIT_FILE + ".lock")

        def holds_log() -> bool:
            assert server.proc is not None and server.proc.poll() is None
            return lock.exists() and agentctl_remote.server_holds_log(server.data_dir)

        until_sync(holds_log, "the server to hold the audit log's lock", 30, step=0.1)
        refused = _agentctl(server, "grants", "revoke", "all")
        assert refused.returncode == 2 and "its shell endpoint (plugin_client_shellpy) cannot be reached" \
            in refused.stderr
    finally:
        log = server.stop()
    assert "UNIQUE constraint" not in log


def test_admin_save_checks_the_whole_file_and_writes_nothing_on_error(config_dir, fake_openai, start_server) -> None:
    """POST /admin save (httpx, as agentctl sends it): an unknown field, top-level or inside an entry, or a
    value of the wrong type is refused with a message naming it, and nothing is written or audited."""
    config_dir.models = {"fake": openai_model(fake_openai)}
    config_dir.gates = {"db": {"users": {"read": True, "write": False}}}
    server: AgentServer = start_server(config_dir, wait=False)
    server.wait_ready(60)  # slow to start on a busy machine
    gates_file = server.cfg.path / "gate-defaults.json"
    models_file = server.cfg.path / "llm-models.json"
    before = (gates_file.read_bytes(), models_file.read_bytes())
    good = {"version": "1.0.0", "db": {"users": {"read": True, "write": True}}, "tools": {}}

    def save(file: str, data: dict[str, Any]) -> httpx.Response:
        return httpx.post(f"{server.url}/admin", json={"action": "save", "file": file, "data": data},
                          headers=server.auth, timeout=30)

    cases = [({**good, "allow_all": True}, "unknown field 'allow_all': remove it"),
             ({**good, "allow_all": True, "bypass": 1}, "unknown fields 'allow_all', 'bypass': remove them"),
             ({**good, "db": {"users": {"read": True, "wirte": True}}}, "unknown field 'db.users.wirte'"),
             ({**good, "db": {"users": {"read": "yes please"}}}, "field 'db.users.read'")]
    for data, why in cases:
        refused = save("gate-defaults.json", data)
        assert refused.status_code == 400, refused.text
        assert why in refused.json()["error"] and "nothing was changed" in refused.json()["error"], refused.text
    models = json.loads(models_file.read_text())
    refused = save("llm-models.json", {**models, "defualt": "fake"})
    assert refused.status_code == 400 and "unknown field 'defualt'" in refused.json()["error"], refused.text
    assert (gates_file.read_bytes(), models_file.read_bytes()) == before
    saved = save("gate-defaults.json", good)
    assert saved.status_code == 200, saved.text
    assert json.loads(gates_file.read_text())["db"]["users"] == {"read": True, "write": True, "ddl": False}
    log = server.stop()
    assert "unknown field" not in log  # refused, not "ignored"
    policy = [r for r in audit_log.read_audit(server.data_dir / grants.AUDIT_FILE) if r["event"] == "policy"]
    assert [(r["tables"], r["op"], r["outcome"]) for r in policy] == [
        (["users"], "write", "gate-defaults.json: auto-allow")]  # the good save only
