"""One Slack answer in a thread: the placeholder, throttled live edits, then the final messages.

Split from plugin_client_slack.py, which starts a `Reply` per request and feeds it the request's
events; every Web API call of the answer is made here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from typing import TYPE_CHECKING

from slack_sdk import WebClient
from slack_sdk.errors import SlackApiError, SlackClientError

import plugin_api
from plugins._slack_text import escape, split_message, to_mrkdwn

if TYPE_CHECKING:
    from plugins.plugin_client_slack import SlackSettings

logger = logging.getLogger("agent_mcp.slack")

WORKING = "_⏳ working…_"
#: Status lines: `[tool ▶] args` / `[tool ◀] result` / `[tool ↺] …` (the tool loop), `[gate ✗] tool …`
#: and `[gate ✓] tool …` (gates), `[RATE LIMITED] tool …` (rate limits), `[tool ✗] why` (a refused call).
STATUS_LINE = re.compile(r"^\[(?P<tag>[^\]]+)\]\s*(?P<rest>.*)$", re.DOTALL)
GATE_HINT = ("_Tools that need approval cannot be approved from Slack: ask from shell.py, "
             "or an operator can allow the tool there or in gate-defaults.json._")


class Reply:
    """An answer in a thread: placeholder, throttled live edits, then the final messages.

    `feed()` only records events (it never waits on Slack), and `run()` makes every Web API call
    of the answer in order, so a slow or rate-limited Slack never holds up the agent's stream.
    """

    def __init__(self, web: WebClient, settings: SlackSettings, channel: str, thread_ts: str):
        self.web, self.settings = web, settings
        self.channel, self.thread_ts = channel, thread_ts
        self.ts: str | None = None
        self.parts: list[str] = []
        self.status = ""
        self.errors: list[str] = []
        self.notes: list[str] = []
        self.cancelled = False
        self.posted = 0
        self._refused: set[str] = set()
        self._shown = ""
        self._changed = asyncio.Event()
        self._finished = asyncio.Event()

    def feed(self, ev: plugin_api.Event) -> None:
        """Take one event of the request."""
        if ev.name == "tok":
            self.parts.append(str(ev.data.get("text", "")))
        elif ev.name == "status" and ev.data.get("cancelled") is True:
            self.cancelled = True
        elif ev.name == "status":
            self._tool_status(str(ev.data.get("text", "")))
        elif ev.name == "error":
            self.errors.append(str(ev.data.get("message", "")))
        else:
            return
        self._changed.set()

    def _tool_status(self, text: str) -> None:
        """Show what a tool is doing in the placeholder; a refused or rate-limited call gets a note."""
        m = STATUS_LINE.match(text.strip())
        if m is None:
            self.status = text.strip().splitlines()[0][:100] if text.strip() else ""
            return
        tag, rest = m["tag"], " ".join(m["rest"].split())
        tool = rest.split(" ", 1)[0].rstrip(":")
        if tag.endswith(" ▶"):
            self.status = f"⚙️ running `{escape(tag[:-2])}`…"
            return
        self.status = ""
        if tag == "gate ⏳":  # a gate routed to approvers (the buttons are posted by _slack_approvals)
            self.status = f"🔐 waiting for approval of `{escape(tool)}`…"
        elif tag == "gate ✗":  # the hint only where nobody could approve (not: an approver said no, or timed out)
            hint = f"\n{GATE_HINT}" if "cannot give" in rest else ""
            self._note(tool, f"⛔ Not run: {escape(rest[:300])}{hint}")
        elif tag == "RATE LIMITED":
            self._note(tool, f"⏳ Not run: {escape(rest[:300])}")
        elif tag.endswith(" ✗"):
            self._note(tag[:-2], f"⛔ Not run: `{escape(tag[:-2])}`: {escape(rest[:300])}\n{GATE_HINT}")

    def _note(self, tool: str, text: str) -> None:
        # One note per tool and answer: a model that retries a refused call does not flood the thread.
        if tool not in self._refused:
            self._refused.add(tool)
            self.notes.append(text)

    def finish(self) -> None:
        """The request ended: post the final text now."""
        self._finished.set()
        self._changed.set()

    def answer(self) -> str:
        return "".join(self.parts).strip()

    def _preview(self) -> str:
        # The last line always says the answer is still coming (a tool running, or just working).
        status = f"_{self.status}_" if self.status else WORKING
        answer = self.answer()
        if not answer:
            return status
        chunks = split_message(to_mrkdwn(answer), self.settings.max_message_chars - len(status) - 3)
        return chunks[0] + ("\n…" if len(chunks) > 1 else "") + f"\n{status}"

    def final_messages(self) -> list[str]:
        """The messages of the finished answer, first one first."""
        limit = self.settings.max_message_chars
        answer = self.answer()
        errors = [f"⚠️ {escape(e)}"[:limit] for e in self.errors]
        messages = split_message(to_mrkdwn(answer), limit) if answer else []
        if self.cancelled:
            ending = "_(cancelled)_"
            if messages and len(messages[-1]) + len(ending) < limit:
                messages[-1] += f"\n{ending}"
            else:
                messages.append(ending)
        messages += errors
        return messages or ["_(no answer)_"]

    async def run(self) -> None:
        """Post the placeholder, edit it while the answer streams, then post the final messages."""
        self.ts = await self._post(WORKING)
        self._shown = WORKING
        while not self._finished.is_set():
            await self._changed.wait()
            self._changed.clear()
            await self._post_notes()
            if self._finished.is_set():
                break
            await self._edit(self._preview())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._finished.wait(), self.settings.update_interval)
        await self._post_notes()
        first, *rest = self.final_messages()
        if self.ts is None or not await self._edit(first):
            await self._post(first)
        for text in rest:
            await self._post(text)

    async def _post_notes(self) -> None:
        while self.notes:
            await self._post(self.notes.pop(0))

    async def _post(self, text: str) -> str | None:
        try:
            resp = await asyncio.to_thread(
                self.web.chat_postMessage,
                channel=self.channel, thread_ts=self.thread_ts, text=text, unfurl_links=False, unfurl_media=False,
            )
        except (SlackClientError, OSError) as exc:
            logger.warning("chat.postMessage in %s failed: %s", self.channel, describe(exc))
            return None
        self.posted += 1
        return str(resp.get("ts") or "") or None

    async def _edit(self, text: str) -> bool:
        if self.ts is None:
            return False
        if text == self._shown:
            return True
        try:
            await asyncio.to_thread(self.web.chat_update, channel=self.channel, ts=self.ts, text=text)
        except (SlackClientError, OSError) as exc:
            logger.warning("chat.update in %s failed: %s", self.channel, describe(exc))
            return False
        self._shown = text
        return True


def describe(exc: BaseException) -> str:
    if isinstance(exc, SlackApiError):
        return f"Slack answered {exc.response.get('error', 'an error')!r}"
    return f"{type(exc).__name__}: {exc}"
