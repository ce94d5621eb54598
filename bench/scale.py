#!/usr/bin/env python3
"""Several instances on one Redis: what the shared store costs, and what a second instance gives.

1. Store overhead, one instance: the same turns through an instance on SQLite (the embedded
   default) and one on Redis (SESSION_STORE=redis://, key prefix of its own), interleaved round by
   round; server CPU per turn and the whole turn (POST /submit → SSE `done`), p50 and p99.
2. Throughput: the same load, `--clients` concurrent shell-endpoint clients (a session each, one
   turn after another), through 1 instance and through 2 instances on one Redis (clients spread
   over them as a round-robin load balancer would); turns per second and p50/p99 per turn.

Everything runs on this machine (the fake backend, the clients, Redis and the servers share its
cores), against an instant fake OpenAI backend (32 tokens per answer). Only 127.0.0.1 is used.

    python bench/scale.py [--turns 300] [--clients 8] [--per-client 40]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.turn_overhead import ServerPath, cpu_seconds, pct  # noqa: E402
from tests.conftest import AgentServer, ConfigDir, openai_model  # noqa: E402
from tests.fakes.backend import tokens  # noqa: E402
from tests.fakes.openai_backend import FakeOpenAI  # noqa: E402

REDIS = "redis://127.0.0.1:6379/0"
TOKEN = "bench-scale-token-0123456789abcdef"


class Client(ServerPath):
    """One session on one instance (a long-lived SSE stream); `turn` gives the whole turn's time."""

    async def open(self) -> Client:
        await super().open()
        return self

    async def turn(self, i: int) -> float:  # type: ignore[override]  # this path times the whole turn only
        return (await super().turn(i))[1]


def server(tmp: Path, name: str, backend: FakeOpenAI, store: str) -> AgentServer:
    path = tmp / name
    path.mkdir()
    cfg = ConfigDir(path)
    cfg.models = {"fake": openai_model(backend, max_context=2)}
    return AgentServer(cfg.write(), {"SESSION_STORE": store, "AGENT_SHELL_TOKEN": TOKEN}).start()


def ms(values: list[float], q: float) -> str:
    return f"{pct(values, q) * 1e3:.2f}"


async def store_overhead(tmp: Path, backend: FakeOpenAI, prefix: str, args: argparse.Namespace) -> dict:
    servers = {"sqlite": server(tmp, "sqlite", backend, "sqlite"),
               "redis": server(tmp, "redis", backend, f"{REDIS}?prefix={prefix}")}
    clients = {k: await Client(s.url, TOKEN, f"overhead-{k}").open() for k, s in servers.items()}
    for i in range(20):  # warm-up: connections, imports
        for c in clients.values():
            await c.turn(i)
    times: dict[str, list[float]] = {k: [] for k in servers}
    cpu = dict.fromkeys(servers, 0.0)
    per_round = max(1, args.turns // 10)
    for r in range(10):
        for kind, c in clients.items():
            pid = servers[kind].proc.pid  # type: ignore[union-attr]  # started: proc is set
            before = cpu_seconds(pid)
            for i in range(per_round):
                times[kind].append(await c.turn(r * per_round + i))
            cpu[kind] += cpu_seconds(pid) - before
    for c in clients.values():
        await c.close()
    for s in servers.values():
        s.stop()
    n = len(times["sqlite"])
    print(f"\n1. Store overhead, one instance: {n} turns each, 10 interleaved rounds\n")
    print("| store | server CPU per turn (ms) | turn p50 (ms) | turn p99 (ms) |")
    print("|---|---|---|---|")
    for kind in servers:
        print(f"| {kind} | {cpu[kind] / n * 1e3:.2f} | {ms(times[kind], 0.5)} | {ms(times[kind], 0.99)} |")
    ratio = cpu["redis"] / cpu["sqlite"]
    print(f"\nRedis / SQLite server CPU per turn: {ratio:.2f}× (goal ≤ 1.2×); "
          f"turn p50 {statistics.median(times['redis']) / statistics.median(times['sqlite']):.2f}×")
    return {"cpu_ratio": round(ratio, 3), "sqlite_cpu_ms": round(cpu["sqlite"] / n * 1e3, 3),
            "redis_cpu_ms": round(cpu["redis"] / n * 1e3, 3)}


async def throughput(tmp: Path, backend: FakeOpenAI, prefix: str, count: int, args: argparse.Namespace) -> dict:
    servers = [server(tmp, f"through{count}-{n}", backend, f"{REDIS}?prefix={prefix}") for n in range(count)]
    clients = [await Client(servers[n % count].url, TOKEN, f"load-{count}-{n}").open() for n in range(args.clients)]
    await asyncio.gather(*(c.turn(-1) for c in clients))  # warm-up

    async def run(c: Client) -> list[float]:
        return [await c.turn(i) for i in range(args.per_client)]

    start = time.perf_counter()
    times = [t for ts in await asyncio.gather(*(run(c) for c in clients)) for t in ts]
    elapsed = time.perf_counter() - start
    for c in clients:
        await c.close()
    for s in servers:
        s.stop()
    return {"instances": count, "turns": len(times), "turns_per_s": round(len(times) / elapsed, 1),
            "p50_ms": round(pct(times, 0.5) * 1e3, 2), "p99_ms": round(pct(times, 0.99) * 1e3, 2)}


async def main_async(args: argparse.Namespace) -> None:
    prefix = f"bench-{uuid.uuid4().hex[:8]}:"
    client = redis.Redis.from_url(REDIS)
    try:
        with FakeOpenAI(default_reply=lambda req: tokens(32)) as backend, tempfile.TemporaryDirectory() as tmp:
            overhead = await store_overhead(Path(tmp), backend, prefix, args)
            if args.overhead_only:
                return
            rows = [await throughput(Path(tmp), backend, prefix, n, args) for n in (1, 2)]
    finally:
        keys = list(client.scan_iter(match=prefix + "*", count=1000))
        if keys:
            client.delete(*keys)
        client.close()
    print(f"\n2. Throughput: {args.clients} concurrent clients × {args.per_client} turns, one Redis\n")
    print("| instances | turns/s | turn p50 (ms) | turn p99 (ms) |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['instances']} | {r['turns_per_s']} | {r['p50_ms']} | {r['p99_ms']} |")
    print(f"\n2 instances / 1: {rows[1]['turns_per_s'] / rows[0]['turns_per_s']:.2f}× the turns per second")
    print(json.dumps({"overhead": overhead, "throughput": rows}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--turns", type=int, default=300, help="turns per store in part 1")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--per-client", type=int, default=40)
    p.add_argument("--overhead-only", action="store_true", help="part 1 only")
    asyncio.run(main_async(p.parse_args()))


if __name__ == "__main__":
    main()
