"""The fence of stdio MCP servers: no secrets in `args`, resource limits, only the declared environment, and
the bubblewrap sandbox (tests/fakes/mcp_hostile.py tries what a third-party server must not do).

The config dir of these tests lies under the home directory, not /tmp: the sandbox replaces /tmp with a
private one, which would hide a config dir there whatever the fence did about it.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import shutil
import socket
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import build
import state
import stores
from config import ConfigError, load_config
from plugins._mcp_fence import Host, fenced, find_sandbox
from plugins._mcp_servers import McpServersFile, expand_arguments, load_servers, secret_arguments, shown_arguments
from tests import needs, waiting
from tests.conftest import ROOT, ConfigDir, free_port, openai_model
from tests.runtime import execute
from tests.test_mcp_client import PLUGIN, plugin, routes_command, stdio_server, until, write_config

HOSTILE = str(ROOT / "tests" / "fakes" / "mcp_hostile.py")
API_KEY = "canary-fence-apikey-7341"
DB_ACCOUNTS = "canary-fence-dbaccounts-7342"
DOTENV = "canary-fence-dotenv-7343"
ARG_SECRET = "canary-fence-argvalue-7344"
HOST_TMP = Path("/tmp")
MARIADB_SOCKET = Path("/run/mysqld/mysqld.sock")


def hostile(**extra: Any) -> dict[str, Any]:
    """An mcp-servers.json entry for the hostile server (no cwd: a sandboxed one works in its own dir)."""
    return {"command": sys.executable, "args": [HOSTILE], **extra}


def exists(path: Path) -> bool:
    return path.exists()


async def bwrap_or_skip() -> str:
    """The bwrap that can make a sandbox here; else skip (or fail, when AGENT_TEST_REQUIRE names it) saying why."""
    needs.program("bwrap", "bubblewrap", "bubblewrap")
    found, why, _ = await find_sandbox(os.environ.get("PATH"))
    if found is None:
        needs.absent("bubblewrap", why)
    return found


@pytest.fixture
def home_dir() -> Iterator[Path]:
    """A config dir outside /tmp (see the module docstring), removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix=".agent-mcp-fence-test-", dir=Path.home()))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
async def fenced_rt(home_dir, fake_openai):
    """Build a runtime over `home_dir` with agent-mcp's secret files planted in it; closed afterwards."""
    built: list[state.Runtime] = []

    async def _make(servers: dict[str, Any], env: dict[str, str] | None = None,
                    stdio: dict[str, Any] | None = None) -> state.Runtime:
        cfg = ConfigDir(home_dir)
        cfg.models = {"fake": openai_model(fake_openai)}
        cfg.env = {"FENCE_DOTENV_SECRET": DOTENV, **(env or {})}
        write_config(cfg, servers)
        if stdio is not None:
            (home_dir / "mcp-servers.json").write_text(json.dumps({"stdio": stdio, "servers": servers}))
        data = home_dir / "data"
        data.mkdir(mode=0o700, exist_ok=True)
        (data / "api-key").write_text(API_KEY)
        (data / "db-accounts.env").write_text(f"GRANTOR_PASSWORD={DB_ACCOUNTS}\n")
        rt = await build.build_runtime(load_config(home_dir), store=stores.MemoryStore())
        built.append(rt)
        assert rt.plugins is not None
        await rt.plugins.load_all()
        return rt

    yield _make
    for rt in built:
        await build.close_runtime(rt)


async def outcome(rt: state.Runtime, tool: str, args: dict[str, Any]) -> dict[str, Any]:
    return json.loads(await execute(rt, "c1", tool, args))


# ── secrets in args ──


@pytest.mark.parametrize("args, index", [
    (["--api-key=hunter2hunter2"], 0),
    (["--token", "plain-value-1"], 1),
    (["serve", "--github-token", "abc"], 2),
    (["OPENAI_API_KEY=hello"], 0),
    (["--model", "sk-proj-abcdefghijklmnopqrstuvwx"], 1),
    (["https://hooks.example.com/?t=xoxb-1234567890-abcdefghij"], 0),
    (["ghp_aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"], 0),
    (["--id", "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"], 1),
])
def test_a_literal_secret_in_args_is_found_and_masked(args, index):
    (found,) = secret_arguments("brave", args)
    assert found[0] == index and "${" in found[1] and ".env" in found[1]
    assert args[index].partition("=")[2 if "=" in args[index] else 0] not in found[1]
    assert shown_arguments(args)[index].endswith("***")
    assert all(a == s for i, (a, s) in enumerate(zip(args, shown_arguments(args), strict=True)) if i != index)


