#!/usr/bin/env python3
"""Added latency and throughput of the Ollama/OpenAI proxy, against the fake backend and LiteLLM.

The same openai SDK client (AsyncOpenAI, streaming) asks the same instant fake OpenAI backend
(32 tokens per answer) by three paths, in the same run:

  direct:    client → fake backend
  agent-mcp: client → plugin_proxy_llama (/v1/chat/completions) → agent turn (system prompt, tools,
             history) → ChatOpenAI → fake backend
  litellm:   client → LiteLLM proxy (`litellm --config`, its own venv) → fake backend

No forwarded headers, and every request is a new conversation (its own first message), as
open-webui's new chats and SDK programs send them: each agent-mcp request starts a session.
For each path: the first request after the server said it was ready (cold), then, after a
warm-up, the median and p95 time to the first and to the last token at concurrency 1 (sequential,
interleaved round by round) and at `--concurrency` clients at once, the added time over direct
at each, and streams per second at each. Each round also streams as many answers of one token
through each path: their server CPU against the full streams' gives the cost of each further
streamed token apart from the stream's own (as `make bench` does for the shell). Only 127.0.0.1
is used. With two or more cores it runs in two placements, one after the other, each with servers of its own:

  split:  both servers pinned to core 1 (the same one core), the client and the fake to core 0;
  shared: the client and the fake on core 1 too (`taskset`-style affinity), so every path's client,
          server and backend share one core and no path gains from a second one.

    python bench/proxy_overhead.py [--requests 200] [--rounds 10] [--tokens 32] [--concurrency 16]
                                   [--placements split,shared] [--litellm .venv/litellm/bin/litellm]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.turn_overhead import cpu_seconds, pct  # noqa: E402
from tests.conftest import AgentServer, ConfigDir, free_port, openai_model  # noqa: E402
from tests.fakes.backend import RecordedRequest, TextReply, tokens  # noqa: E402
from tests.fakes.openai_backend import FakeOpenAI  # noqa: E402

_conversations = itertools.count()

#: The question whose answer is one token: the same stream without its tokens, for the cost per further token.
SHORT = "one word"


class Target:
    """One way to reach the backend: an AsyncOpenAI client, a model name and extra headers per stream."""

    def __init__(self, name: str, base_url: str, model: str, api_key: str = "bench"):
        self.name, self.model = name, model
        self.client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=60)
        self.cold = 0.0
        self.first: list[float] = []
        self.last: list[float] = []
        self.streams_per_second = 0.0
        self.busy_first: list[float] = []
        self.busy_last: list[float] = []
        self.busy_streams_per_second = 0.0
        self.pid: int | None = None  # the server process in the path, for its CPU time
        self.cpu = 0.0
        self.short_cpu = 0.0  # server CPU of as many streams whose answer is one token

    async def stream(self, question: str = "say something") -> tuple[float, float]:
        """Time to the first and to the last content token of one streamed answer in a new conversation."""
        prompt = [{"role": "user", "content": f"{question} #{next(_conversations)}"}]
        start = time.perf_counter()
        first = last = 0.0
        resp = await self.client.chat.completions.create(model=self.model, messages=prompt, stream=True)
        async for chunk in resp:
            if chunk.choices and chunk.choices[0].delta.content:
                last = time.perf_counter() - start
                first = first or last
        if not first:
            raise RuntimeError(f"{self.name}: the stream carried no text")
        return first, last

    async def busy(self, concurrency: int, per_client: int) -> None:
        """`concurrency` clients at once, each streaming `per_client` answers one after another."""
        async def worker() -> None:
            for _ in range(per_client):
                first, last = await self.stream()
                self.busy_first.append(first)
                self.busy_last.append(last)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        self.busy_streams_per_second = concurrency * per_client / (time.perf_counter() - start)


def start_proxy(backend: FakeOpenAI, tmp: Path, code: Path | None = None) -> tuple[AgentServer, str]:
    """An agent-mcp server (of tree `code`, default this one) with only the proxy plugin, sessions in memory, on
    `backend`; and its OpenAI base URL."""
    cfg = ConfigDir(Path(tempfile.mkdtemp(dir=tmp)))
    cfg.models = {"fake": openai_model(backend, max_context=2)}
    port = free_port()
    cfg.plugins.append("plugin_proxy_llama")
    cfg.plugin_config["plugin_proxy_llama"] = {"port": port, "status_lines": "off"}
    return AgentServer(cfg.write(), {"SESSION_STORE": "memory"}, code=code).start(), f"http://127.0.0.1:{port}/v1"


def start_litellm(exe: str, backend: FakeOpenAI, tmp: Path, key: str) -> tuple[subprocess.Popen[bytes], str]:
    """LiteLLM's proxy on a free port, offline, forwarding model `fake` to the fake backend."""
    port = free_port()
    config = tmp / "litellm.yaml"
    config.write_text(
        "model_list:\n"
        "  - model_name: fake\n"
        "    litellm_params:\n"
        "      model: openai/fake-model\n"
        f"      api_base: {backend.base_url}\n"
        "      api_key: bench\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
    # Offline: the bundled model-cost map instead of a download; no DB; quiet logs.
    env.pop("DATABASE_URL", None)
    env.update({"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR", "LITELLM_MASTER_KEY": key})
    proc = subprocess.Popen([exe, "--config", str(config), "--host", "127.0.0.1", "--port", str(port),
                             "--num_workers", "1"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"litellm exited with {proc.returncode}: {proc.stderr.read().decode()[-2000:]}")
        try:
            if httpx.get(f"{url}/health/liveliness", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("litellm did not start within 120 s")


def added(values: list[float], direct: list[float]) -> float:
    return statistics.median(values) - statistics.median(direct)


def cells(values: list[float], direct: list[float]) -> str:
    """p50 | p95 | added p50 over direct, in ms."""
    p50, p95 = statistics.median(values), pct(values, 0.95)
    extra = "—" if values is direct else f"**+{added(values, direct) * 1e3:.2f}**"
    return f"{p50 * 1e3:.2f} | {p95 * 1e3:.2f} | {extra}"


PLACEMENTS = {
    "split": "both servers on core 1, client and fake on core 0",
    "shared": "client, fake and both servers all on core 1",
}


async def run(args: argparse.Namespace, placement: str) -> None:
    pinned = (os.cpu_count() or 1) >= 2
    if pinned:
        os.sched_setaffinity(0, {0} if placement == "split" else {1})
    exe = args.litellm_exe
    def reply(req: RecordedRequest) -> TextReply:
        return tokens(1 if req.last_user_text.startswith(SHORT) else args.tokens)

    with FakeOpenAI(default_reply=reply) as backend, tempfile.TemporaryDirectory() as tmp:
        paths = [Target("direct", backend.base_url, "fake-model")]
        servers, procs = [], []
        for name, code in [("agent-mcp proxy", None)] + ([("agent-mcp proxy (baseline)", args.baseline)]
                                                           if args.baseline else []):
            server, url = start_proxy(backend, Path(tmp), code)
            servers.append(server)
            procs.append(servers[-1].proc)
            paths.append(Target(name, url, "agent-mcp:latest"))
            paths[-1].pid = servers[-1].proc.pid if servers[-1].proc else None
        litellm = None
        if exe:
            key = f"sk-{secrets.token_hex(16)}"
            litellm, url = start_litellm(exe, backend, Path(tmp), key)
            procs.append(litellm)
            paths.append(Target("LiteLLM proxy", f"{url}/v1", "fake", api_key=key))
            paths[-1].pid = litellm.pid
        else:
            print(f"LiteLLM not found at {args.litellm!r}: measuring without it (make bench-proxy installs it)")
        if pinned:
            for proc in procs:
                assert proc is not None
                os.sched_setaffinity(proc.pid, {1})
        try:
            for p in paths:
                p.cold = (await p.stream())[1]  # the first request after the server said it was ready
                for _ in range(args.warmup):
                    await p.stream()
            per_round = max(1, args.requests // args.rounds)
            for round_ in range(args.rounds):
                # The servers' order turns every round: measured with itself as baseline, the server measured
                # first in every round came out 2.3 ms slower to the first token (docs/benchmarks.md).
                for p in paths if round_ % 2 == 0 else [paths[0], *paths[:0:-1]]:
                    before = cpu_seconds(p.pid) if p.pid else 0.0
                    for _ in range(per_round):
                        first, last = await p.stream()
                        p.first.append(first)
                        p.last.append(last)
                    p.cpu += cpu_seconds(p.pid) - before if p.pid else 0.0
                    before = cpu_seconds(p.pid) if p.pid else 0.0
                    for _ in range(per_round):
                        await p.stream(SHORT)
                    p.short_cpu += cpu_seconds(p.pid) - before if p.pid else 0.0
            for p in paths:
                p.streams_per_second = len(p.first) / sum(p.last)
                await p.busy(args.concurrency, args.per_client)
        finally:
            for p in paths:
                await p.client.close()
            if litellm is not None:
                litellm.terminate()
                litellm.wait(15)
            for server in servers:
                server.stop()
    direct = paths[0]
    c = args.concurrency
    print(f"\n{len(direct.first)} sequential streams per path in {args.rounds} interleaved rounds, then {c} "
          f"concurrent clients × {args.per_client} streams; {args.tokens} tokens per answer; every request a new "
          f"conversation; {PLACEMENTS[placement] if pinned else 'no pinning (1 core)'}; load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}\n")
    print("| path | concurrency | first token p50 (ms) | p95 | added p50 | last token p50 (ms) | p95 | added p50 "
          "| streams/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for p in paths:
        print(f"| {p.name} | 1 | {cells(p.first, direct.first)} | {cells(p.last, direct.last)} "
              f"| {p.streams_per_second:.0f} |")
        print(f"| {p.name} | {c} | {cells(p.busy_first, direct.busy_first)} | {cells(p.busy_last, direct.busy_last)} "
              f"| {p.busy_streams_per_second:.0f} |")
    print(
        "\n| path | first request after start, whole answer (ms) | warm p50 (ms) | ratio | server CPU per stream (ms) "
        "| per token (µs) | one-token stream (ms) | each further token (µs) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for p in paths[1:]:
        warm, n = statistics.median(p.last), len(p.first)
        further = (p.cpu - p.short_cpu) / n / max(1, args.tokens - 1)
        print(f"| {p.name} | {p.cold * 1e3:.1f} | {warm * 1e3:.1f} | {p.cold / warm:.2f}× "
              f"| {p.cpu / n * 1e3:.1f} | {p.cpu / n / args.tokens * 1e6:.0f} | {p.short_cpu / n * 1e3:.1f} "
              f"| {further * 1e6:.0f} |")
    theirs = next((p for p in paths if p.name == "LiteLLM proxy"), None)
    for ours in paths[1:]:
        if ours is theirs:
            continue
        if theirs is not None:
            first = added(ours.first, direct.first) / added(theirs.first, direct.first)
            busy = added(ours.busy_first, direct.busy_first) / added(theirs.busy_first, direct.busy_first)
            print(f"\n{ours.name} / LiteLLM: added first token {first:.2f}× at 1, {busy:.2f}× at {c}; "
                  f"streams/s {ours.busy_streams_per_second / theirs.busy_streams_per_second:.2f}× at {c}")
        print(f"{ours.name} / direct: streams/s {ours.busy_streams_per_second / direct.busy_streams_per_second:.2f}× "
              f"at {c}")

def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=200, help="sequential streams per path")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--per-client", type=int, default=25, help="streams per concurrent client")
    p.add_argument("--baseline", help="another agent-mcp tree whose proxy is measured too, in the same rounds")
    p.add_argument("--placements", default="split,shared",
                   help=f"comma-separated, run in this order: {', '.join(PLACEMENTS)} (see above)")
    p.add_argument("--litellm", default=str(ROOT / ".venv" / "litellm" / "bin" / "litellm"),
                   help="the litellm executable (default: the one 'make bench-proxy' installs)")
    args = p.parse_args()
    args.baseline = Path(args.baseline).resolve() if args.baseline else None
    args.litellm_exe = args.litellm if args.litellm and Path(args.litellm).exists() else None
    placements = [name.strip() for name in args.placements.split(",") if name.strip()]
    unknown = set(placements) - set(PLACEMENTS)
    if unknown:
        p.error(f"unknown placement(s) {', '.join(sorted(unknown))}; choose from {', '.join(PLACEMENTS)}")
    for placement in placements:
        print(f"\n## placement: {placement}")
        asyncio.run(run(args, placement))


if __name__ == "__main__":
    main()
