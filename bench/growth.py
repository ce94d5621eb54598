#!/usr/bin/env python3
"""Costs as work grows: does anything in agent-mcp grow faster than linearly?

Every part starts agent-mcp as a subprocess (tests/conftest.AgentServer) against the instant fake
OpenAI backend (tests/fakes, 32 tokens per answer) and reads the server's CPU time and RSS from
/proc. Only 127.0.0.1 is used; compare numbers only within one run.

1. history: turns on sessions holding 10 / 100 / 1,000 messages (seeded into the SQLite store; a
   session per size and round, warmed by one unmeasured turn, so it grows by at most 22 messages),
   the model's context window large enough that the fit keeps all of them (so the fit counts every
   message each turn); server CPU per turn, and the whole turn against the same request (same
   history) sent to the fake backend directly with ChatOpenAI set up as the server sets it up
   (chat_openai.openai_chat_model, the history's message objects kept from call to call).
2. sessions: 100 / 10,000 / 100,000 sessions seeded into the SQLite store with SQL (a few
   messages each; the shell class's cap raised so that none is evicted); start-up time, RSS, a new
   session's first turn, a turn on an existing session, and `!session` (the list of all).
3. subscribers: 1 / 50 / 500 SSE connections on one session, held by a separate client process
   (httpx); the time from the fake backend starting its answer to every subscriber having the first
   token, and to every subscriber having `done`.
4. concurrency: 1 / 10 / 100 clients, a session each, turns at once; turns per second, turn p50 and
   server CPU per turn.
5. memory: idle RSS with every plugin in plugin-manifest.json enabled (keys absent or pointing at
   nothing, so they start with their warnings), and RSS of a proxy-only server after 1,000 and after
   10,000 conversations through plugin_proxy_llama with the `openai` SDK (`--proxy-turns` turns in all).

    python bench/growth.py [--parts history,sessions,subscribers,concurrency,memory] [--proxy-turns 20000]
    python bench/growth.py --parts memory --proxy-turns 0 --plot ''   # the idle RSS alone
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.turn_overhead import ServerPath, cpu_seconds, pct  # noqa: E402
from tests.conftest import AgentServer, ConfigDir, free_port, openai_model  # noqa: E402
from tests.fakes.backend import tokens  # noqa: E402
from tests.fakes.openai_backend import FakeOpenAI  # noqa: E402

TOKEN = "bench-growth-token-0123456789abcdef"
TOKENS = 32
RESULTS: dict[str, Any] = {}


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def history(n: int) -> list[dict[str, Any]]:
    """`n` messages of ordinary conversation (user / assistant, about 40 words each)."""
    words = "the backup of the orders database ran at night and finished without errors today "
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": f"message {i}: " + words * 3}
            for i in range(n)]


def seed(path: Path, sessions: list[tuple[str, list[dict[str, Any]]]]) -> None:
    """Write sessions straight into the SQLite store's tables (stores.SqliteStore's schema)."""
    from stores import SqliteStore
    path.parent.mkdir(parents=True, exist_ok=True)
    db = sqlite3.connect(path)
    for stmt in SqliteStore.SCHEMA:
        db.execute(stmt)
    now = time.time()
    rows = ((cid, i + 1, json.dumps({"model": "fake", "history": hist, "tool_preview_length": 500,
                                     "settings": {"client_class": "shell"}, "created": now}), now - len(sessions) + i)
            for i, (cid, hist) in enumerate(sessions))
    db.executemany("INSERT INTO sessions (client_id, shorthand, record, updated) VALUES (?, ?, ?, ?)", rows)
    db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES ('last_shorthand', ?)", (str(len(sessions)),))
    db.commit()
    db.close()


def config(tmp: Path, backend: FakeOpenAI, *, sessions: dict[str, Any] | None = None, **model: Any) -> ConfigDir:
    tmp.mkdir(parents=True, exist_ok=True)
    cfg = ConfigDir(tmp)
    cfg.models = {"fake": openai_model(backend, **model)}
    cfg.env = {"SESSION_STORE": "sqlite", "AGENT_SHELL_TOKEN": TOKEN}
    cfg.write()
    if sessions:
        enabled = json.loads((tmp / "plugins-enabled.json").read_text())
        enabled["sessions"] = sessions
        (tmp / "plugins-enabled.json").write_text(json.dumps(enabled, indent=2))
    return cfg


def start(cfg: ConfigDir, timeout: float = 600) -> tuple[AgentServer, float]:
    began = time.perf_counter()
    server = AgentServer(cfg).start(wait=False)
    server.wait_ready(timeout)
    return server, time.perf_counter() - began


# ── 1. history length ──────────────────────────────────────────────────────────────────────────

async def part_history(tmp: Path, backend: FakeOpenAI, args: argparse.Namespace) -> None:
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage

    from chat_openai import openai_chat_model
    from config import DEFAULTS_DIR
    from prompt import PromptTree

    sizes = (10, 100, 1000)
    cfg = config(tmp / "history", backend, max_context=5000, context_tokens=4_000_000,
                 sessions={"max_history_messages": 5000})
    # A session per size and round: each starts at its size and takes one unmeasured turn (its caches filled)
    # before its measured ones, so a measured session grows by at most 2 × (turns per round + 1) messages.
    rounds = 5
    seed(cfg.path / "data" / "sessions.sqlite3", [(f"hist{n}-{r}", history(n)) for n in sizes for r in range(rounds)])
    server, _ = start(cfg)
    pid = server.proc.pid  # type: ignore[union-attr]  # started: proc is set
    llm = openai_chat_model(model="fake-gpt", base_url=backend.base_url, api_key="k", streaming=True,
                            max_retries=1, stream_chunk_timeout=None)  # a stale pooled connection
    system = PromptTree(DEFAULTS_DIR / ".system_prompt").load().assemble()
    paths = {(n, r): ServerPath(server.url, TOKEN, f"hist{n}-{r}") for n in sizes for r in range(rounds)}
    msgs = {n: [SystemMessage(system)] + [(HumanMessage if m["role"] == "user" else AIMessage)(m["content"])
                                          for m in history(n)] for n in sizes}
    for p in paths.values():
        await p.open()

    async def direct(n: int, i: int) -> float:
        began = time.perf_counter()
        async for _ in llm.astream([*msgs[n], HumanMessage(f"question {i}")]):
            pass
        return time.perf_counter() - began

    for n in sizes:  # warm-up
        await direct(n, 0)
        for r in range(rounds):
            await paths[(n, r)].turn(0)
    cpu = dict.fromkeys(sizes, 0.0)
    through: dict[int, list[float]] = {n: [] for n in sizes}
    straight: dict[int, list[float]] = {n: [] for n in sizes}
    per_round = max(1, args.history_turns // rounds)
    for r in range(rounds):
        for n in sizes:
            for i in range(per_round):
                straight[n].append(await direct(n, i))
            before = cpu_seconds(pid)
            for i in range(per_round):
                through[n].append((await paths[(n, r)].turn(r * per_round + i))[1])
            cpu[n] += cpu_seconds(pid) - before
    for p in paths.values():
        await p.close()
    server.stop()
    library = {n: await library_cost(llm, msgs[n]) for n in sizes}
    rows = []
    for n in sizes:
        turns = len(through[n])
        s50, d50 = statistics.median(through[n]), statistics.median(straight[n])
        rows.append({"messages": n, "cpu_ms": cpu[n] / turns * 1e3, "turn_ms": s50 * 1e3, "direct_ms": d50 * 1e3,
                     "added_ms": (s50 - d50) * 1e3, "library_ms": library[n] * 1e3,
                     "own_ms": cpu[n] / turns * 1e3 - library[n] * 1e3})
    print(f"\n1. History length: {len(through[10])} turns per size, {rounds} interleaved rounds (a warm session "
          f"of that size each), window large enough for all\n")
    print("| history messages | server CPU per turn (ms) | of it, the libraries' request building (ms) "
          "| the rest (ms) | turn p50 (ms) | direct p50, same history (ms) | added p50 (ms) |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['messages']:,} | {row['cpu_ms']:.2f} | {row['library_ms']:.2f} | {row['own_ms']:.2f} "
              f"| {row['turn_ms']:.2f} | {row['direct_ms']:.2f} | {row['added_ms']:.2f} |")
    print(f"\nat 1,000 / at 10: server CPU per turn {rows[2]['cpu_ms'] / rows[0]['cpu_ms']:.2f}×, "
          f"without the request building {rows[2]['own_ms'] / rows[0]['own_ms']:.2f}×, "
          f"(goal ≤ 2×); added time at 1,000 minus at 10: {rows[2]['added_ms'] - rows[0]['added_ms']:+.2f} ms")
    RESULTS["history"] = rows


async def library_cost(llm: Any, messages: list[Any], rounds: int = 20) -> float:
    """CPU seconds the libraries the server uses spend building one request with these messages, in this
    process, as at a turn of the server: LangChain's payload (each message object converted once, the same
    objects every time: chat_openai.openai_chat_model), then its JSON body (orjson, as chat_openai sends it;
    the openai SDK's request transform is skipped since chat_openai.raw_streams)."""
    import orjson

    llm._get_request_payload(messages)  # the history's conversions, made at its earlier turns
    began = time.process_time()
    for _ in range(rounds):
        orjson.dumps(llm._get_request_payload(messages))
    return (time.process_time() - began) / rounds


# ── 2. stored sessions ─────────────────────────────────────────────────────────────────────────

async def timed_turn(path: ServerPath, text: str) -> float:
    began = time.perf_counter()
    resp = await path.http.post(f"{path.url}/submit", json={"client_id": path.client_id, "text": text})
    resp.raise_for_status()
    while await path.lines.get() != "done":
        pass
    return time.perf_counter() - began


async def part_sessions(tmp: Path, backend: FakeOpenAI, args: argparse.Namespace) -> None:
    rows = []
    for count in args.session_counts:
        cfg = config(tmp / f"sessions{count}", backend,
                     sessions={"interactive": {"idle_days": None, "max_sessions": 1_000_000}})
        seed(cfg.path / "data" / "sessions.sqlite3", [(f"stored-{i}", history(4)) for i in range(count)])
        server, startup = start(cfg)
        pid = server.proc.pid  # type: ignore[union-attr]  # started: proc is set
        idle = rss_mib(pid)
        fresh, old = ServerPath(server.url, TOKEN, "newcomer"), ServerPath(server.url, TOKEN, "stored-0")
        await fresh.open()
        await old.open()
        existing = [await timed_turn(old, f"question {i}") for i in range(5)]  # the first one warms up
        before = cpu_seconds(pid)
        new_turn = await timed_turn(fresh, "hello")
        new_cpu = cpu_seconds(pid) - before
        before = cpu_seconds(pid)
        listing = [await timed_turn(fresh, "!session") for _ in range(3)]
        list_cpu = (cpu_seconds(pid) - before) / 3
        rss = rss_mib(pid)
        for p in (fresh, old):
            await p.close()
        server.stop()
        rows.append({"sessions": count, "startup_s": startup, "new_turn_ms": new_turn * 1e3,
                     "new_turn_cpu_ms": new_cpu * 1e3, "turn_ms": statistics.median(existing) * 1e3,
                     "list_ms": statistics.median(listing) * 1e3, "list_cpu_ms": list_cpu * 1e3,
                     "rss_idle_mib": idle, "rss_mib": rss})
    print("\n2. Stored sessions (SQLite, 4 messages each, shell class cap raised to keep them all)\n")
    print("| sessions | start-up (s) | RSS after start (MiB) | new session's first turn (ms) | its CPU (ms) "
          "| turn on a stored session p50 (ms) | `!session` list (ms) | its CPU (ms) | RSS after (MiB) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['sessions']:,} | {r['startup_s']:.2f} | {r['rss_idle_mib']:.0f} | {r['new_turn_ms']:.1f} "
              f"| {r['new_turn_cpu_ms']:.1f} | {r['turn_ms']:.1f} | {r['list_ms']:.1f} | {r['list_cpu_ms']:.1f} "
              f"| {r['rss_mib']:.0f} |")
    RESULTS["sessions"] = rows


# ── 3. SSE subscribers ─────────────────────────────────────────────────────────────────────────

async def subscriber_child(url: str, client_id: str, count: int, turns: int) -> None:
    """Hold `count` SSE streams on one session; after each turn print the monotonic times at which
    the last stream had the turn's first token and its `done`."""
    limits = httpx.Limits(max_connections=count + 10, max_keepalive_connections=count + 10)
    firsts: list[list[float]] = [[] for _ in range(count)]
    dones: list[list[float]] = [[] for _ in range(count)]
    ready = 0
    all_ready, progress = asyncio.Event(), asyncio.Event()

    async def one(k: int, http: httpx.AsyncClient) -> None:
        nonlocal ready
        async with http.stream("GET", f"{url}/stream", params={"client_id": client_id}) as resp:
            ready += 1
            if ready == count:
                all_ready.set()
            waiting_first = True
            async for chunk in resp.aiter_raw():
                now = time.monotonic()
                if waiting_first and b"event: tok" in chunk:
                    firsts[k].append(now)
                    waiting_first = False
                if b"event: done" in chunk:
                    dones[k].append(now)
                    waiting_first = True
                    progress.set()

    async with httpx.AsyncClient(timeout=None, limits=limits, headers={"Authorization": f"Bearer {TOKEN}"}) as http:
        tasks = [asyncio.create_task(one(k, http)) for k in range(count)]
        await all_ready.wait()
        print("ready", flush=True)
        for t in range(turns):
            while min(len(d) for d in dones) <= t:
                progress.clear()
                await progress.wait()
            print(json.dumps([max(f[t] for f in firsts), max(d[t] for d in dones)]), flush=True)
        for task in tasks:
            task.cancel()


async def part_subscribers(tmp: Path, backend: FakeOpenAI, args: argparse.Namespace,
                           emitted: list[float]) -> None:
    rows = []
    cfg = config(tmp / "subscribers", backend)
    server, _ = start(cfg)
    pid = server.proc.pid  # type: ignore[union-attr]  # started: proc is set
    for count in (1, 50, 500):
        client_id = f"subs{count}"
        child = await asyncio.create_subprocess_exec(
            sys.executable, __file__, "--subscriber-child", server.url, client_id, str(count), str(args.sub_turns),
            stdout=asyncio.subprocess.PIPE)
        assert child.stdout is not None
        assert (await child.stdout.readline()).strip() == b"ready"
        async with httpx.AsyncClient(timeout=60, headers={"Authorization": f"Bearer {TOKEN}"}) as http:
            firsts, dones = [], []
            before = cpu_seconds(pid)
            for i in range(args.sub_turns):
                emitted.clear()
                (await http.post(f"{server.url}/submit", json={"client_id": client_id, "text": f"q {i}"})
                 ).raise_for_status()
                first, done = json.loads(await child.stdout.readline())
                firsts.append(first - emitted[0])
                dones.append(done - emitted[0])
            cpu = (cpu_seconds(pid) - before) / args.sub_turns
        rss = rss_mib(pid)
        child.kill()
        await child.wait()
        rows.append({"subscribers": count, "first_ms": statistics.median(firsts) * 1e3,
                     "first_p95_ms": pct(firsts, 0.95) * 1e3, "done_ms": statistics.median(dones) * 1e3,
                     "cpu_ms": cpu * 1e3, "rss_mib": rss})
    server.stop()
    print(f"\n3. SSE subscribers on one session ({args.sub_turns} turns each; the subscribers are one "
          "client process with httpx, on the same cores)\n")
    print("| subscribers | backend's answer → first token at all, p50 (ms) | p95 (ms) | → `done` at all, p50 (ms) "
          "| server CPU per turn (ms) | RSS (MiB) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['subscribers']} | {r['first_ms']:.2f} | {r['first_p95_ms']:.2f} | {r['done_ms']:.2f} "
              f"| {r['cpu_ms']:.2f} | {r['rss_mib']:.0f} |")
    RESULTS["subscribers"] = rows


# ── 4. concurrent turns ────────────────────────────────────────────────────────────────────────

async def part_concurrency(tmp: Path, backend: FakeOpenAI, args: argparse.Namespace) -> None:
    rows = []
    cfg = config(tmp / "concurrency", backend, max_context=2)
    server, _ = start(cfg)
    pid = server.proc.pid  # type: ignore[union-attr]  # started: proc is set
    for count in (1, 10, 100):
        clients = [ServerPath(server.url, TOKEN, f"conc{count}-{k}") for k in range(count)]
        for c in clients:
            # A kept-alive connection idle for uvicorn's 5 s is closed by the server; reusing it as it
            # closes fails the POST (httpx.ReadError). Under 100 concurrent turns a client idles that long.
            await c.http.aclose()
            c.http = httpx.AsyncClient(timeout=300, headers={"Authorization": f"Bearer {TOKEN}"},
                                       limits=httpx.Limits(keepalive_expiry=1.0))
            await c.open()
        await asyncio.gather(*(c.turn(-1) for c in clients))  # warm-up
        per_client = max(2, args.concurrent_turns // count)

        async def run(c: ServerPath, per_client: int = per_client) -> list[float]:
            return [(await c.turn(i))[1] for i in range(per_client)]

        before, began = cpu_seconds(pid), time.perf_counter()
        times = [t for ts in await asyncio.gather(*(run(c) for c in clients)) for t in ts]
        elapsed, cpu = time.perf_counter() - began, cpu_seconds(pid) - before
        for c in clients:
            await c.close()
        rows.append({"concurrent": count, "turns": len(times), "turns_per_s": len(times) / elapsed,
                     "p50_ms": statistics.median(times) * 1e3, "p95_ms": pct(times, 0.95) * 1e3,
                     "cpu_ms": cpu / len(times) * 1e3})
    server.stop()
    print("\n4. Concurrent turns (a session and an SSE stream per client, turns back to back)\n")
    print("| concurrent turns | turns | turns/s | turn p50 (ms) | turn p95 (ms) | server CPU per turn (ms) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['concurrent']} | {r['turns']} | {r['turns_per_s']:.0f} | {r['p50_ms']:.1f} | {r['p95_ms']:.1f} "
              f"| {r['cpu_ms']:.2f} |")
    RESULTS["concurrency"] = rows


# ── 5. memory ──────────────────────────────────────────────────────────────────────────────────

async def part_memory(tmp: Path, backend: FakeOpenAI, args: argparse.Namespace) -> None:
    from openai import AsyncOpenAI

    manifest = json.loads((ROOT / "plugin-manifest.json").read_text())["plugins"]
    cfg = config(tmp / "allplugins", backend)
    cfg.plugins = list(manifest)
    cfg.plugin_config = {"plugin_client_api": {"port": free_port()}, "plugin_proxy_llama": {"port": free_port()},
                         "plugin_client_mcp": {"port": free_port()}}
    cfg.write()
    server, startup = start(cfg)
    await asyncio.sleep(2)  # plugins that start background work settle
    all_plugins = rss_mib(server.proc.pid)  # type: ignore[union-attr]  # started: proc is set
    server.stop()
    print(f"idle RSS with every plugin enabled: {all_plugins:.0f} MiB", flush=True)
    if not args.proxy_turns:
        print(f"\n5. Memory\n\nidle RSS, every plugin in plugin-manifest.json enabled ({len(manifest)}): "
              f"{all_plugins:.0f} MiB (goal ≤ 120 MiB; started in {startup:.1f} s)")
        RESULTS["memory"] = {"all_plugins_mib": all_plugins}
        return

    port = free_port()
    cfg = config(tmp / "proxy", backend, max_context=2)
    cfg.plugins.append("plugin_proxy_llama")
    cfg.plugin_config["plugin_proxy_llama"] = {"port": port, "status_lines": "off"}
    cfg.write()
    server, _ = start(cfg)
    pid = server.proc.pid  # type: ignore[union-attr]  # started: proc is set
    client = AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k", max_retries=0,
                         http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=32)))
    per_conversation = max(1, args.proxy_turns // 10_000)

    async def conversation(c: int) -> None:
        messages: list[dict[str, str]] = []
        for t in range(per_conversation):
            messages.append({"role": "user", "content": f"conversation {c}, question {t}"})
            stream = await client.chat.completions.create(model="agent-mcp:latest", messages=messages, stream=True)
            answer = "".join([chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices])
            messages.append({"role": "assistant", "content": answer})

    marks, done, began = {}, 0, time.perf_counter()
    for upto in (1_000, 2_500, 5_000, 10_000):
        while done < upto:
            batch = min(8, upto - done)
            await asyncio.gather(*(conversation(done + k) for k in range(batch)))
            done += batch
        marks[upto] = (rss_mib(pid), time.perf_counter() - began)
        print(f"  after {upto:,} conversations ({upto * per_conversation:,} turns, {marks[upto][1]:.0f} s): "
              f"RSS {marks[upto][0]:.0f} MiB", flush=True)
    async with httpx.AsyncClient(timeout=30, headers={"Authorization": f"Bearer {TOKEN}"}) as http:
        health = await http.get(f"{server.url}/sessions")
    kept = len(health.json().get("sessions", [])) if health.status_code == 200 else None
    await client.close()
    server.stop()
    ratio = marks[10_000][0] / marks[1_000][0]
    print("\n5. Memory\n")
    print(f"idle RSS, every plugin in plugin-manifest.json enabled ({len(manifest)}): {all_plugins:.0f} MiB "
          f"(goal ≤ 120 MiB; started in {startup:.1f} s)")
    print(f"proxy (openai SDK → plugin_proxy_llama → fake), {per_conversation} turns per conversation: "
          f"RSS after 1,000 conversations {marks[1_000][0]:.0f} MiB, after 10,000 "
          f"({10_000 * per_conversation:,} turns, {marks[10_000][1]:.0f} s) {marks[10_000][0]:.0f} MiB: "
          f"{ratio:.2f}× (goal ≤ 1.2×); sessions kept: {kept}")
    RESULTS["memory"] = {"all_plugins_mib": all_plugins, "rss_by_conversations": {k: v[0] for k, v in marks.items()},
                         "rss_1k_mib": marks[1_000][0],
                         "rss_10k_mib": marks[10_000][0], "ratio": ratio, "turns": 10_000 * per_conversation,
                         "sessions_kept": kept}


# ── plot ───────────────────────────────────────────────────────────────────────────────────────

def svg_plot(path: Path) -> None:
    """Four small log-x panels (cost against size), written as SVG from the numbers."""
    panels = [(key, x, y, title) for key, x, y, title in (
        ("history", "messages", "cpu_ms", "server CPU per turn (ms) vs history messages"),
        ("sessions", "sessions", "new_turn_cpu_ms", "new session's turn CPU (ms) vs stored sessions"),
        ("subscribers", "subscribers", "first_ms", "first token at all subscribers (ms)"),
        ("concurrency", "concurrent", "cpu_ms", "server CPU per turn (ms) vs concurrent turns"),
    ) if key in RESULTS]
    import math
    w, h, pad = 360, 240, 45
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w * 2}" height="{h * 2}" font-family="sans-serif" '
           'font-size="11">', '<rect width="100%" height="100%" fill="white"/>']
    for idx, (key, xk, yk, title) in enumerate(panels):
        ox, oy = (idx % 2) * w, (idx // 2) * h
        pts = [(r[xk], r[yk]) for r in RESULTS[key]]
        xs, ymax = [math.log10(p[0]) for p in pts], max(p[1] for p in pts) * 1.15 or 1
        x0, x1 = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1

        def sx(v: float, x0: float = x0, x1: float = x1, ox: int = ox) -> float:
            return ox + pad + (math.log10(v) - x0) / (x1 - x0) * (w - 2 * pad)

        def sy(v: float, ymax: float = ymax, oy: int = oy) -> float:
            return oy + h - pad - v / ymax * (h - 2 * pad)

        out.append(f'<text x="{ox + 10}" y="{oy + 18}" font-weight="bold">{title}</text>')
        out.append(f'<line x1="{ox + pad}" y1="{sy(0)}" x2="{ox + w - pad}" y2="{sy(0)}" stroke="black"/>')
        out.append(f'<line x1="{ox + pad}" y1="{sy(0)}" x2="{ox + pad}" y2="{sy(ymax)}" stroke="black"/>')
        out.append('<polyline fill="none" stroke="#1f77b4" stroke-width="2" points="'
                   + " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in pts) + '"/>')
        if key in ("history", "subscribers", "concurrency", "sessions"):  # linear growth from the first point
            lin = [(x, pts[0][1] * x / pts[0][0]) for x, _ in pts]
            clipped = [(x, min(y, ymax)) for x, y in lin]
            out.append('<polyline fill="none" stroke="#aaa" stroke-dasharray="4 3" points="'
                       + " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in clipped) + '"/>')
        if key == "history" and "own_ms" in RESULTS[key][0]:  # without the libraries' request building
            own = [(r[xk], r["own_ms"]) for r in RESULTS[key]]
            out.append('<polyline fill="none" stroke="#ff7f0e" stroke-width="2" points="'
                       + " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in own) + '"/>')
            out.append(f'<text x="{ox + pad + 5}" y="{oy + 34}" fill="#ff7f0e">orange: without the '
                       'libraries\' request building</text>')
            for x, y in own:
                out.append(f'<text x="{sx(x) + 4:.1f}" y="{sy(y) + 12:.1f}" fill="#ff7f0e">{y:.2f}</text>')
        for x, y in pts:
            out.append(f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="3" fill="#1f77b4"/>')
            out.append(f'<text x="{sx(x) - 12:.1f}" y="{sy(0) + 14:.1f}">{x:,}</text>')
            out.append(f'<text x="{sx(x) + 4:.1f}" y="{sy(y) - 5:.1f}">{y:.2f}</text>')
    out.append(f'<text x="10" y="{h * 2 - 6}" fill="#777">dashed: linear growth from the smallest size '
               '(clipped); log x axis</text></svg>')
    path.write_text("\n".join(out) + "\n")


async def main_async(args: argparse.Namespace, load: str) -> None:
    emitted: list[float] = []

    def reply(req: Any) -> Any:
        emitted.append(time.monotonic())
        return tokens(TOKENS)

    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
          f"load: {load}")
    with FakeOpenAI(default_reply=reply) as backend, tempfile.TemporaryDirectory() as tmp:
        backend._requests = _Discard()  # 100,000 recorded requests would be the bench's own memory
        parts = {"history": part_history, "sessions": part_sessions, "concurrency": part_concurrency,
                 "memory": part_memory}
        for name in args.parts:
            if name == "subscribers":
                await part_subscribers(Path(tmp), backend, args, emitted)
            else:
                await parts[name](Path(tmp), backend, args)
    if args.plot:
        svg_plot(Path(args.plot))
        print(f"\nplot: {args.plot}")
    print(json.dumps(RESULTS))


class _Discard(list):
    def append(self, item: Any) -> None:
        pass


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--subscriber-child":
        url, client_id, count, turns = sys.argv[2:6]
        asyncio.run(subscriber_child(url, client_id, int(count), int(turns)))
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default="history,sessions,subscribers,concurrency,memory",
                   type=lambda s: s.split(","))
    p.add_argument("--history-turns", type=int, default=50)
    p.add_argument("--session-counts", default="100,10000,100000", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--sub-turns", type=int, default=20)
    p.add_argument("--concurrent-turns", type=int, default=300)
    p.add_argument("--proxy-turns", type=int, default=20_000,
                   help="turns through the proxy in all (10,000 conversations); 100,000 takes an hour here; "
                        "0: only the idle RSS")
    p.add_argument("--plot", default=str(ROOT / "docs" / "growth.svg"))
    p.add_argument("--plot-from", nargs="+", metavar="OUTPUT",
                   help="only draw the plot from the last JSON line of earlier runs' output (parts merged)")
    args = p.parse_args()
    if args.plot_from:
        for name in args.plot_from:
            RESULTS.update(json.loads(Path(name).read_text().strip().splitlines()[-1]))
        svg_plot(Path(args.plot))
        return
    asyncio.run(main_async(args, subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()))


if __name__ == "__main__":
    main()
