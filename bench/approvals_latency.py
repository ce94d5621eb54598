#!/usr/bin/env python3
"""Gates routed to approvers (docs/approvals.md): how fast a gate reaches an approver and the requester, and
how fast the answer reaches the stream.

One agent-mcp subprocess (shell endpoint + proxy) against an instant fake OpenAI backend, on 127.0.0.1, with
`approvals` routing the proxy's `db_query` gates to shell approvers. Each round: an `openai` SDK client asks
through the proxy, streamed; the model calls db_query; a shell window with `!approver on` (shell.py's client)
answers "allow" as soon as the gate arrives on its feed. Measured per gate (the server's clock stamps the gate
in the feed event, `raised_at`; same machine, same clock):

  to approver   gate raised → the approver window's feed event received
  to requester  gate raised → the wait line ("⏳ waiting for approval …") received in the client's stream
  answer → on  the approver's POST sent → the "allowed once" status line received in the client's stream

    python bench/approvals_latency.py [--gates 100]
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from pathlib import Path

import openai

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._latency import gated_config, main, report  # noqa: E402
from shell_client import ShellClient  # noqa: E402
from tests.conftest import AgentServer, free_port  # noqa: E402
from tests.fakes.backend import text, tool_call  # noqa: E402
from tests.fakes.openai_backend import FakeOpenAI  # noqa: E402


async def one_gate(server: AgentServer, proxy: str, backend: FakeOpenAI, shell: ShellClient, feed,
                   n: int) -> tuple[float, float, float]:
    backend.script(tool_call("db_query", {"sql": f"UPDATE users SET n = {n} WHERE id = 1"}), text("ok"))
    waited = asyncio.get_running_loop().create_future()
    allowed = asyncio.get_running_loop().create_future()
    async with openai.AsyncOpenAI(base_url=proxy + "/v1", api_key="unused", max_retries=0) as client:
        stream = await client.chat.completions.create(
            model="agent-mcp", messages=[{"role": "user", "content": f"update {n}"}], stream=True)

        async def read() -> None:
            async for chunk in stream:
                piece = chunk.choices[0].delta.content or "" if chunk.choices else ""
                if "⏳ waiting for approval" in piece and not waited.done():
                    waited.set_result(time.time())
                if "allowed once" in piece and not allowed.done():
                    allowed.set_result(time.time())

        reader = asyncio.create_task(read())
        asked = await anext(feed)
        to_approver = time.time() - asked.data["raised_at"]
        to_requester = await waited - asked.data["raised_at"]
        sent = time.time()
        await shell.gate_response(asked.data["gate_id"], "allow", as_approver=True)
        answered = await allowed - sent
        await reader
        closed = await anext(feed)
        assert closed.data["gate_id"] == asked.data["gate_id"]
    return to_approver, to_requester, answered


async def run(gates: int) -> None:
    with tempfile.TemporaryDirectory() as tmp, FakeOpenAI() as backend:
        port = free_port()
        cfg = gated_config(tmp, backend, "plugin_proxy_llama", {"port": port}, {"proxy": {"shell": True}})
        server = AgentServer(cfg.write(), {"SESSION_STORE": "memory"}).start()
        try:
            shell = ShellClient(server.url, "bench-approver", token=server.token)
            await shell.set_approver(True)
            feed = shell.approvals()
            rows = [await one_gate(server, f"http://127.0.0.1:{port}", backend, shell, feed, n) for n in range(gates)]
            await feed.aclose()
            await shell.aclose()
        finally:
            server.stop()
    report(f"{gates} gates routed to a shell approver, openai SDK streaming through the proxy (ms):",
           ("gate raised → approver's feed", "gate raised → wait line in the stream",
                              "answer sent → stream goes on"), rows)


if __name__ == "__main__":
    main(__doc__, run, 100)
