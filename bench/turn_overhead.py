#!/usr/bin/env python3
"""Added time per turn through the shell.py endpoint, against the same fake backend called directly.

Both paths run in the same process run, interleaved round by round, against one instant fake
OpenAI backend (32 tokens per answer):

  direct: `ChatOpenAI.astream`, set up as the server sets it up (chat_openai.openai_chat_model, no
          per-chunk clock of LangChain's) → fake backend
  server: POST /submit → agent-mcp (subprocess) → ChatOpenAI.astream → fake → SSE `tok` … `done`

It reports median and p95 of time to first token and of the whole turn (submit → done) for both,
the added time (server − direct) and the ratio, plus the server's CPU time per turn. Only
127.0.0.1 is used. When the machine has two or more cores, the server is pinned to core 1 and the
client and fake to core 0 so that they do not steal each other's time. Each round also runs as
many turns whose answer is one token: their CPU against the full turns' gives the cost of each
further streamed token apart from the turn's own. With `--baseline DIR`
(another tree of agent-mcp, e.g. `git archive main | tar -x -C DIR`), that tree's server runs too,
interleaved in the same rounds, on the same core: a change's before and after in one run.

    python bench/turn_overhead.py [--turns 200] [--rounds 10] [--tokens 32] [--baseline DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from langchain_core.messages import HumanMessage, SystemMessage

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from chat_openai import openai_chat_model  # noqa: E402
from config import DEFAULTS_DIR  # noqa: E402
from prompt import PromptTree  # noqa: E402
from tests.conftest import AgentServer, ConfigDir, openai_model  # noqa: E402
from tests.fakes.backend import RecordedRequest, TextReply, tokens  # noqa: E402
from tests.fakes.openai_backend import FakeOpenAI  # noqa: E402

#: The question whose answer is one token: the same turn without its stream, for the cost per streamed token.
SHORT = "one word"


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def direct_turn(llm: Any, system: str, i: int) -> tuple[float, float]:
    start = time.perf_counter()
    first = None
    async for chunk in llm.astream([SystemMessage(system), HumanMessage(f"question {i}")]):
        if first is None and chunk.content:
            first = time.perf_counter() - start
    return first or 0.0, time.perf_counter() - start


class ServerPath:
    """One long-lived SSE stream per bench client; each turn is POST /submit then read until `done`."""

    def __init__(self, url: str, token: str, client_id: str = "bench"):
        self.url, self.client_id = url, client_id
        self.http = httpx.AsyncClient(timeout=30, headers={"Authorization": f"Bearer {token}"})
        self.lines: asyncio.Queue[str] = asyncio.Queue()
        self.reader: asyncio.Task[None] | None = None

    async def open(self) -> None:
        ready = asyncio.Event()

        async def pump() -> None:
            async with self.http.stream("GET", f"{self.url}/stream", params={"client_id": self.client_id}) as resp:
                ready.set()
                async for line in resp.aiter_lines():
                    if line.startswith("event:"):
                        self.lines.put_nowait(line[6:].strip())

        self.reader = asyncio.create_task(pump())
        await ready.wait()

    async def turn(self, i: int, text: str = "question") -> tuple[float, float]:
        start = time.perf_counter()
        first = None
        resp = await self.http.post(f"{self.url}/submit", json={"client_id": self.client_id, "text": f"{text} {i}"})
        resp.raise_for_status()
        while True:
            event = await self.lines.get()
            if event == "tok" and first is None:
                first = time.perf_counter() - start
            elif event == "done":
                return first or 0.0, time.perf_counter() - start

    async def close(self) -> None:
        if self.reader:
            self.reader.cancel()
        await self.http.aclose()


def row(name: str, direct: list[float], server: list[float]) -> str:
    d50, s50, d95, s95 = (statistics.median(direct), statistics.median(server), pct(direct, 0.95), pct(server, 0.95))
    return (f"| {name} | {d50 * 1e3:.2f} | {s50 * 1e3:.2f} | **+{(s50 - d50) * 1e3:.2f}** | {s50 / d50:.2f}× "
            f"| {d95 * 1e3:.2f} | {s95 * 1e3:.2f} | **+{(s95 - d95) * 1e3:.2f}** |")


class Server:
    """One agent-mcp under test (this tree's, or `--baseline`'s), its bench client, its results."""

    def __init__(self, name: str, server: AgentServer):
        self.name, self.server = name, server
        assert server.proc is not None
        self.pid = server.proc.pid
        self.path = ServerPath(server.url, server.token)
        self.turns: list[tuple[float, float]] = []
        self.cpu = 0.0
        self.short_cpu = 0.0  # of the turns whose answer is one token: the cost of a turn without its stream

    async def measure(self, first: int, count: int) -> None:
        before = cpu_seconds(self.pid)
        for i in range(count):
            self.turns.append(await self.path.turn(first + i))
        self.cpu += cpu_seconds(self.pid) - before
        before = cpu_seconds(self.pid)
        for i in range(count):
            await self.path.turn(first + i, SHORT)
        self.short_cpu += cpu_seconds(self.pid) - before


async def run(args: argparse.Namespace) -> None:
    pinned = (os.cpu_count() or 1) >= 2
    if pinned:
        os.sched_setaffinity(0, {0})
    trees = [("server", None)] + ([("baseline", args.baseline)] if args.baseline else [])
    def reply(req: RecordedRequest) -> TextReply:
        return tokens(1 if req.last_user_text.startswith(SHORT) else args.tokens)

    with FakeOpenAI(default_reply=reply) as backend, tempfile.TemporaryDirectory() as tmp:
        servers: list[Server] = []
        try:
            for name, code in trees:
                (Path(tmp) / name).mkdir()
                cfg = ConfigDir(Path(tmp) / name)
                cfg.models = {"fake": openai_model(backend, max_context=2)}
                cfg.env = {"SESSION_STORE": "sqlite"}
                servers.append(Server(name, AgentServer(cfg.write(), code=code).start()))
                if pinned:
                    os.sched_setaffinity(servers[-1].pid, {1})
            llm = openai_chat_model(model="fake-gpt", base_url=backend.base_url, api_key="k", streaming=True,
                                    max_retries=1, stream_chunk_timeout=None)  # a stale pooled connection
            system = PromptTree(DEFAULTS_DIR / ".system_prompt").load().assemble()
            for s in servers:
                await s.path.open()
            per_round = max(1, args.turns // args.rounds)
            for i in range(args.warmup):  # connections, imports, caches
                await direct_turn(llm, system, i)
                for s in servers:
                    await s.path.turn(i)
            direct: list[tuple[float, float]] = []
            for r in range(args.rounds):
                for i in range(per_round):
                    direct.append(await direct_turn(llm, system, r * per_round + i))
                for s in servers:
                    await s.measure(r * per_round, per_round)
        finally:
            for s in servers:
                await s.path.close()
                s.server.stop()
    n = len(direct)
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"\n{n} turns per path, {args.rounds} interleaved rounds, {args.tokens} tokens per answer, "
          f"{'server pinned to core 1, client and fake to core 0' if pinned else 'no pinning (1 core)'}; "
          f"load average {load}\n")
    print("| metric (ms) | direct p50 | server p50 | added p50 | ratio p50 | direct p95 | server p95 | added p95 |")
    print("|---|---|---|---|---|---|---|---|")
    for s in servers:
        label = "" if s.name == "server" else f" ({s.name})"
        print(row(f"time to first token{label}", [d[0] for d in direct], [t[0] for t in s.turns]))
        print(row(f"whole turn (submit → done){label}", [d[1] for d in direct], [t[1] for t in s.turns]))
    print()
    for s in servers:
        stream = (s.cpu - s.short_cpu) / n / (args.tokens - 1)
        print(f"{s.name} CPU per turn: {s.cpu / n * 1e3:.2f} ms ({s.cpu / n / args.tokens * 1e6:.0f} µs per token); "
              f"a one-token turn {s.short_cpu / n * 1e3:.2f} ms, so each further streamed token {stream * 1e6:.0f} µs")
    print(json.dumps({"turns": n, "tokens": args.tokens, "load": load,
                      **{f"{s.name}_cpu_ms_per_turn": round(s.cpu / n * 1e3, 3) for s in servers},
                      **{f"{s.name}_cpu_ms_one_token_turn": round(s.short_cpu / n * 1e3, 3) for s in servers}}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--turns", type=int, default=200)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--baseline", help="another agent-mcp tree whose server runs in the same rounds (before/after)")
    args = p.parse_args()
    args.baseline = Path(args.baseline).resolve() if args.baseline else None
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
