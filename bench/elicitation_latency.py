#!/usr/bin/env python3
"""MCP elicitation (docs/approvals.md): how fast a gate of an MCP client's turn reaches that client as an
elicitation form, and how fast the form's answer lets the turn go on.

One agent-mcp subprocess (shell endpoint + MCP server) against an instant fake OpenAI backend, on 127.0.0.1,
with `approvals` routing the mcp class's gates to the human token `alice` (and shell approvers, whose feed
carries the server's `raised_at` stamp; same machine, same clock). Each round: the official `mcp` SDK
client (2025-11-25, elicitation declared) calls `send_message`; the model calls db_query; the client's
`elicitation_callback` answers "allow_once" at once. Measured per gate:

  to elicitation  gate raised (server clock) → the client's elicitation_callback called
  answer → done   the callback returned → the send_message result received (the tool ran, the model answered)

    python bench/elicitation_latency.py [--gates 50]
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx2
import mcp_types as types
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._latency import gated_config, main, report  # noqa: E402
from shell_client import ShellClient  # noqa: E402
from tests.conftest import AgentServer, free_port  # noqa: E402
from tests.fakes.backend import text, tool_call  # noqa: E402
from tests.fakes.openai_backend import FakeOpenAI  # noqa: E402

TOKEN = "bench-elicitation-human-token-01"


async def run(gates: int) -> None:
    rows: list[tuple[float, float]] = []
    with tempfile.TemporaryDirectory() as tmp, FakeOpenAI() as backend:
        port = free_port()
        cfg = gated_config(tmp, backend, "plugin_client_mcp", {"port": port},
                           {"mcp": {"mcp_tokens": ["alice"], "shell": True}})
        (Path(tmp) / "mcp-tokens.json").write_text(json.dumps({"tokens": {"alice": {"role": "human",
                                                                                    "token": TOKEN}}}))
        (Path(tmp) / "mcp-tokens.json").chmod(0o600)
        server = AgentServer(cfg.write(), {"SESSION_STORE": "memory"}).start()
        try:
            shell = ShellClient(server.url, "bench-watcher", token=server.token)
            await shell.set_approver(True)  # only to read `raised_at` from the feed; it never answers
            feed = shell.approvals()
            events: asyncio.Queue[Any] = asyncio.Queue()

            async def follow() -> None:
                async for ev in feed:
                    events.put_nowait(ev)

            reader = asyncio.create_task(follow())
            stamps: dict[str, Any] = {}

            async def on_elicit(ctx: Any, params: types.ElicitRequestParams) -> types.ElicitResult:
                stamps["asked"] = time.time()
                # The gate waits for this answer, so it is on the feed (an open gate is sent to a feed that
                # connects late, too): take its `raised_at` before answering.
                stamps["opened"] = await events.get()
                stamps["answered"] = time.time()
                return types.ElicitResult(action="accept", content={"decision": "allow_once"})

            async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {TOKEN}"},
                                          timeout=httpx2.Timeout(30, read=120)) as http, \
                    Client(streamable_http_client(f"http://127.0.0.1:{port}/mcp", http_client=http), mode="legacy",
                           cache=None, elicitation_callback=on_elicit) as client:
                for n in range(gates):
                    backend.script(tool_call("db_query", {"sql": f"UPDATE users SET n = {n} WHERE id = 1"}),
                                   text("ok"))
                    result = await client.call_tool("send_message", {"text": f"update {n}", "session": "bench"})
                    done = time.time()
                    assert not result.is_error, result.content
                    opened = stamps["opened"]
                    closed = await events.get()
                    assert closed.data["gate_id"] == opened.data["gate_id"] and closed.data["channel"] == \
                        "mcp-elicitation", closed.data
                    rows.append((stamps["asked"] - opened.data["raised_at"], done - stamps["answered"]))
            reader.cancel()
            await shell.aclose()
        finally:
            server.stop()
    report(f"{gates} gates of an MCP client's turns asked as elicitation forms (mcp SDK, 2025-11-25) (ms):",
           ("gate raised → elicitation received", "form answered → send_message result"), rows)


if __name__ == "__main__":
    main(__doc__, run, 50)
