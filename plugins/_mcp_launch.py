"""Starts one stdio MCP server with its resource limits and only its declared environment (run by agent-mcp).

    python -I -S _mcp_launch.py [--limit NAME=N]... [--keep VAR]... [--set VAR=VALUE]... -- COMMAND [ARG]...

The limits are set in a child just before it runs COMMAND, so this process (which waits for it) is not
limited; it tells agent-mcp (on stderr) when a signal ended the server, a limit's signal with the limit's
name. Standard library only: it runs with `-I -S`, inside the sandbox too.
"""

from __future__ import annotations

import os
import resource
import signal
import sys

#: Limit names (as in mcp-servers.json) → (resource, unit in bytes or 1).
LIMITS = {
    "memory_mb": (resource.RLIMIT_DATA, 1 << 20),
    "cpu_seconds": (resource.RLIMIT_CPU, 1),
    "processes": (resource.RLIMIT_NPROC, 1),
    "open_files": (resource.RLIMIT_NOFILE, 1),
    "file_size_mb": (resource.RLIMIT_FSIZE, 1 << 20),
}
#: Grace between SIGXCPU (soft limit) and SIGKILL (hard limit).
CPU_GRACE_SECONDS = 2
PREFIX = "agent-mcp fence:"


def _parse(argv: list[str]) -> tuple[dict[str, int], list[str], dict[str, str], list[str]]:
    limits: dict[str, int] = {}
    keep: list[str] = []
    sets: dict[str, str] = {}
    i = 0
    while i < len(argv) and argv[i] != "--":
        flag, value = argv[i], argv[i + 1]
        if flag == "--limit":
            name, _, n = value.partition("=")
            limits[name] = int(n)
        elif flag == "--keep":
            keep.append(value)
        elif flag == "--set":
            name, _, v = value.partition("=")
            sets[name] = v
        else:
            raise SystemExit(f"{PREFIX} unknown option {flag}")
        i += 2
    return limits, keep, sets, argv[i + 1:]


def _limit(name: str, n: int) -> None:
    res, unit = LIMITS[name]
    soft = n * unit
    hard = soft + CPU_GRACE_SECONDS if res == resource.RLIMIT_CPU else soft
    resource.setrlimit(res, (soft, hard))


def _why(sig: int, limits: dict[str, int]) -> str:
    name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else f"signal {sig}"
    if sig == signal.SIGXCPU:
        return f"{name}: it used up its CPU time (limits.cpu_seconds = {limits.get('cpu_seconds')})"
    if sig == signal.SIGXFSZ:
        return f"{name}: it wrote a file larger than limits.file_size_mb = {limits.get('file_size_mb')}"
    if sig == signal.SIGKILL:
        return (f"{name}: past its CPU time (limits.cpu_seconds = {limits.get('cpu_seconds')}) or by the kernel's "
                "out-of-memory killer")
    if sig in (signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS):
        return f"{name}: it crashed (a failed allocation under limits.memory_mb = {limits.get('memory_mb')} can)"
    return name


def main(argv: list[str]) -> int:
    limits, keep, sets, command = _parse(argv)
    env = {k: os.environ[k] for k in keep if k in os.environ} | sets
    pid = os.fork()
    if pid == 0:
        try:
            for name, n in limits.items():
                _limit(name, n)
            os.execve(command[0], command, env)
        except OSError as exc:
            os.write(2, f"{PREFIX} cannot start {command[0]}: {exc.strerror}\n".encode())
        os._exit(127)
    # The server's stdin and stdout end with the server, not with this process.
    os.close(0)
    os.close(1)
    stopping: list[int] = []

    def forward(sig: int, _frame: object) -> None:
        stopping.append(sig)
        os.kill(pid, sig)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            break
        except InterruptedError:
            continue
    if os.WIFSIGNALED(status):
        died = os.WTERMSIG(status)
        if died not in stopping:
            os.write(2, f"{PREFIX} the server was stopped by {_why(died, limits)}\n".encode())
        return 128 + died
    return os.WEXITSTATUS(status)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
