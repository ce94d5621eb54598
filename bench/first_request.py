#!/usr/bin/env python3
"""The first request after start against a warm one, and how long the server's event loop stalls.

agent-mcp runs as a subprocess (proxy + shell endpoint) against the instant fake OpenAI backend.
While the first chat request after "ready" runs through the proxy, a poller sends `GET /health`
to the shell endpoint (another port, the same event loop) every 5 ms; the largest gap between two
answers is the longest stall any listener saw. Then the same for a warm request. Only 127.0.0.1.

    python bench/first_request.py [--runs 3]
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
import openai

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.conftest import AgentServer, ConfigDir, free_port, openai_model  # noqa: E402
from tests.fakes.openai_backend import FakeOpenAI  # noqa: E402


async def timed_request(server: AgentServer, proxy_url: str, text: str) -> tuple[float, float]:
    """(seconds to the whole answer, longest gap between /health answers meanwhile)."""
    done = asyncio.Event()
    gaps: list[float] = []

    async def poll() -> None:
        async with httpx.AsyncClient(headers=server.auth, timeout=10) as http:
            last = time.perf_counter()
            while not done.is_set():
                await http.get(f"{server.url}/health")
                now = time.perf_counter()
                gaps.append(now - last)
                last = now
                await asyncio.sleep(0.005)

    poller = asyncio.create_task(poll())
    await asyncio.sleep(0.1)  # the poller is connected and steady
    async with openai.AsyncOpenAI(base_url=proxy_url + "/v1", api_key="x", max_retries=0, timeout=60) as client:
        start = time.perf_counter()
        stream = await client.chat.completions.create(
            model="agent-mcp:latest", messages=[{"role": "user", "content": text}], stream=True)
        async for _ in stream:
            pass
        elapsed = time.perf_counter() - start
    await asyncio.sleep(0.05)
    done.set()
    await poller
    return elapsed, max(gaps[1:] or [0.0])


async def one_run() -> tuple[float, float, float, float]:
    with FakeOpenAI() as backend, tempfile.TemporaryDirectory() as tmp:
        cfg = ConfigDir(Path(tmp))
        cfg.models = {"fake": openai_model(backend)}
        port = free_port()
        cfg.plugins.append("plugin_proxy_llama")
        cfg.plugin_config["plugin_proxy_llama"] = {"port": port}
        server = AgentServer(cfg.write(), {"SESSION_STORE": "memory"}).start()
        try:
            url = f"http://127.0.0.1:{port}"
            first, first_stall = await timed_request(server, url, "the first question")
            warm, warm_stall = await timed_request(server, url, "a later question")
        finally:
            server.stop()
    return first, first_stall, warm, warm_stall


async def run(runs: int) -> None:
    results = [await one_run() for _ in range(runs)]
    first, first_stall, warm, warm_stall = (statistics.median(r[i] for r in results) for i in range(4))
    print(f"\nmedian of {runs} fresh servers (each: first request after ready, then one warm request)\n")
    print("| request | answer (ms) | longest event-loop stall meanwhile (ms) |")
    print("|---|---|---|")
    print(f"| first after start | {first * 1e3:.1f} | {first_stall * 1e3:.1f} |")
    print(f"| warm | {warm * 1e3:.1f} | {warm_stall * 1e3:.1f} |")
    print(f"\nfirst / warm: {first / warm:.2f}×")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=3)
    asyncio.run(run(p.parse_args().runs))


if __name__ == "__main__":
    main()