@pytest.mark.parametrize("args", [
    ["-m", "tests.fakes.mcp_server", "stdio"],
    ["-y", "@modelcontextprotocol/server-filesystem", "/srv/shared"],
    ["--api-key=${BRAVE_API_KEY}", "--token", "${TOKEN}"],
    ["--key", "/etc/ssl/private/server.pem", "--token-file", "./token.txt"],
    ["--local-timezone", "Europe/Amsterdam", "--port", "8080"],
    ["my-company-internal-mcp-server-2024-edition", "org.example.mcp.server.filesystem.v1234"],
    ["--session", "3fa85f64-5717-4562-b3fc-2c963f66afa6"],
])
def test_ordinary_arguments_and_references_are_not_secrets(args):
    assert secret_arguments("x", args) == [] and shown_arguments(args) == args


def test_a_secret_in_args_stops_start_up_with_the_field_and_the_fix_but_not_the_value(tmp_path):
    path = tmp_path / "mcp-servers.json"
    brave = {"command": "npx", "args": ["-y", "brave", f"--api-key={ARG_SECRET}"]}
    path.write_text(json.dumps({"servers": {"brave": brave, "bad": {"command": "x", "args": ["${not a name}"]}}}))
    with pytest.raises(ConfigError) as err:
        load_servers(path)
    message = str(err.value)
    assert "field 'servers.bad.args'" in message and "is not an environment variable name" in message
    path.write_text(json.dumps({"servers": {"brave": brave}}))
    with pytest.raises(ConfigError) as err:
        load_servers(path)
    message = str(err.value)
    assert "servers.brave.args.2" in message and "put it in .env as BRAVE_API_KEY=" in message
    assert '"--api-key=${BRAVE_API_KEY}"' in message and ARG_SECRET not in message


async def test_a_secret_in_args_fails_the_plugin_at_start_with_the_fix_and_the_server_runs_on(fenced_rt, caplog):
    rt = await fenced_rt({"brave": hostile(args=[HOSTILE, "--token", ARG_SECRET]), "good": stdio_server()})
    report = rt.plugins.reports[PLUGIN]
    assert report.status == "failed" and "servers.brave.args.2" in report.reasons[0]
    assert 'put it in .env as BRAVE_TOKEN=… and write "${BRAVE_TOKEN}" in args' in report.reasons[0]
    assert ARG_SECRET not in "\n".join(report.reasons) and ARG_SECRET not in caplog.text
    assert "get_system_info" in rt.tools.names()


def test_references_are_expanded_and_an_unset_one_is_named():
    assert expand_arguments(["--k=${A}", "${B}x", "plain"], {"A": "1", "B": "2"}) == ["--k=1", "2x", "plain"]
    with pytest.raises(Exception, match="B"):
        expand_arguments(["${B}"], {})


async def test_an_argument_from_the_environment_reaches_the_server_and_never_the_log_or_mcp(fenced_rt, caplog):
    caplog.set_level(logging.INFO)
    rt = await fenced_rt({"h": hostile(args=[HOSTILE, "--api-key=${FENCE_ARG}"]),
                          "unset": hostile(args=[HOSTILE, "${FENCE_NOT_SET}"])},
                         env={"FENCE_ARG": ARG_SECRET})
    assert f"--api-key={ARG_SECRET}" in json.loads(await execute(rt, "c1", "h_argv", {}))["argv"]
    status = await routes_command(rt, "!mcp")
    assert "--api-key=${FENCE_ARG}" in status and ARG_SECRET not in status
    assert "'unset' failed: environment variable FENCE_NOT_SET (from 'args') is not set: add it to .env" in \
        "\n".join(rt.plugins.reports[PLUGIN].reasons)
    await waiting.until(lambda: "my arguments" in caplog.text, "the server's stderr line in the log")
    assert "--api-key=***" in caplog.text and ARG_SECRET not in caplog.text


# ── limits and environment (with or without the sandbox) ──


