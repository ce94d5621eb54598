#!/usr/bin/env python3
"""The MCP server's approvals: how soon MCP clients hear of a gate, and the approval round trip.

One agent-mcp subprocess (shell endpoint + plugin_client_mcp, an instant fake OpenAI backend, a
gated test tool), all on 127.0.0.1. Each turn is a shell.py turn (ShellClient) whose model calls
the gated tool. Two paths, interleaved round by round:

  mcp    a human token answers over MCP: a 2025-11-25 client subscribed to
         agentmcp://approvals/pending gets notifications/resources/updated, reads the resource and
         calls answer_approval; a 2026-07-28 client listens on the same URI (subscriptions/listen)
  shell  the baseline: the shell client answers the gate event itself (POST /gate_response)

Figures: time from submit to the gate reaching the shell's SSE stream (baseline) and to each MCP
notification; and the round trip from the answerer seeing the gate to the shell seeing "allowed".

    python bench/mcp_approvals.py [--turns 100] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import httpx2
import mcp_types as types
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPDeprecationWarning

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from shell_client import ShellClient  # noqa: E402
from tests.conftest import AgentServer, ConfigDir, free_port, openai_model  # noqa: E402
from tests.fakes.backend import text, tool_call  # noqa: E402
from tests.fakes.openai_backend import FakeOpenAI  # noqa: E402
from tests.test_gate_e2e import DB_PLUGIN  # noqa: E402

TOKEN = "bench-human-token-000000001"
PENDING = "agentmcp://approvals/pending"


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def start(tmp: Path, backend: FakeOpenAI, mcp_port: int) -> AgentServer:
    cfg = ConfigDir(tmp)
    cfg.models = {"fake": openai_model(backend, max_context=4)}
    cfg.add_plugin("plugin_test_db", DB_PLUGIN)
    cfg.plugins.append("plugin_client_mcp")
    cfg.plugin_config["plugin_client_mcp"] = {"port": mcp_port}
    cfg.gates = {"db": {}, "tools": {}}
    (tmp / "mcp-tokens.json").write_text(json.dumps({"tokens": {"bench": {"role": "human", "token": TOKEN}}}))
    (tmp / "mcp-tokens.json").chmod(0o600)  # it holds tokens: agent-mcp refuses it readable by others
    return AgentServer(cfg.write(), {"SESSION_STORE": "memory"}).start()


async def run(args: argparse.Namespace) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {k: [] for k in (
        "shell: submit → gate on SSE", "mcp: submit → resources/updated (2025)",
        "mcp: submit → listen event (2026)", "shell: gate → allowed (POST /gate_response)",
        "mcp: notified → allowed (read + answer_approval)")}
    with FakeOpenAI() as backend, tempfile.TemporaryDirectory() as tmp:
        mcp_port = free_port()
        server = start(Path(tmp), backend, mcp_port)
        url = f"http://127.0.0.1:{mcp_port}/mcp"
        notes: asyncio.Queue[float] = asyncio.Queue()

        async def on_message(message: Any) -> None:
            if isinstance(message, types.ResourceUpdatedNotification) and message.params.uri == PENDING:
                notes.put_nowait(time.perf_counter())

        try:
            http = httpx2.AsyncClient(
                headers={"Authorization": f"Bearer {TOKEN}"}, timeout=httpx2.Timeout(30, read=300)
            )
            async with http, Client(streamable_http_client(url, http_client=http), mode="legacy",
                                    message_handler=on_message, cache=None) as legacy, \
                    Client(streamable_http_client(url, http_client=http), cache=None) as modern, \
                    ShellClient(server.url, "shell-bench", token=server.token) as shell:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", MCPDeprecationWarning)
                    await legacy.subscribe_resource(PENDING)
                await shell.connect(max_wait=10)
                async with modern.listen(resource_subscriptions=[PENDING]) as listener:
                    heard: asyncio.Queue[float] = asyncio.Queue()

                    async def pump() -> None:
                        async for _ in listener:
                            heard.put_nowait(time.perf_counter())

                    pump_task = asyncio.create_task(pump())

                    async def turn(via_mcp: bool, record: bool) -> None:
                        backend.script(tool_call("db_query", {"sql": "SELECT 1 FROM t"}), text("ok"))
                        begin = time.perf_counter()
                        await shell.submit("go")
                        gate_at = allowed_at = seen_at = 0.0
                        async for ev in shell.events():
                            if ev.name == "gate":
                                gate_at = time.perf_counter()
                                if not via_mcp:
                                    seen_at = gate_at
                                    await shell.gate_response(ev.data["gate_id"], "allow")
                                else:
                                    seen_at = await notes.get()
                                    rows = json.loads((await legacy.read_resource(PENDING)).contents[0].text)
                                    await legacy.call_tool("answer_approval", {"gate_id": rows[0]["gate_id"],
                                                                               "decision": "allow_once"})
                            elif ev.name == "status" and "allowed once" in ev.text:
                                allowed_at = time.perf_counter()
                            elif ev.name == "done":
                                break
                        # Every gate notifies twice (opened, then decided): drain both from each queue.
                        opened_2025 = seen_at if via_mcp else await notes.get()
                        await notes.get()
                        opened_2026 = await heard.get()
                        await heard.get()
                        if not record:
                            return
                        if via_mcp:
                            times["mcp: notified → allowed (read + answer_approval)"].append(allowed_at - seen_at)
                        else:
                            times["shell: gate → allowed (POST /gate_response)"].append(allowed_at - gate_at)
                        times["shell: submit → gate on SSE"].append(gate_at - begin)
                        times["mcp: submit → resources/updated (2025)"].append(opened_2025 - begin)
                        times["mcp: submit → listen event (2026)"].append(opened_2026 - begin)

                    for _ in range(args.warmup):
                        await turn(True, False)
                        await turn(False, False)
                    per_round = max(1, args.turns // args.rounds)
                    for _ in range(args.rounds):
                        for via_mcp in (True, False):
                            for _ in range(per_round):
                                await turn(via_mcp, True)
                    pump_task.cancel()
        finally:
            server.stop()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, default=100, help="turns per path")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    times = asyncio.run(run(args))
    print(f"\n{args.turns} gated turns per path, {args.rounds} interleaved rounds\n")
    print("| measure | n | p50 (ms) | p95 (ms) | max (ms) |")
    print("|---|---|---|---|---|")
    for name, values in times.items():
        print(f"| {name} | {len(values)} | {statistics.median(values) * 1e3:.2f} | {pct(values, 0.95) * 1e3:.2f} | "
              f"{max(values) * 1e3:.2f} |")


if __name__ == "__main__":
    main()
