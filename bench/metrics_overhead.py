#!/usr/bin/env python3
"""What the Prometheus metrics cost: server CPU per turn and per token with metrics on vs off, same run.

Two agent-mcp servers run side by side against one instant fake OpenAI backend: one with the default
config (metrics off: `metrics.OFF`, no listener), one with `plugin_client_metrics` enabled and scraped
once a second (15 times as often as deploy/prometheus.yml), its scrapes' CPU included. Turns go
through the shell.py endpoint as in bench/turn_overhead.py, in interleaved rounds (off, on, on, off, …),
each server's CPU time read from /proc around its own rounds. Two answer lengths (short and long) give
the cost per turn and, from their difference, per token; a third mix has a tool call in every turn
(tools, gates and two model calls counted). `--calibrate` runs both servers without metrics: the
difference it shows is the noise of the measurement on this machine. With two or more cores both
servers are pinned to core 1 and the client, fake and scraper to core 0.

    python bench/metrics_overhead.py [--turns 400] [--rounds 20]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import timeit
from collections.abc import Callable
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import metrics  # noqa: E402
from bench.turn_overhead import ServerPath, cpu_seconds  # noqa: E402
from tests.conftest import AgentServer, ConfigDir, free_port, openai_model  # noqa: E402
from tests.fakes.backend import RecordedRequest, Reply, text, tokens, tool_call  # noqa: E402
from tests.fakes.openai_backend import FakeOpenAI  # noqa: E402

TOOL_ROUND = "call get_system_info"


def reply_for(count: int) -> Callable[[RecordedRequest], Reply]:
    """The fake's answer: `count` tokens; a turn asking for a tool gets a get_system_info call first."""

    def reply(request: RecordedRequest) -> Reply:
        messages = (request.json or {}).get("messages") or []
        last = messages[-1] if messages else {}
        if TOOL_ROUND in str(last.get("content")) and last.get("role") == "user":
            return tool_call("get_system_info", {})
        if last.get("role") == "tool":
            return text("It is up.")
        return tokens(count)

    return reply


async def scrape_forever(url: str) -> None:
    async with httpx.AsyncClient(timeout=5) as http:
        while True:
            (await http.get(url)).raise_for_status()
            await asyncio.sleep(1.0)


