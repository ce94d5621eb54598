#!/usr/bin/env python3
"""Slack buttons for routed gates (docs/approvals.md "Slack"): how fast a gate raised in a Slack thread is
posted there with its buttons, and how fast a click is acted on.

One agent-mcp subprocess with the Slack plugin against the fake Slack (tests/fakes/slack.py: Socket Mode over a
real WebSocket, the Web API over HTTP) and an instant fake OpenAI backend, on 127.0.0.1; `approvals` routes the
Slack class's gates to one Slack user (and to shell approvers: a shell.py window with `!approver on` reads the
feed, whose events carry the server's `raised_at` stamp; same machine, same clock). Each round: a mention in a
new thread; the model calls a gated db_query; the gate is posted; the approver clicks "Allow once". Measured:

  raised → posted        gate raised → its chat.postMessage (with blocks) reaches Slack
  click → message edited  the click's envelope sent → the chat.update removing the buttons reaches Slack
  click → answer posted   the click's envelope sent → the turn's final answer reaches Slack

    python bench/slack_approvals.py [--gates 100]
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._latency import gated_config, main, report  # noqa: E402
from shell_client import ShellClient  # noqa: E402
from tests.conftest import AgentServer, free_port  # noqa: E402
from tests.fakes.backend import text, tool_call  # noqa: E402
from tests.fakes.openai_backend import FakeOpenAI  # noqa: E402
from tests.fakes.slack import APP_TOKEN, BOT_TOKEN, BOT_USER_ID, FakeSlack  # noqa: E402

LEAD = "U0LEAD"


async def one_gate(slack: FakeSlack, backend: FakeOpenAI, feed, n: int) -> tuple[float, float, float]:
    backend.script(tool_call("db_query", {"sql": f"UPDATE users SET n = {n} WHERE id = 1"}), text(f"done {n}"))
    root = f"{1_600_000_000 + n}.000001"
    slack.push_event({"type": "app_mention", "user": "U0ASKER", "text": f"<@{BOT_USER_ID}> update {n}",
                      "channel": "C1", "ts": root, "event_ts": root})
    asked = await anext(feed)
    while asked.name != "approval":
        asked = await anext(feed)

    def gate_post():
        return next((c for c in slack.calls_of("chat.postMessage")
                     if c.args.get("thread_ts") == root and c.args.get("blocks")), None)

    post = await slack.until(gate_post, 30)
    message = slack.messages[next(m.ts for m in slack.thread("C1", root) if m.versions and m.versions[0])]
    sent = time.time()
    slack.click(message, "agent-gate:allow", LEAD)
    edit = await slack.until(lambda: next((c for c in slack.calls_of("chat.update") if c.args.get("ts") == message.ts
                                           and c.args.get("blocks") and c.at >= sent), None), 30)
    done = await slack.until(lambda: next((c for c in slack.calls_of("chat.update") + slack.calls_of("chat.postMessage")
                                           if c.args.get("text") == f"done {n}"), None), 30)
    return post.at - asked.data["raised_at"], edit.at - sent, done.at - sent


async def run(gates: int) -> None:
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        os.environ.pop(var, None)
    with tempfile.TemporaryDirectory() as tmp, FakeOpenAI() as backend, FakeSlack() as slack:
        cfg = gated_config(tmp, backend, "plugin_client_slack",
                           {"api_base_url": slack.base_url, "port": free_port(), "update_interval": 0.05},
                           {"slack": {"slack_users": [LEAD], "shell": True}})
        cfg.env = {"SLACK_BOT_TOKEN": BOT_TOKEN, "SLACK_APP_TOKEN": APP_TOKEN}
        server = AgentServer(cfg.write(), {"SESSION_STORE": "memory"}).start()
        try:
            await slack.until(lambda: slack.connections >= 1, 30)
            shell = ShellClient(server.url, "bench-watcher", token=server.token)
            await shell.set_approver(True)
            feed = shell.approvals()
            rows = [await one_gate(slack, backend, feed, n) for n in range(gates)]
            await feed.aclose()
            await shell.aclose()
        finally:
            server.stop()
    report(f"{gates} gates raised in Slack threads, posted with buttons, allowed with a click (ms):",
           ("gate raised → Slack message posted", "click → message edited in place",
                              "click → the turn's answer posted"), rows)


if __name__ == "__main__":
    main(__doc__, run, 100)