def test_limits_come_from_the_defaults_with_per_server_overrides():
    servers = McpServersFile.model_validate({
        "stdio": {"limits": {"memory_mb": 512}, "network": "host"},
        "servers": {"a": {"command": "x"}, "b": {"command": "x", "limits": {"cpu_seconds": None, "open_files": 64},
                                                   "network": "none", "sandbox": "off", "hidden": []}},
    }).servers
    a, b = servers["a"], servers["b"]
    assert a.limits.memory_mb == 512 and a.limits.cpu_seconds == 3600 and a.network == "host"
    assert a.sandbox == "auto" and "~/.ssh" in a.hidden
    assert b.limits.memory_mb == 512 and b.limits.cpu_seconds is None and b.limits.open_files == 64
    assert b.network == "none" and b.sandbox == "off" and b.hidden == []


def test_the_sandbox_hides_the_agents_dirs_and_binds_only_the_working_dir(tmp_path):
    config, data = tmp_path / "cfg", tmp_path / "elsewhere" / "data"
    config.mkdir()
    (config / ".env").write_text("X=1\n")
    audit_key = tmp_path / "keys" / "audit-key"
    audit_key.parent.mkdir()
    audit_key.write_text("k")
    host = Host(config, data, "/usr/bin/bwrap", secret_files=(audit_key,))
    spec = McpServersFile.model_validate({"servers": {"s": {"command": "x"}}}).servers["s"]
    launch = fenced("s", spec, "/usr/bin/true", ["a"], ["TOKEN"], host)
    argv = launch.args
    assert launch.command == "/usr/bin/bwrap" and launch.sandboxed and launch.cwd == data.resolve() / "mcp" / "s"
    pairs = list(itertools.pairwise(argv))
    assert ("--tmpfs", str(config.resolve())) in pairs and ("--tmpfs", str(data.resolve())) in pairs
    assert ("--ro-bind", "/dev/null") in pairs and ("/dev/null", str(audit_key.resolve())) in pairs
    assert ("--tmpfs", "/run") in pairs and ("--tmpfs", "/tmp") in pairs and "--share-net" not in argv
    assert ("--cap-drop", "ALL") in pairs and "--unshare-all" in argv and "--die-with-parent" in argv
    assert "--unshare-user" in argv and "--disable-userns" in argv
    assert argv[argv.index("--bind") + 1:argv.index("--bind") + 3] == [str(launch.cwd)] * 2
    assert argv.count("--bind") == 1
    assert argv[-2:] == ["/usr/bin/true", "a"] and ("--keep", "TOKEN") in pairs
    assert ("--set", f"HOME={launch.cwd}") in pairs
    (tmp_path / "work").mkdir()
    elsewhere = fenced("s", spec.model_copy(update={"cwd": str(tmp_path / "work")}), "/usr/bin/true", [], [], host)
    assert elsewhere.cwd == tmp_path / "work" and elsewhere.args.count("--bind") == 2
    with pytest.raises(Exception, match="holds agent-mcp's own files"):
        fenced("s", spec.model_copy(update={"cwd": str(tmp_path)}), "/usr/bin/true", [], [], host)
    with pytest.raises(Exception, match="is not a directory: create it"):
        fenced("s", spec.model_copy(update={"cwd": str(tmp_path / "nowhere")}), "/usr/bin/true", [], [], host)
    with pytest.raises(Exception, match="required"):
        fenced("s", spec.model_copy(update={"sandbox": "required"}), "/usr/bin/true", [], [],
               Host(config, data, None, "bubblewrap is not installed (apt-get install bubblewrap)"))


async def test_without_bubblewrap_start_up_says_so_and_limits_and_environment_still_hold(
        fenced_rt, monkeypatch, caplog):
    caplog.set_level(logging.INFO)
    monkeypatch.setenv("PATH", os.path.dirname(sys.executable))  # no bwrap on it
    monkeypatch.setenv("FENCE_PROCESS_SECRET", "from-the-process")
    rt = await fenced_rt({"h": hostile(env=["FENCE_GIVEN"]), "strict": hostile(sandbox="required")},
                         env={"FENCE_GIVEN": "given"}, stdio={"limits": {"memory_mb": 256}})
    assert "MCP stdio servers are NOT sandboxed: bubblewrap is not installed" in caplog.text
    assert "apt-get install bubblewrap" in caplog.text
    assert "'strict' failed: its entry says \"sandbox\": \"required\" but bubblewrap is not installed" in \
        "\n".join(rt.plugins.reports[PLUGIN].reasons)
    env = json.loads(await execute(rt, "c1", "h_environment", {}))
    assert set(env) <= {"PATH", "HOME", "LANG", "FENCE_GIVEN", "LC_CTYPE"} and env["FENCE_GIVEN"] == "given"
    big = await outcome(rt, "h_allocate", {"mib": 2048})
    assert not big["ok"] and "MemoryError" in big["detail"]
    assert json.loads(await execute(rt, "c1", "h_limits", {}))["data"] == 256 << 20
    assert "fence: NOT sandboxed (bubblewrap is not installed" in await routes_command(rt, "!mcp")


