#!/usr/bin/env python3
"""The first request after start against a warm one, and how long the server's event loop stalls.

agent-mcp runs as a subprocess (shell endpoint + the door measured) against the instant fake OpenAI
backend. While the first request after "ready" runs, a poller sends `GET /health` to the shell
endpoint (another port, the same event loop) every 5 ms; the largest gap between two answers is the
longest stall any listener saw. Then the same for a warm request. Only 127.0.0.1. Doors:

- proxy: a streamed chat request through plugin_proxy_llama (its first one builds the chat model);
- mcp: an MCP `initialize` (JSON-RPC over Streamable HTTP, a human token) to plugin_client_mcp
  (its first one builds the MCP SDK's app).

    python bench/first_request.py [--runs 3] [--door proxy|mcp]
"""

from __future__ import annotations

import argparse
import asyncio
import json
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

MCP_TOKEN = "bench-first-request-mcp-token-0001"


async def chat(url: str, text: str) -> None:
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60) as client:
        stream = await client.chat.completions.create(
            model="agent-mcp:latest", messages=[{"role": "user", "content": text}], stream=True)
        async for _ in stream:
            pass


async def initialize(url: str, text: str) -> None:
    params = {"protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": text, "version": "1"}}
    body = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": params}
    headers = {"Authorization": f"Bearer {MCP_TOKEN}", "Accept": "application/json, text/event-stream"}
    async with httpx.AsyncClient(timeout=60) as http:
        answer = await http.post(url + "/mcp", json=body, headers=headers)
    answer.raise_for_status()


async def timed_request(server: AgentServer, url: str, text: str, door: str) -> tuple[float, float]:
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
    start = time.perf_counter()
    await (chat if door == "proxy" else initialize)(url, text)
    elapsed = time.perf_counter() - start
    await asyncio.sleep(0.05)
    done.set()
    await poller
    return elapsed, max(gaps[1:] or [0.0])


async def one_run(door: str) -> tuple[float, float, float, float]:
    with FakeOpenAI() as backend, tempfile.TemporaryDirectory() as tmp:
        cfg = ConfigDir(Path(tmp))
        cfg.models = {"fake": openai_model(backend)}
        port = free_port()
        plugin = "plugin_proxy_llama" if door == "proxy" else "plugin_client_mcp"
        cfg.plugins.append(plugin)
        cfg.plugin_config[plugin] = {"port": port}
        tokens = Path(tmp) / "mcp-tokens.json"
        tokens.write_text(json.dumps({"tokens": {"bench": {"role": "human", "token": MCP_TOKEN}}}))
        tokens.chmod(0o600)
        server = AgentServer(cfg.write(), {"SESSION_STORE": "memory"}).start()
        try:
            url = f"http://127.0.0.1:{port}"
            first, first_stall = await timed_request(server, url, "the first question", door)
            warm, warm_stall = await timed_request(server, url, "a later question", door)
        finally:
            server.stop()
    return first, first_stall, warm, warm_stall


async def run(runs: int, door: str) -> None:
    results = [await one_run(door) for _ in range(runs)]
    first, first_stall, warm, warm_stall = (statistics.median(r[i] for r in results) for i in range(4))
    print(f"\n{door}: median of {runs} fresh servers (each: first request after ready, then one warm request)")
    print("first requests (ms): " + ", ".join(f"{r[0] * 1e3:.0f}" for r in results) + "; their longest stalls (ms): "
          + ", ".join(f"{r[1] * 1e3:.0f}" for r in results) + "\n")
    print("| request | answer (ms) | longest event-loop stall meanwhile (ms) |")
    print("|---|---|---|")
    print(f"| first after start | {first * 1e3:.1f} | {first_stall * 1e3:.1f} |")
    print(f"| warm | {warm * 1e3:.1f} | {warm_stall * 1e3:.1f} |")
    print(f"\nfirst / warm: {first / warm:.2f}×")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--door", choices=("proxy", "mcp"), default="proxy")
    args = p.parse_args()
    asyncio.run(run(args.runs, args.door))


if __name__ == "__main__":
    main()
