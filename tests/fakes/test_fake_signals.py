"""Every fake with a command line stops on SIGINT and SIGTERM whatever it is doing: idle, serving a stream,
starting, and when it was started with the signals ignored (a background job of a non-interactive shell)."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.waiting import DEADLINE, until_sync

ROOT = Path(__file__).resolve().parents[2]
SIGNALS = [signal.SIGINT, signal.SIGTERM]


def _ignoring(signum: int) -> Callable[[], None]:
    """For `preexec_fn`: the child starts with `signum` ignored, as a shell's background job starts with SIGINT."""
    def ignore() -> None:
        signal.signal(signum, signal.SIG_IGN)
    return ignore


@contextmanager
def _started(argv: list[str], ignored: int | None = None, **popen: object) -> Iterator[subprocess.Popen[str]]:
    process = subprocess.Popen([sys.executable, *argv], cwd=ROOT, text=True, stderr=subprocess.PIPE,
                               preexec_fn=_ignoring(ignored) if ignored else None, **popen)  # type: ignore[call-overload]
    try:
        yield process
    finally:
        process.kill()
        process.communicate()


def _stops(process: subprocess.Popen[str], signum: int) -> int:
    """Send `signum`; the exit status, which must come within the generous deadline (no timing luck needed:
    the caller waited for the fake to be ready, and a prompt exit takes well under a second)."""
    process.send_signal(signum)
    try:
        return process.wait(timeout=DEADLINE)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{process.args!r} did not exit within {DEADLINE:g} s of {signal.Signals(signum).name}")


def _backend_url(process: subprocess.Popen[str]) -> str:
    """Wait for the fake backend's readiness line (printed once it listens and its signals are handled)."""
    assert process.stdout is not None
    banner = process.stdout.readline()
    assert "base URL: " in banner, banner + (process.stderr.read() if process.stderr else "")
    return banner.split("base URL: ")[1].split()[0]


@pytest.mark.parametrize("ignored", [False, True], ids=["default", "inherited-ignored"])
@pytest.mark.parametrize("signum", SIGNALS, ids=lambda s: s.name)
@pytest.mark.parametrize("module", ["tests.fakes.openai_backend", "tests.fakes.gemini_backend"])
def test_the_fake_backend_stops_when_idle(module, signum, ignored) -> None:
    with _started(["-m", module, "--port", "0"], signum if ignored else None, stdout=subprocess.PIPE) as process:
        _backend_url(process)
        assert _stops(process, signum) == 0


@pytest.mark.parametrize("signum", SIGNALS, ids=lambda s: s.name)
def test_the_fake_backend_stops_while_it_streams(signum) -> None:
    with _started(["-m", "tests.fakes.openai_backend", "--port", "0"], signum, stdout=subprocess.PIPE) as process:
        url = _backend_url(process)
        # 0.3 s a word: 300 s, far beyond the deadline, so an exit within it did not wait for the stream's end
        body = {"stream": True, "messages": [{"role": "user", "content": "SLOW " + " ".join(["word"] * 1000)}]}
        with httpx.Client(timeout=DEADLINE) as http, http.stream("POST", url + "/chat/completions", json=body) as reply:
            lines = reply.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))  # the stream is being served
            assert _stops(process, signum) == 0


@pytest.mark.parametrize("signum", SIGNALS, ids=lambda s: s.name)
def test_the_fake_backend_stops_while_it_starts(signum) -> None:
    """A signal before the handlers exist meets Python's defaults (KeyboardInterrupt, or death by SIGTERM):
    either way the process ends."""
    with _started(["-m", "tests.fakes.openai_backend", "--port", "0"], stdout=subprocess.PIPE) as process:
        assert _stops(process, signum) in (0, 1, -signum)


_INITIALIZE = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
    "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}}


@pytest.mark.parametrize("ignored", [False, True], ids=["default", "inherited-ignored"])
@pytest.mark.parametrize("signum", SIGNALS, ids=lambda s: s.name)
@pytest.mark.parametrize("argv", [["-m", "tests.fakes.mcp_server", "stdio"], ["-m", "tests.fakes.mcp_hostile"],
                                  [str(ROOT / "tests" / "fakes" / "mcp_hostile.py")]], ids=["mcp_server", "mcp_hostile",
                                                                                             "mcp_hostile-file"])
def test_a_stdio_mcp_fake_stops_while_its_input_is_open(argv, signum, ignored) -> None:
    """Its reader thread is blocked on stdin, which the client still holds open."""
    with _started(argv, signum if ignored else None, stdin=subprocess.PIPE, stdout=subprocess.PIPE) as process:
        assert process.stdin is not None and process.stdout is not None
        process.stdin.write(json.dumps(_INITIALIZE) + "\n")
        process.stdin.flush()
        assert json.loads(process.stdout.readline())["result"]["serverInfo"]  # ready: it answered
        assert _stops(process, signum) == 0


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


@pytest.mark.parametrize("ignored", [False, True], ids=["default", "inherited-ignored"])
@pytest.mark.parametrize("signum", SIGNALS, ids=lambda s: s.name)
def test_the_http_mcp_fake_stops(signum, ignored) -> None:
    port = _free_port()
    argv = ["-m", "tests.fakes.mcp_server", "http", "--port", str(port)]
    with _started(argv, signum if ignored else None) as process:
        until_sync(lambda: process.poll() is None and _accepts(port), "the MCP fake to listen")
        assert _stops(process, signum) == 0