# ── the sandbox ──


async def test_a_hostile_server_in_the_sandbox_reaches_no_secret_no_file_and_no_network(fenced_rt, home_dir):
    await bwrap_or_skip()
    listener = socket.create_server(("127.0.0.1", free_port()))
    (home_dir / "data").mkdir(mode=0o700)
    unix_path = home_dir / "data" / "agent.sock"
    unix_listener = socket.socket(socket.AF_UNIX)
    unix_listener.bind(str(unix_path))
    unix_listener.listen()
    try:
        rt = await fenced_rt({"h": hostile(env=["FENCE_GIVEN"]), "good": stdio_server()},
                             env={"FENCE_GIVEN": "given"})
        conn = plugin(rt).servers["h"]
        assert conn.status == "connected" and conn.fence and conn.fence.startswith("sandboxed (bubblewrap)")
        for secret in (home_dir / "data" / "api-key", home_dir / "data" / "db-accounts.env", home_dir / ".env",
                       home_dir / "mcp-servers.json"):
            seen = await outcome(rt, "h_read", {"path": str(secret)})
            assert not seen["ok"] and "No such file" in seen["detail"], secret
        # Writes: nowhere on the host but its own dir; its /tmp is its own.
        outside = home_dir / "planted.txt"
        seen = await outcome(rt, "h_write", {"path": str(outside)})
        assert not seen["ok"] and "Read-only file system" in seen["detail"] and not outside.exists()
        seen = await outcome(rt, "h_write", {"path": str(ROOT / "planted-by-hostile.txt")})
        assert not seen["ok"] and "Read-only file system" in seen["detail"]
        assert not (ROOT / "planted-by-hostile.txt").exists()
        own = json.loads(await execute(rt, "c1", "h_cwd", {}))["cwd"]
        assert own == str((home_dir / "data" / "mcp" / "h").resolve())
        assert (await outcome(rt, "h_write", {"path": f"{own}/notes.txt"}))["ok"]
        assert (home_dir / "data" / "mcp" / "h" / "notes.txt").exists()
        marker = HOST_TMP / f"fence-private-{os.getpid()}"
        assert (await outcome(rt, "h_write", {"path": str(marker)}))["ok"] and not marker.exists()
        # Network: the host's loopback and its Unix sockets in hidden dirs and /run.
        seen = await outcome(rt, "h_connect", {"host": "127.0.0.1", "port": listener.getsockname()[1]})
        assert not seen["ok"] and "Connection refused" in seen["detail"]
        assert not (await outcome(rt, "h_unix", {"path": str(unix_path)}))["ok"]
        if exists(MARIADB_SOCKET):  # root may log in to MariaDB through it
            assert not (await outcome(rt, "h_unix", {"path": str(MARIADB_SOCKET)}))["ok"]
        # No way out: no user namespace of its own, no remount of / (it has no capabilities).
        for how in ("remount", "userns"):
            seen = await outcome(rt, "h_escape", {"how": how})
            assert not seen["ok"] and ("permission denied" in seen["detail"]
                                       or "No space left on device" in seen["detail"]), (how, seen)
        # 2 GiB is more than its memory limit; the server lives on, and so does everything else.
        big = await outcome(rt, "h_allocate", {"mib": 2048})
        assert not big["ok"] and "MemoryError" in big["detail"]
        assert (await outcome(rt, "h_allocate", {"mib": 16}))["ok"]
        env = json.loads(await execute(rt, "c1", "h_environment", {}))
        assert DOTENV not in json.dumps(env) and env["FENCE_GIVEN"] == "given" and env["HOME"] == own
        assert set(env) <= {"PATH", "HOME", "LANG", "FENCE_GIVEN", "LC_CTYPE"}
        assert await execute(rt, "c1", "good_add", {"a": 2, "b": 3}) == "5"
        assert conn.status == "connected" and "h [connected]" in await routes_command(rt, "!mcp")
    finally:
        listener.close()
        unix_listener.close()


