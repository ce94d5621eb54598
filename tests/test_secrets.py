"""Files and secrets: canaries planted in every config field and env var that can hold a secret or a
location never reach a non-admin surface, and secrets never reach the log; secret files others may read
are refused; data files are private whatever the umask.

One real server (subprocess) with every client plugin a stranger can reach (proxy, API without the admin
key, Slack through the fake, MCP with an agent-class token), a failing model whose URL carries userinfo,
a database plugin with nothing listening, and MCP servers that cannot start.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import platform
import stat
from pathlib import Path
from typing import Any

import httpx
import pytest

import config
import guard
import secret_files
from tests.conftest import AgentServer, ConfigDir, free_port, openai_model
from tests.fakes.backend import text, tool_call
from tests.fakes.slack import APP_TOKEN, BOT_TOKEN
from tests.runtime import ALL_OPEN
from tests.test_mcp_server import connect
from tests.test_plugin_client_slack import fake_slack, mention  # noqa: F401  (fake_slack is a fixture)
from tests.turns import answer, run_turn

#: Secrets: in no response and never in the log.
SECRETS = {
    "model key": "sk-canary-modelkey-0001",
    "broken model url user": "canaryuser0002",
    "broken model url password": "canarypass0003",
    "broken model key": "sk-canary-brokenkey-0019",
    "MYSQL_PASS": "canary-mysqlpass-0004",
    "SLACK_BOT_TOKEN": BOT_TOKEN,  # the fake Slack accepts only its own tokens: they are the canaries
    "SLACK_APP_TOKEN": APP_TOKEN,
    "API_KEY": "canary-apikey-0010",
    "API_ADMIN_KEY": "canary-adminkey-0011",
    "mcp human token": "canary-mcphuman-0012",
    "mcp agent token": "canary-mcpagent-0013",
    "mcp stdio env value": "canary-mcpenv-0014",
    "mcp url user": "canaryuser0015",
    "mcp url password": "canarypass0016",
    "drive base_url user": "canaryuser0040",
    "drive base_url password": "canarypass0041",
    "mcp http token": "canary-mcphttp-0024",
    "AGENT_PROXY_TOKEN": "canary-proxytoken-0025",
}
#: Locations: in no non-admin response (the shell and the log may show them).
LOCATIONS = {
    "MYSQL_USER": "canaryuser0006",
    "MYSQL_DB": "canarydb0007",
    "mcp header": "canary-mcpheader-0018",
    "mcp command": "canary-cmd-0020",
    "mcp argument": "canary-arg-0021",
    "broken model path": "canary-path-0022",
    "mcp url path": "canary-mcppath-0023",
    "drive base_url path": "canary-drivepath-0042",
    "drive ca_bundle": "canary-ca-0043",
    "drive subject": "canary-subject-0044",
}
AGENT = "canary-mcpagent-0013"


def _found(text: str, canaries: dict[str, str]) -> list[str]:
    return [f"{name} ({value})" for name, value in canaries.items() if value in text]


@pytest.fixture
def planted(tmp_path: Path, fake_openai: Any, fake_slack: Any) -> AgentServer:  # noqa: F811
    closed = free_port()  # nothing listens there
    cfg = ConfigDir(tmp_path / "cfg")
    cfg.path.mkdir()
    cfg.models = {
        "fake": openai_model(fake_openai, env_key="CANARY_MODEL_KEY"),
        "broken": {"model_id": "m", "type": "OPENAI", "env_key": "CANARY_BROKEN_KEY", "max_retries": 0,
                   "llm_call_timeout": 10,
                   "host": f"http://{SECRETS['broken model url user']}:{SECRETS['broken model url password']}"
                           f"@127.0.0.1:{closed}/{LOCATIONS['broken model path']}/v1"},
    }
    cfg.gates = ALL_OPEN
    api_port, proxy_port, mcp_port = free_port(), free_port(), free_port()
    cfg.plugins += ["plugin_client_api", "plugin_proxy_llama", "plugin_client_slack", "plugin_client_mcp",
                    "plugin_mcp_client", "plugin_database_mysql", "plugin_storage_googledrive"]
    cfg.plugin_config.update({
        "plugin_client_api": {"port": api_port},
        "plugin_proxy_llama": {"port": proxy_port},
        "plugin_client_mcp": {"port": mcp_port},
        "plugin_client_slack": {"api_base_url": fake_slack.base_url, "port": free_port(), "update_interval": 0.05,
                                "ping_interval": 1},
        "plugin_storage_googledrive": {
            "base_url": f"http://{SECRETS['drive base_url user']}:{SECRETS['drive base_url password']}@127.0.0.1:"
                        f"{closed}/{LOCATIONS['drive base_url path']}",
            "ca_bundle": f"/nonexistent/{LOCATIONS['drive ca_bundle']}.pem",
            "subject": f"{LOCATIONS['drive subject']}@example.com"},
    })
    cfg.env = {
        "CANARY_MODEL_KEY": SECRETS["model key"], "CANARY_BROKEN_KEY": SECRETS["broken model key"],
        "MYSQL_HOST": "127.0.0.1", "MYSQL_PORT": str(closed), "MYSQL_USER": LOCATIONS["MYSQL_USER"],
        "MYSQL_PASS": SECRETS["MYSQL_PASS"], "MYSQL_DB": LOCATIONS["MYSQL_DB"],
        "SLACK_BOT_TOKEN": SECRETS["SLACK_BOT_TOKEN"], "SLACK_APP_TOKEN": SECRETS["SLACK_APP_TOKEN"],
        "API_KEY": SECRETS["API_KEY"], "API_ADMIN_KEY": SECRETS["API_ADMIN_KEY"],
        "AGENT_PROXY_TOKEN": SECRETS["AGENT_PROXY_TOKEN"],
        "CANARY_MCP_TOKEN": SECRETS["mcp stdio env value"], "CANARY_MCP_HTTP_TOKEN": SECRETS["mcp http token"],
    }
    cfg.write()
    servers = {"servers": {
        "local": {"command": f"/nonexistent/{LOCATIONS['mcp command']}", "args": [f"--{LOCATIONS['mcp argument']}"],
                  "env": {"CANARY_MCP_TOKEN": "CANARY_MCP_TOKEN"}},
        "remote": {"url": f"http://{SECRETS['mcp url user']}:{SECRETS['mcp url password']}@127.0.0.1:{closed}"
                          f"/{LOCATIONS['mcp url path']}/mcp",
                   "headers": {"X-Canary": LOCATIONS["mcp header"]}, "token_env": "CANARY_MCP_HTTP_TOKEN"},
    }}
    (cfg.path / "mcp-servers.json").write_text(json.dumps(servers))
    tokens = cfg.path / "mcp-tokens.json"
    tokens.write_text(json.dumps({"tokens": {
        "owner": {"role": "human", "token": SECRETS["mcp human token"]},
        "worker": {"role": "agent", "session": "worker", "token": AGENT}}}))
    tokens.chmod(0o600)
    server = AgentServer(cfg)
    server.api, server.proxy, server.mcp = (f"http://127.0.0.1:{p}" for p in (api_port, proxy_port, mcp_port))
    server.start(wait=False).wait_ready(60)  # many plugins: slow to start on a busy machine
    yield server
    server.stop()


def _api(server: AgentServer, method: str, path: str, **kw: Any) -> str:
    response = httpx.request(method, server.api + path, headers={"Authorization": f"Bearer {SECRETS['API_KEY']}"},
                             timeout=60, **kw)
    return f"{response.status_code} {response.text}"


def _proxy(server: AgentServer, content: str, *, stream: bool = False) -> str:
    body = {"model": "agent-mcp", "stream": stream, "messages": [{"role": "user", "content": content}],
            "user": "stranger"}
    response = httpx.post(server.proxy + "/v1/chat/completions", json=body, timeout=60,
                          headers={"Authorization": f"Bearer {SECRETS['AGENT_PROXY_TOKEN']}"})
    return f"{response.status_code} {response.text}"


async def _slack(fake: Any, words: str, ts: str) -> str:
    fake.push_event(mention(words, ts))

    def done() -> str | None:
        msgs = fake.thread("C1", ts)
        return "\n".join(m.text for m in msgs) if msgs and not any(m.text.endswith("…_") for m in msgs) else None

    return await fake.until(done, 30)


async def _mcp_agent(server: AgentServer) -> str:
    seen = []
    async with connect(server.mcp + "/mcp", AGENT) as client:
        tools = await client.list_tools()
        seen.append(json.dumps([t.model_dump(mode="json") for t in tools.tools]))
        for name in ("get_system_info", "llm_list", "db_query"):
            args = {"sql": "SELECT 1"} if name == "db_query" else {}
            try:
                result = await client.call_tool(name, args)
                seen.append(json.dumps(result.model_dump(mode="json")))
            except Exception as exc:  # a refusal (-32950) is a surface too
                seen.append(f"{type(exc).__name__}: {exc}")
        resources = await client.list_resources()
        seen.append(json.dumps([r.model_dump(mode="json") for r in resources.resources]))
    return "\n".join(seen)


def test_no_canary_reaches_a_non_admin_surface_and_no_secret_reaches_the_log(planted, fake_openai,
                                                                            fake_slack):  # noqa: F811
    server = planted
    seen: dict[str, str] = {}
    host_facts = [f for f in (platform.node(), platform.release()) if len(f) >= 6]
    locations = {**LOCATIONS, "slack api url": fake_slack.base_url}
    for words in ("!help", "!mcp", "!model", "@broken hello"):
        seen[f"proxy {words}"] = _proxy(server, words)
        seen[f"api {words}"] = _api(server, "POST", "/api/v1/submit",
                                    json={"text": words, "client_id": "stranger", "wait": True})
    seen["proxy streamed error"] = _proxy(server, "@broken stream please", stream=True)
    seen["api health"] = _api(server, "GET", "/api/v1/health")
    seen["api sessions"] = _api(server, "GET", "/api/v1/sessions")
    seen["api unknown route"] = _api(server, "GET", "/nope")
    # Tool results a stranger's turn gives the model: system info, the model list, a failing database.
    fake_openai.script(tool_call("get_system_info", {}), tool_call("llm_list", {}),
                       tool_call("db_query", {"sql": "SELECT 1"}), text("done"))
    seen["proxy tool turn"] = _proxy(server, "what runs here?")
    seen["tool results to the model"] = json.dumps([m for r in fake_openai.requests for m in r.json["messages"]
                                                    if m["role"] == "tool"])
    seen["what the model was sent"] = json.dumps([r.json for r in fake_openai.requests])
    results = seen["tool results to the model"]
    assert "Python" in results and "broken: OPENAI m" in results and "cannot connect to MySQL" in results

    async def slack_and_mcp() -> None:
        await fake_slack.until(lambda: fake_slack.connections >= 1, 30)
        for n, words in enumerate(("!help", "!mcp", "!model", "@broken hello")):
            seen[f"slack {words}"] = await _slack(fake_slack, words, f"1600000000.00{n:04d}")
        seen["mcp agent token"] = await _mcp_agent(server)

    asyncio.run(slack_and_mcp())
    assert "Available models" in seen["slack !model"] and "MCP servers" in seen["slack !mcp"]
    assert "Available models" in seen["api !model"] and "Commands:" in seen["proxy !help"]

    seen["what the model was sent"] = json.dumps([r.json for r in fake_openai.requests])  # every turn's
    leaks = {surface: _found(body, {**SECRETS, **locations}) + [f for f in host_facts if f in body]
             for surface, body in seen.items()}
    assert {s: found for s, found in leaks.items() if found} == {}

    # The shell (an admin) still sees where things are, and no secret either.
    shell = answer(run_turn(server, "admin", "!mcp"))
    assert LOCATIONS["mcp command"] in shell and _found(shell, SECRETS) == []
    log = server.stop()
    assert "MCP server" in log and "broken" in log  # the log was written
    assert _found(log, SECRETS) == [], "a secret reached the log"
    assert "Traceback" not in log


# ── secret files and data files ─────────────────────────────────────────────────────────────────


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644])
def test_a_secret_file_others_may_read_is_refused_with_the_path_and_the_fix(tmp_path: Path, mode: int) -> None:
    path = tmp_path / "api-key"
    path.write_text("s3cret-value\n")
    path.chmod(mode)
    with pytest.raises(secret_files.SecretFileError) as caught:
        secret_files.read_secret_file(path, "the API key")
    assert str(path) in str(caught.value) and f"chmod 600 {path}" in str(caught.value)
    path.chmod(0o600)
    assert secret_files.read_secret_file(path) == b"s3cret-value\n"


def test_a_world_readable_mcp_token_file_stops_the_mcp_plugin(tmp_path: Path) -> None:
    from plugin_api import PluginConfigError
    from plugins._mcp_tokens import load_tokens

    path = tmp_path / "mcp-tokens.json"
    path.write_text(json.dumps({"tokens": {"me": {"role": "human", "token": "x" * 24}}}))
    path.chmod(0o644)
    with pytest.raises(PluginConfigError, match=r"readable or writable by other users: run chmod 600"):
        load_tokens(path)
    path.chmod(0o600)
    assert load_tokens(path)[0][1].name == "me"


def test_created_secret_files_are_private_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        data, created = secret_files.ensure_secret_file(tmp_path / "d" / "key", lambda: b"k")
    finally:
        os.umask(old)
    assert created and data == b"k" and stat.S_IMODE((tmp_path / "d" / "key").stat().st_mode) == 0o600
    assert secret_files.ensure_secret_file(tmp_path / "d" / "key", lambda: b"other") == (b"k", False)


def test_every_data_file_is_0600_in_an_open_data_dir_whatever_the_umask(tmp_path: Path, fake_openai) -> None:
    """A 0755 data dir and umask 0: sessions, audit log, MCP approvals, their WAL/SHM, head, key: all 0600."""
    from tests.conftest import AgentServer

    cfg = ConfigDir(tmp_path / "cfg")
    cfg.path.mkdir()
    cfg.models = {"fake": openai_model(fake_openai)}
    cfg.plugins.append("plugin_client_mcp")
    cfg.plugin_config["plugin_client_mcp"] = {"port": free_port()}
    cfg.write()
    data = cfg.path / "data"
    data.mkdir(mode=0o755)
    data.chmod(0o755)
    (data / "sessions.sqlite3").write_bytes(b"")  # left 0644 by an older version: made private at start
    (data / "sessions.sqlite3").chmod(0o644)
    old = os.umask(0)
    try:
        server = AgentServer(cfg).start(wait=False)
        server.wait_ready(60)
    finally:
        os.umask(old)
    try:
        fake_openai.script(text("hi"))
        run_turn(server, "c1", "hello")
        files = sorted(p for p in data.rglob("*") if p.is_file())
        names = {p.name for p in files}
        assert {"sessions.sqlite3", "audit.sqlite3", "mcp-approvals.sqlite3", "audit-head", "audit-key",
                "shell-token"} <= names, names
        assert any(n.endswith("-wal") for n in names), names
        loose = {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in files if stat.S_IMODE(p.stat().st_mode) & 0o077}
        assert loose == {}
    finally:
        server.stop()


def test_userinfo_and_secrets_are_redacted_from_log_lines_and_exception_texts(caplog) -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("agent_mcp_main", Path(__file__).parents[1] / "agent-mcp.py")
    assert spec and spec.loader
    main = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(main)
    env = {"SESSION_STORE": "redis://:canary-redispw-0030@127.0.0.1:6379/0", "MYSQL_PASS": "canary-mysql-0031"}
    redact = main._RedactSecrets(config.secret_values(env, {"p": {"nested": [{"token": "canary-nested-0032"}]}}))
    logger = logging.getLogger("agent_mcp.test_secrets")
    logger.addFilter(redact)
    try:
        with caplog.at_level(logging.INFO, logger="agent_mcp.test_secrets"):
            logger.info("calling %s", "http://canary-user-0033:canary-pw-0034@example.invalid/v1")
            try:
                raise ConnectionError("cannot reach mysql://root:canary-dsnpw-0035@db:3306/x (canary-mysql-0031)")
            except ConnectionError:
                logger.exception("failed with canary-nested-0032 and redis://:canary-redispw-0030@h")
        text = "\n".join(caplog.messages) + "\n".join(r.exc_text or "" for r in caplog.records)
        formatted = "\n".join(main._FORMATTER.format(r) for r in caplog.records)
    finally:
        logger.removeFilter(redact)
    for canary in ("0030", "0031", "0032", "0033", "0034", "0035"):
        assert f"-{canary}" not in text + formatted, canary
    assert "http://***@example.invalid/v1" in text and "mysql://***@db:3306/x" in formatted
    assert guard.hide_userinfo("redis://u:p@h/0") == "redis://***@h/0"
