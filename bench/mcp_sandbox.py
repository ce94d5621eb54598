#!/usr/bin/env python3
"""The cost of fencing a stdio MCP server: start-up time (spawn, handshake, tools listed) bare, with limits and
its declared environment only (`"sandbox": "off"`), and inside the bubblewrap sandbox.

    python bench/mcp_sandbox.py [--runs 15] [--command PATH [ARG]...]

It also times the fence alone: starting `/bin/true` bare, through the launcher, and in the sandbox.

"bare" is the MCP SDK's own `stdio_client` on the plain command (what agent-mcp did before the fence);
the other two go through agent-mcp's `Connection`. The three alternate within each run, so a slow minute
costs them alike. The default server is the suite's test server (`python -m tests.fakes.mcp_server stdio`);
`--command` times another, e.g. an installed `mcp-server-time`.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mcp import Client, StdioServerParameters, stdio_client  # noqa: E402

from plugins._mcp_connection import Connection  # noqa: E402
from plugins._mcp_fence import Host, find_sandbox  # noqa: E402
from plugins._mcp_servers import McpServersFile  # noqa: E402


async def bare(command: str, args: list[str], cwd: Path) -> tuple[float, int]:
    start = time.perf_counter()
    async with Client(stdio_client(StdioServerParameters(command=command, args=args, cwd=cwd))) as client:
        tools = (await client.list_tools()).tools
        took = time.perf_counter() - start
    return took, len(tools)


async def fenced(command: str, args: list[str], cwd: Path, host: Host, sandbox: str) -> tuple[float, int]:
    entry = {"command": command, "args": args, "cwd": str(cwd), "sandbox": sandbox}
    spec = McpServersFile.model_validate({"servers": {"bench": entry}}).servers["bench"]
    conn = Connection("bench", spec, {}, host.config_dir, lambda c: None, sandbox=host)
    start = time.perf_counter()
    ok = await conn.connect()
    took = time.perf_counter() - start
    tools = len(conn.tools)
    await conn.close()
    if not ok:
        raise SystemExit(f"{sandbox}: {conn.error}")
    return took, tools


def spawn_floor(host: Host, runs: int) -> dict[str, list[float]]:
    """Wall time of starting and reaping `/bin/true` bare, through the launcher, and through the sandbox."""
    import subprocess

    from plugins._mcp_fence import fenced

    true = shutil.which("true") or "/bin/true"
    lines: dict[str, list[str]] = {"bare": [true]}
    for mode in ("off", "auto"):
        entry = {"command": true, "sandbox": mode}
        spec = McpServersFile.model_validate({"servers": {"floor": entry}}).servers["floor"]
        launch = fenced("floor", spec, true, [], [], host)
        lines["limits + env only" if mode == "off" else "sandboxed (bwrap)"] = [launch.command, *launch.args]
    times: dict[str, list[float]] = {m: [] for m in lines}
    for i in range(runs):
        for name in (list(lines) if i % 2 == 0 else list(reversed(lines))):
            start = time.perf_counter()
            subprocess.run(lines[name], check=True, stdin=subprocess.DEVNULL)
            times[name].append(time.perf_counter() - start)
    return times


def report(title: str, times: dict[str, list[float]]) -> None:
    print(title)
    base = statistics.median(next(iter(times.values())))
    print(f"  {'mode':<24} {'median ms':>10} {'min ms':>8} {'max ms':>8} {'vs first':>9}")
    for name, values in times.items():
        med = statistics.median(values)
        print(f"  {name:<24} {med * 1e3:>10.1f} {min(values) * 1e3:>8.1f} {max(values) * 1e3:>8.1f} "
              f"{(med - base) * 1e3:>+8.1f}")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--command", nargs=argparse.REMAINDER, default=None)
    opts = parser.parse_args()
    command, *args = opts.command or [sys.executable, "-m", "tests.fakes.mcp_server", "stdio"]
    bwrap, why, flags = await find_sandbox(None)
    if bwrap is None:
        raise SystemExit(f"no sandbox to measure: {why}")
    with tempfile.TemporaryDirectory(dir=Path.home(), prefix=".mcp-sandbox-bench-") as tmp:
        config = Path(tmp)
        host = Host(config, config / "data", bwrap, bwrap_flags=flags)
        modes = {
            "bare (SDK, no fence)": lambda: bare(command, args, ROOT),
            "limits + env only": lambda: fenced(command, args, ROOT, host, "off"),
            "sandboxed (bwrap)": lambda: fenced(command, args, ROOT, host, "auto"),
        }
        times: dict[str, list[float]] = {m: [] for m in modes}
        for run in modes.values():  # warm the page cache once
            await run()
        for i in range(opts.runs):
            order = list(modes) if i % 2 == 0 else list(reversed(modes))
            for name in order:
                took, _ = await modes[name]()
                times[name].append(took)
        floor = spawn_floor(host, opts.runs * 4)
    report(f"server start to tools listed: {' '.join([command, *args])}; {opts.runs} runs each, alternating", times)
    report(f"the fence alone: spawn and reap /bin/true, {opts.runs * 4} runs each, alternating; bwrap {bwrap}", floor)


if __name__ == "__main__":
    asyncio.run(main())