async def test_a_server_past_its_cpu_time_is_stopped_reported_and_restarted(fenced_rt):
    rt = await fenced_rt({"h": hostile(limits={"cpu_seconds": 1}), "good": stdio_server()})
    conn = plugin(rt).servers["h"]
    result = await execute(rt, "c1", "h_spin", {"seconds": 30})
    assert result.startswith("ERROR:") and "lost while h_spin ran" in result
    assert "SIGXCPU" in result and "limits.cpu_seconds = 1" in result
    await until(rt, lambda: conn.status == "disconnected", "the plugin to notice the stopped server")
    status = await routes_command(rt, "!mcp")
    assert "h [disconnected]" in status and "SIGXCPU" in status
    assert await execute(rt, "c1", "good_add", {"a": 1, "b": 1}) == "2"
    assert json.loads(await execute(rt, "c1", "h_cwd", {}))["cwd"] and conn.status == "connected" and conn.starts == 2


async def test_network_host_and_sandbox_off_are_the_entrys_choice(fenced_rt, home_dir):
    await bwrap_or_skip()
    listener = socket.create_server(("127.0.0.1", free_port()))
    (home_dir / "w").mkdir()
    try:
        rt = await fenced_rt({"net": hostile(network="host"), "open": hostile(sandbox="off", cwd=str(home_dir / "w"))})
        port = listener.getsockname()[1]
        assert (await outcome(rt, "net_connect", {"host": "127.0.0.1", "port": port}))["ok"]
        assert not (await outcome(rt, "net_read", {"path": str(home_dir / "data" / "api-key")}))["ok"]
        assert (await outcome(rt, "open_read", {"path": str(home_dir / "data" / "api-key")}))["detail"] == API_KEY
        assert plugin(rt).servers["open"].fence.startswith('NOT sandboxed ("sandbox": "off"')
    finally:
        listener.close()


def mcp_server_time() -> str:
    """The third-party `mcp-server-time` (PyPI; a dev dependency), beside this interpreter, on the PATH or at
    AGENT_TEST_MCP_SERVER_TIME."""
    beside = Path(sys.executable).parent / "mcp-server-time"
    found = os.environ.get("AGENT_TEST_MCP_SERVER_TIME") or (str(beside) if beside.exists() else None) \
        or shutil.which("mcp-server-time")
    assert found, "mcp-server-time is not installed: `make test` installs it (pyproject.toml's dev extra)"
    return found


async def test_a_real_third_party_server_works_in_the_sandbox(fenced_rt):
    await bwrap_or_skip()
    rt = await fenced_rt({"time": {"command": mcp_server_time(), "args": ["--local-timezone", "UTC"]}})
    conn = plugin(rt).servers["time"]
    assert conn.status == "connected" and conn.fence and conn.fence.startswith("sandboxed")
    now = json.loads(await execute(rt, "c1", "time_get_current_time", {"timezone": "Asia/Tokyo"}))
    assert now["timezone"] == "Asia/Tokyo" and now["datetime"].endswith("+09:00")


async def test_a_bubblewrap_that_cannot_make_a_sandbox_here_is_reported_and_not_used(fenced_rt, tmp_path, monkeypatch,
                                                                                      caplog):
    caplog.set_level(logging.INFO)
    broken = tmp_path / "bwrap"
    broken.write_text("#!/bin/sh\necho 'bwrap: setting up uid map: Permission denied' >&2\nexit 1\n")
    broken.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.path.dirname(sys.executable)}")
    rt = await fenced_rt({"h": hostile()})
    assert f"NOT sandboxed: {broken} cannot create a sandbox here (bwrap: setting up uid map: Permission denied)" \
        in caplog.text and "user namespaces may be switched off" in caplog.text
    conn = plugin(rt).servers["h"]
    assert conn.status == "connected" and conn.fence and conn.fence.startswith(f"NOT sandboxed ({broken} cannot")
    assert json.loads(await execute(rt, "c1", "h_limits", {}))["data"] == 1024 << 20


def test_a_config_dir_that_is_the_checkout_keeps_its_code_visible_and_hides_its_agent_files(tmp_path):
    spec = McpServersFile.model_validate({"servers": {"s": {"command": "x"}}}).servers["s"]
    launch = fenced("s", spec, "/usr/bin/true", [], [], Host(ROOT, tmp_path / "data", "/usr/bin/bwrap"))
    pairs = list(itertools.pairwise(launch.args))
    assert ("--tmpfs", str(ROOT)) not in pairs and ("--tmpfs", str((tmp_path / "data").resolve())) in pairs
    assert ("/dev/null", str(ROOT / "plugin-manifest.json")) in pairs
    assert ("/dev/null", str(ROOT / "agent-mcp.py")) not in pairs
