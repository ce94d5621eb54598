#!/usr/bin/env python3
"""The JSON/SSE API and agent_call: time per turn and per hop, and how fast a gate policy answers.

Two agent-mcp subprocesses A and B, each against its own instant fake OpenAI backend (32 tokens
per answer), all on 127.0.0.1. Paths, interleaved round by round:

  wait        one `POST /api/v1/submit {"wait": true}` per turn (keep-alive connection)
  AgentClient `AgentClient.send()`: submit, then the turn's own SSE stream (new connection per turn)
  tool turn   A's model calls llm_list, then answers (AgentClient.send on A)
  agent_call  A's model calls agent_call to B, B answers, then A answers (AgentClient.send on A)

"agent_call − tool turn" is the cost of one hop (B's whole turn plus the HTTP between them). The
gate figure is the time from the client receiving a `gate` event to receiving the `allowed once`
status, with an approving AgentClient policy (the window it must beat is API_GATE_TIMEOUT, 2 s).

    python bench/api_overhead.py [--turns 100] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from api_client import AgentClient  # noqa: E402
from tests.conftest import AgentServer, ConfigDir, free_port, openai_model  # noqa: E402
from tests.fakes.backend import tokens, tool_call  # noqa: E402
from tests.fakes.openai_backend import FakeOpenAI  # noqa: E402


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def start(tmp: Path, name: str, backend: FakeOpenAI, port: int, **extra: object) -> AgentServer:
    cfg = ConfigDir(tmp / name)
    cfg.path.mkdir()
    cfg.models = {"fake": openai_model(backend, max_context=4)}
    cfg.plugins.append("plugin_client_api")
    cfg.plugin_config["plugin_client_api"] = {"port": port}
    for key, value in extra.items():
        setattr(cfg, key, value)
    return AgentServer(cfg.write(), {"SESSION_STORE": "memory"}).start()


async def run(args: argparse.Namespace) -> None:
    n_tok = args.tokens
    with FakeOpenAI(default_reply=lambda req: tokens(n_tok)) as fake_a, \
            FakeOpenAI(default_reply=lambda req: tokens(n_tok)) as fake_b, tempfile.TemporaryDirectory() as tmp:
        port_a, port_b = free_port(), free_port()
        url_a, url_b = f"http://127.0.0.1:{port_a}", f"http://127.0.0.1:{port_b}"
        # Every tool runs unasked on A except get_system_info, the gated tool of the gate path.
        open_gates = {"db": {}, "tools": {"*": {"read": True, "write": True},
                                          "get_system_info": {"read": False, "write": False}}}
        servers = [start(Path(tmp), "b", fake_b, port_b)]
        # A reaches B with the key B generated (every API has a key).
        servers.append(start(Path(tmp), "a", fake_a, port_a, agents={"b": {"url": url_b, "token_env": "AGENT_B_KEY"}},
                             gates=open_gates, env={"AGENT_B_KEY": servers[0].api_key}))
        try:
            key = servers[1].api_key  # the key server A generated into its data dir
            client = AgentClient(url_a, "api-bench", api_key=key)
            gated = AgentClient(url_a, "api-bench-gate", api_key=key, auto_approve_gates=True)
            http = httpx.AsyncClient(base_url=url_a, timeout=30, headers={"Authorization": f"Bearer {key}"})

            async def wait_turn(i: int) -> None:
                r = await http.post("/api/v1/submit", json={"client_id": "api-bench-wait", "text": f"q{i}",
                                                            "wait": True})
                assert r.json()["status"] == "complete"

            async def send_turn(i: int) -> None:
                await client.send(f"q{i}")

            async def tool_turn(i: int) -> None:
                fake_a.script(tool_call("llm_list", {}), tokens(n_tok))
                await client.send(f"q{i}")

            async def hop_turn(i: int) -> None:
                fake_a.script(tool_call("agent_call", {"agent_url": "b", "message": f"q{i}"}), tokens(n_tok))
                await client.send(f"q{i}")

            gate_gaps: list[float] = []

            async def gate_turn(i: int) -> None:
                fake_a.script(tool_call("get_system_info", {}), tokens(n_tok))
                seen = None
                async for ev in gated.events(f"q{i}"):
                    if ev.name == "gate":
                        seen = time.perf_counter()
                    elif ev.name == "status" and "allowed once" in ev.text and seen is not None:
                        gate_gaps.append(time.perf_counter() - seen)

            paths = {"wait": wait_turn, "AgentClient": send_turn, "tool turn": tool_turn, "agent_call": hop_turn,
                     "gate": gate_turn}
            times: dict[str, list[float]] = {name: [] for name in paths}
            for i in range(args.warmup):
                for fn in paths.values():
                    await fn(i)
            gate_gaps.clear()
            per_round = max(1, args.turns // args.rounds)
            for r in range(args.rounds):
                for name, fn in paths.items():
                    for i in range(per_round):
                        begin = time.perf_counter()
                        await fn(r * per_round + i)
                        times[name].append(time.perf_counter() - begin)
            await http.aclose()
        finally:
            for server in servers:
                server.stop()
    print(f"\n{len(times['wait'])} turns per path, {args.rounds} interleaved rounds, {n_tok} tokens per answer\n")
    print("| path | p50 (ms) | p95 (ms) |")
    print("|---|---|---|")
    for name, values in times.items():
        print(f"| {name} | {statistics.median(values) * 1e3:.2f} | {pct(values, 0.95) * 1e3:.2f} |")
    hop = statistics.median(times["agent_call"]) - statistics.median(times["tool turn"])
    print(f"\none agent_call hop (agent_call − tool turn, p50): {hop * 1e3:.2f} ms")
    print(f"gate event → allowed (policy answer), p50 {statistics.median(gate_gaps) * 1e3:.2f} ms, "
          f"p95 {pct(gate_gaps, 0.95) * 1e3:.2f} ms, max {max(gate_gaps) * 1e3:.2f} ms ({len(gate_gaps)} gates)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--turns", type=int, default=100)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--warmup", type=int, default=5)
    asyncio.run(run(p.parse_args()))


if __name__ == "__main__":
    main()