async def measure(args: argparse.Namespace, count: int, ask: str) -> dict[str, float]:
    """CPU ms per turn of the server without and with metrics, `count`-token answers, questions `ask`."""
    pinned = (os.cpu_count() or 1) >= 2
    with FakeOpenAI(default_reply=reply_for(count)) as backend, tempfile.TemporaryDirectory() as tmp:
        servers: dict[str, AgentServer] = {}
        scrape_url = ""
        for name in ("off", "on"):
            (Path(tmp) / name).mkdir()
            cfg = ConfigDir(Path(tmp) / name)
            cfg.models = {"fake": openai_model(backend, max_context=2)}
            cfg.gates = {"db": {}, "tools": {"get_system_info": {"read": True}}}
            cfg.env = {"SESSION_STORE": "sqlite"}
            if name == "on" and not args.calibrate:
                port = free_port()
                cfg.plugins.append("plugin_client_metrics")
                cfg.plugin_config["plugin_client_metrics"] = {"port": port}
                scrape_url = f"http://127.0.0.1:{port}/metrics"
            servers[name] = AgentServer(cfg.write()).start()
            assert servers[name].proc is not None
            if pinned:
                os.sched_setaffinity(servers[name].proc.pid, {1})
        paths = {name: ServerPath(s.url, s.token) for name, s in servers.items()}
        for path in paths.values():
            await path.open()
        for i in range(args.warmup):
            for path in paths.values():
                await path.turn(i)
        scraper = asyncio.create_task(scrape_forever(scrape_url) if scrape_url and args.scrape else asyncio.sleep(0))
        cpu = {"off": 0.0, "on": 0.0}
        turns = {"off": 0, "on": 0}
        per_round = max(1, args.turns // args.rounds)
        for r in range(args.rounds):
            for name in (("off", "on") if r % 2 == 0 else ("on", "off")):
                pid = servers[name].proc.pid  # type: ignore[union-attr]  # started: proc is set
                before = cpu_seconds(pid)
                for i in range(per_round):
                    path = paths[name]
                    path.client_id = "bench"
                    await path.http.post(f"{path.url}/submit", json={"client_id": "bench", "text": f"{ask} {i}"})
                    while await path.lines.get() != "done":
                        pass
                cpu[name] += cpu_seconds(pid) - before
                turns[name] += per_round
        scraper.cancel()
        for path in paths.values():
            await path.close()
        for s in servers.values():
            s.stop()
    return {name: cpu[name] / turns[name] * 1e3 for name in cpu} | {"turns": turns["on"]}


def instrumentation_us() -> dict[str, float]:
    """µs of the metric calls of one turn, in process (no server, no noise): a plain turn (one model call),
    and a turn with a tool call (two model calls, a gate allowed by policy, the tool call)."""
    m = metrics.Metrics("bench", models=["fake"])

    def plain() -> None:
        with m.turn("shell", "fake"), m.model_call(str) as call:
            m.first_answer_token()
            call.done({"input_tokens": 120, "output_tokens": 32})

    def with_tool() -> None:
        with m.turn("shell", "fake"):
            with m.model_call(str) as call:
                call.done({"input_tokens": 120, "output_tokens": 5})
            m.gate_allowed("policy")
            m.tool_call("get_system_info", "ok", None, 0.001)
            with m.model_call(str) as call:
                m.first_answer_token()
                call.done({"input_tokens": 160, "output_tokens": 32})

    n = 20000
    return {"plain": min(timeit.repeat(plain, number=n, repeat=5)) / n * 1e6,
            "tool": min(timeit.repeat(with_tool, number=n, repeat=5)) / n * 1e6,
            "off": min(timeit.repeat(lambda: metrics.OFF.tool_call("x", "ok", None, 0.1), number=n, repeat=5))
            / n * 1e6}


async def run(args: argparse.Namespace) -> None:
    if (os.cpu_count() or 1) >= 2:
        os.sched_setaffinity(0, {0})
    if args.calibrate:  # both servers without metrics: the difference is this machine's noise
        same = await measure(args, args.short, "question")
        print(f"calibration, both servers without metrics, {same['turns']:.0f} turns each: {same['off']:.3f} vs "
              f"{same['on']:.3f} ms CPU per turn ({(same['on'] - same['off']) / same['off'] * 100:+.1f}%)")
        print(json.dumps({"calibrate": same}))
        return
    short = await measure(args, args.short, "question")
    if args.short_only:
        print(f"{short['turns']:.0f} turns each, scraped {'every second' if args.scrape else 'never'}: metrics off "
              f"{short['off']:.3f}, on {short['on']:.3f} ms CPU per turn "
              f"({(short['on'] - short['off']) / short['off'] * 100:+.1f}%)")
        print(json.dumps({"short": short, "scrape": args.scrape}))
        return
    long = await measure(args, args.long, "question")
    tool = await measure(args, args.short, TOOL_ROUND)
    print(f"\n{short['turns']:.0f} turns per server and mix, {args.rounds} interleaved rounds, metrics scraped every "
          "second\n")
    print("| turn | CPU per turn, metrics off (ms) | metrics on (ms) | difference |")
    print("|---|---|---|---|")
    for label, found in ((f"{args.short}-token answer", short), (f"{args.long}-token answer", long),
                         (f"tool call + {args.short}-token answer", tool)):
        print(f"| {label} | {found['off']:.3f} | {found['on']:.3f} | "
              f"{(found['on'] - found['off']) / found['off'] * 100:+.1f}% |")
    tokens_between = args.long - args.short
    per_token = {name: (long[name] - short[name]) / tokens_between * 1e3 for name in ("off", "on")}
    print(f"\nper token (from the difference of the two lengths): off {per_token['off']:.1f} µs, "
          f"on {per_token['on']:.1f} µs")
    calls = instrumentation_us()
    print(f"metric calls of one turn, in process: {calls['plain']:.1f} µs (plain), {calls['tool']:.1f} µs (with a "
          f"tool call); a call on metrics.OFF: {calls['off']:.2f} µs")
    print(json.dumps({"short": short, "long": long, "tool": tool, "per_token_us": per_token, "calls_us": calls}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--turns", type=int, default=400)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--short", type=int, default=32)
    p.add_argument("--long", type=int, default=512)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--no-scrape", dest="scrape", action="store_false", help="nobody reads /metrics")
    p.add_argument("--short-only", action="store_true", help="only the short answers")
    p.add_argument("--calibrate", action="store_true", help="both servers without metrics (the noise floor)")
    asyncio.run(run(p.parse_args()))


if __name__ == "__main__":
    main()
