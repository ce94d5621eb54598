"""Slack buttons for gates routed to approvers (issue 29; docs/approvals.md "Slack").

Runs only when plugins-enabled.json has an `approvals` section (`rt.gate.desk` is set). It follows the approver
feed (`ApprovalDesk.watch`) and posts each routed gate that concerns Slack as a Block Kit message: what the
tool will do, who may answer, the deadline, and one button per answer the gate offers. Where it goes:

- a gate raised in a Slack thread: in that thread (its Slack approvers are @-mentioned, so their phones ring;
  with only an approver channel elsewhere, the thread's message has no buttons and points there);
- a route naming a `slack_channel`: a message in that channel (once: not again when the thread is in it);
- a route naming `slack_users` but no channel, for a gate raised outside Slack: a DM to each of them.

Button clicks arrive as Socket Mode `interactive` envelopes (`block_actions`), already acked by the plugin;
a click answers with `GateKeeper.answer(..., Approver(SLACK, user))` through channel `slack-channel:<C…>` (a
click in the approver channel) or `slack`. A refused or late click gets an ephemeral message and changes
nothing. When the gate closes (an answer from any channel, a timeout, its turn ending) the feed's CLOSED
event edits every message of the gate in place: who decided and when, buttons gone.

With several instances on one Redis, the first instance to claim `slack-gate:<id>` (SET NX) posts the gate
and edits its messages later; a click may reach any instance's connection, which answers through the desk.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import approvals
import decisions
import plugin_api
from plugins._slack_events import PREFIX
from plugins._slack_text import escape

if TYPE_CHECKING:
    from slack_sdk import WebClient


logger = logging.getLogger("agent_mcp.slack.approvals")

#: action_id prefix of the gate buttons (the value of a button is its gate id).
ACTION = "agent-gate:"
#: Button labels, in the order they are shown; allow and reject are always offered.
BUTTONS = {decisions.ALLOW: "Allow once", decisions.TIMED: f"Allow {decisions.DEFAULT_MINUTES} min",
           decisions.SESSION: "Allow for the session", decisions.PATTERN: "Allow this statement shape",
           decisions.REJECT: "Reject"}
OUTCOMES = {decisions.ALLOW: "✅ Allowed once", decisions.SESSION: "✅ Allowed for the session",
            decisions.PATTERN: "✅ Allowed for this statement shape", decisions.REJECT: "⛔ Rejected",
            approvals.ABANDONED: "⏹ Closed: the request ended before anyone answered"}
#: Longest SQL shape / argument text shown (a section's text may hold 3000 characters).
SUMMARY_CHARS = 1500
#: Gates whose messages this instance remembers for their closing edit.
KEPT = 1024
#: Seconds before the feed is read again after it failed.
RETRY = 2.0
#: Longest gate id taken from a click (ours are uuids).
GATE_ID_CHARS = 64
#: The claim on a gate's post outlives its deadline by this much (late feed replays do not post it again).
CLAIM_MARGIN = 300.0


@dataclass
class _Posted:
    """The messages of one gate this instance posted: (channel, ts) pairs, and the task posting them."""

    gate: approvals.RoutedGate
    messages: list[tuple[str, str]] = field(default_factory=list)
    task: asyncio.Task[None] | None = None


def thread_of(session: str) -> tuple[str, str] | None:
    """(channel, thread_ts) of a Slack session id `slack-<channel>-<thread_ts>`, else None."""
    if not session.startswith(PREFIX):
        return None
    channel, _, thread_ts = session[len(PREFIX):].partition("-")
    return (channel, thread_ts) if channel and thread_ts else None


def _approvers(gate: approvals.RoutedGate, kind: str) -> list[str]:
    return [a.split(":", 1)[1] for a in gate.approvers if a.startswith(kind + ":")]


def targets(gate: approvals.RoutedGate) -> list[tuple[str, str | None]]:
    """Where a gate is posted: (channel, thread_ts or None). Empty: the gate does not concern Slack."""
    users, channels = _approvers(gate, approvals.SLACK), _approvers(gate, approvals.SLACK_CHANNEL)
    thread = thread_of(gate.session) if gate.client_class == "slack" else None
    out: list[tuple[str, str | None]] = []
    if thread is not None and (users or channels):
        out.append(thread)
    out += [(c, None) for c in channels if thread is None or c != thread[0]]
    if users and not channels and thread is None:
        out += [(u, None) for u in users]  # a DM to each approver (Slack opens it for a user id)
    return out


def _when(epoch: float) -> str:
    """A time each reader sees in their own time zone (Slack's date token), with a UTC fallback."""
    fallback = time.strftime("%H:%M:%S UTC", time.gmtime(epoch))
    return f"<!date^{int(epoch)}^{{time_secs}}|{fallback}>"


def _who(by: str) -> str:
    """`slack:U1` → `<@U1>`; other answerers by their label."""
    try:
        return approvals.Approver.parse(by).label().removeprefix("Slack user ") if by else "nobody"
    except approvals.ApprovalError:
        return escape(by)


def _origin(gate: approvals.RoutedGate, channel: str) -> str:
    thread = thread_of(gate.session) if gate.client_class == "slack" else None
    if thread is not None:
        return "this thread" if thread[0] == channel else f"a thread in <#{thread[0]}>"
    return f"{escape(gate.client_label)} session `{escape(gate.session[:80])}`"


def describe(gate: approvals.RoutedGate, channel: str) -> list[dict[str, Any]]:
    """The blocks saying what the gate is about (shared by the open and the closed message)."""
    on = f" on *{escape(', '.join(gate.tables))}*" if gate.tables else ""
    summary = gate.summary if len(gate.summary) <= SUMMARY_CHARS else gate.summary[:SUMMARY_CHARS] + "…"
    summary = escape(summary.replace("```", "ˋˋˋ")) or "(no arguments)"
    return [
        {"type": "section", "text": {"type": "mrkdwn", "text": (
            f"🔐 *Approval needed*: `{escape(gate.tool)}` wants to *{escape(gate.op)}*{on}, "
            f"asked from {_origin(gate, channel)}")}},
        {"type": "section", "text": {"type": "mrkdwn", "text": f"```{summary}```"}},
    ]


def answerable_in(gate: approvals.RoutedGate, channel: str) -> bool:
    """Whether someone may answer `gate` with a click in `channel`: a listed Slack user (anywhere they see
    it), or anyone in an approver channel."""
    return bool(_approvers(gate, approvals.SLACK)) or channel in _approvers(gate, approvals.SLACK_CHANNEL)


def open_blocks(gate: approvals.RoutedGate, channel: str) -> list[dict[str, Any]]:
    """The message of an open gate: what, who may answer, until when, and the buttons it offers (none where
    nobody may click them: a thread whose gate goes to an approver channel elsewhere)."""
    words = [w for w in BUTTONS if w in (decisions.ALLOW, decisions.REJECT) or w in gate.scopes]
    buttons = []
    for word in words:
        button: dict[str, Any] = {"type": "button", "text": {"type": "plain_text", "text": BUTTONS[word]},
                                  "action_id": ACTION + word, "value": gate.gate_id}
        if word in (decisions.ALLOW, decisions.REJECT):
            button["style"] = "primary" if word == decisions.ALLOW else "danger"
        buttons.append(button)
    context = f"May answer: {gate.who} · unanswered by {_when(gate.deadline)} it is rejected"
    blocks = [*describe(gate, channel), {"type": "context", "elements": [{"type": "mrkdwn", "text": context}]}]
    if answerable_in(gate, channel):
        blocks.append({"type": "actions", "block_id": ACTION + gate.gate_id, "elements": buttons})
    return blocks


def outcome(gate: approvals.RoutedGate | None, closing: approvals.Closing) -> str:
    """`✅ Allowed once by <@U1> at …`, `⌛ No answer within 300 s: rejected`."""
    if closing.decision == approvals.TIMEOUT:
        within = f"within {gate.deadline - gate.raised_at:g} s" if gate is not None else "in time"
        return f"⌛ No answer {within}: rejected ({_when(closing.at)})"
    if closing.decision == decisions.TIMED:
        head = f"✅ Allowed for {closing.minutes or decisions.DEFAULT_MINUTES} min"
    else:
        head = OUTCOMES.get(closing.decision, escape(closing.decision))
    if closing.decision == approvals.ABANDONED:
        return f"{head} ({_when(closing.at)})"
    return f"{head} by {_who(closing.by)} at {_when(closing.at)}"


def closed_blocks(gate: approvals.RoutedGate, closing: approvals.Closing, channel: str) -> list[dict[str, Any]]:
    return [*describe(gate, channel), {"type": "context", "elements": [{"type": "mrkdwn",
                                                                         "text": outcome(gate, closing)}]}]


def fallback(gate: approvals.RoutedGate) -> str:
    """The notification text (phones and screen readers show it, not the blocks)."""
    return f"🔐 Approval needed: {escape(gate.headline())}"[:300]


def notify(gate: approvals.RoutedGate) -> str:
    """The text of a new gate message: the headline and the Slack approvers @-mentioned (their phones ring)."""
    users = " ".join(f"<@{u}>" for u in _approvers(gate, approvals.SLACK)[:20])
    return f"{fallback(gate)}" + (f" · {users}" if users else "")


@dataclass(frozen=True)
class _Click:
    """What a `block_actions` payload says: which button of which gate, who clicked, where; `problem` says
    why it cannot be a click on one of our buttons (then it decides nothing)."""

    word: str = ""
    gate_id: str = ""
    user: str = ""
    channel: str = ""
    thread_ts: str | None = None
    problem: str = ""

    @classmethod
    def of(cls, payload: dict[str, Any]) -> _Click:
        def part(name: str) -> dict[str, Any]:
            value = payload.get(name)
            return value if isinstance(value, dict) else {}

        user = part("user").get("id")
        user = user if isinstance(user, str) and len(user) <= 40 else ""
        channel = part("channel").get("id") or part("container").get("channel_id")
        channel = channel if isinstance(channel, str) and len(channel) <= 40 else ""
        thread_ts = part("message").get("thread_ts") or part("container").get("thread_ts")
        thread_ts = str(thread_ts)[:40] if isinstance(thread_ts, str | int | float) else None
        actions = payload.get("actions")
        action = actions[0] if isinstance(actions, list) and actions and isinstance(actions[0], dict) else {}
        action_id, value = action.get("action_id"), action.get("value")
        gate_id = value if isinstance(value, str) else ""
        word = action_id[len(ACTION):] if isinstance(action_id, str) and action_id.startswith(ACTION) else ""
        base = cls(word, gate_id[:GATE_ID_CHARS], user, channel, thread_ts)
        kind = payload.get("type")
        if kind != "block_actions":
            return dataclasses.replace(base, problem=f"malformed: a {str(kind)[:40]!r} payload is no button click")
        if not action:
            return dataclasses.replace(base, problem="malformed: no button in the click")
        if word not in decisions.DECISIONS:
            return dataclasses.replace(base, problem=f"malformed: {str(action_id)[:60]!r} is not a gate button")
        if not gate_id or len(gate_id) > GATE_ID_CHARS:
            return dataclasses.replace(base, problem="malformed: the button names no gate id")
        if not user:
            return dataclasses.replace(base, problem="malformed: the click names no user")
        return base


class SlackApprovals:
    """Posts routed gates to Slack and turns button clicks into answers (one per plugin instance)."""

    def __init__(self, rt: plugin_api.PluginContext, web: WebClient):
        self.ctx, self.web = rt, web
        desk = rt.gate.desk
        assert desk is not None
        self.desk = desk
        self.feed = desk.watch()  # from now on: gates raised while the plugin starts are not missed
        self.posted: OrderedDict[str, _Posted] = OrderedDict()
        self.clicks: set[asyncio.Task[None]] = set()
        self.stats: dict[str, int] = {"posted": 0, "clicks": 0, "refused": 0, "late": 0, "forged": 0,
                                      "answered": 0}

    # ── the feed ──

    async def run(self) -> None:
        """Follow the approver feed until the server stops (if reading it fails, it is read again: the open
        gates come first, and those already posted are not posted again)."""
        while True:
            try:
                async for ev in self.feed:
                    await self._handle(ev)
                return
            except Exception as exc:  # e.g. Redis unreachable: serve again once it is back
                logger.warning("slack: the approver feed failed (%s); reading it again in %g s", _why(exc), RETRY)
            await asyncio.sleep(RETRY)
            self.feed = self.desk.watch()

    async def _handle(self, ev: approvals.FeedEvent) -> None:
        try:
            if ev.name == approvals.OPENED and ev.gate is not None:
                await self._opened(ev.gate)
            elif ev.name == approvals.CLOSED and ev.closing is not None:
                self._closed(ev.closing)
        except Exception:  # one gate's trouble never stops the feed
            logger.exception("slack: handling an approval event failed")

    async def _opened(self, gate: approvals.RoutedGate) -> None:
        where = targets(gate)
        if not where or gate.gate_id in self.posted:
            return
        if self.ctx.values is not None and not await self.ctx.values.put(
                f"slack-gate:{gate.gate_id}", "1", max(1.0, gate.deadline - time.time()) + CLAIM_MARGIN,
                only_new=True):
            return  # another instance posts it
        entry = _Posted(gate)
        entry.task = asyncio.create_task(self._post_all(entry, where), name=f"slack-gate:{gate.gate_id[:8]}")
        self.posted[gate.gate_id] = entry
        while len(self.posted) > KEPT:
            self.posted.popitem(last=False)

    async def _post_all(self, entry: _Posted, where: list[tuple[str, str | None]]) -> None:
        gate = entry.gate
        for channel, thread_ts in where:
            try:
                in_thread: dict[str, Any] = {"thread_ts": thread_ts} if thread_ts else {}
                resp = await asyncio.to_thread(
                    self.web.chat_postMessage, channel=channel, text=notify(gate),
                    blocks=open_blocks(gate, channel), unfurl_links=False, unfurl_media=False, **in_thread)
            except Exception as exc:
                logger.warning("slack: posting gate %s in %s failed: %s", gate.gate_id[:8], channel, _why(exc))
                continue
            entry.messages.append((str(resp.get("channel") or channel), str(resp.get("ts") or "")))
            self.stats["posted"] += 1

    def _closed(self, closing: approvals.Closing) -> None:
        entry = self.posted.get(closing.gate_id)
        if entry is not None:
            task = asyncio.create_task(self._edit_closed(entry, closing), name=f"slack-gate-done:{closing.gate_id[:8]}")
            self.clicks.add(task)
            task.add_done_callback(self.clicks.discard)

    async def _edit_closed(self, entry: _Posted, closing: approvals.Closing) -> None:
        if entry.task is not None:
            await asyncio.wait([entry.task])  # the posts first, then their edits
        for channel, ts in entry.messages:
            text = f"{fallback(entry.gate)}: {outcome(entry.gate, closing)}"[:300]
            try:
                await asyncio.to_thread(self.web.chat_update, channel=channel, ts=ts, text=text,
                                        blocks=closed_blocks(entry.gate, closing, channel))
            except Exception as exc:
                logger.warning("slack: updating gate %s in %s failed: %s", closing.gate_id[:8], channel, _why(exc))

    # ── clicks ──

    def on_interactive(self, payload: Any) -> bool:
        """An acked `interactive` envelope, handled in a task (always True): this app's only interactive
        elements are gate buttons, so anything else (another payload type, a malformed click) is refused there."""
        task = asyncio.create_task(self._click(payload if isinstance(payload, dict) else {}),
                                   name="slack-gate-click")
        self.clicks.add(task)
        task.add_done_callback(self.clicks.discard)
        return True

    async def _click(self, payload: dict[str, Any]) -> None:
        self.stats["clicks"] += 1
        click = _Click.of(payload)
        try:
            if click.problem:
                await self._refuse(click, click.problem, "⛔ This click was not understood; nothing was changed.")
                return
            await self._answer(click)
        except plugin_api.SessionError as exc:  # the shared store is unreachable: said there, once
            logger.warning("slack: a gate button click was not handled (%s); the gate is unchanged", exc)
        except Exception:  # a bug: the gate is unchanged
            logger.exception("slack: a gate button click was not handled")

    async def _answer(self, click: _Click) -> None:
        gate_id, user, channel, word = click.gate_id, click.user, click.channel, click.word
        gate, _ = await self.desk.get(gate_id)
        if gate is None and gate_id in self.posted:  # closed already: what it was is still known here
            gate = self.posted[gate_id].gate
        through = "slack"
        if gate is not None and channel in _approvers(gate, approvals.SLACK_CHANNEL):
            through = f"{approvals.SLACK_CHANNEL}:{channel}"
        try:
            result = await self.ctx.gate.answer(
                gate_id, word, answerer=approvals.Approver(approvals.SLACK, user), channel=through,
                minutes=decisions.DEFAULT_MINUTES if word == decisions.TIMED else None)
        except plugin_api.ScopeError:  # a gate of another session, not routed here: refused (and audited) there
            self.stats["forged"] += 1
            logger.warning("slack: a click of %s named gate %s, which is not routed to Slack; refused", user,
                           gate_id[:12])
            await self._tell(channel, user, click.thread_ts, "⛔ That button does not belong to a gate you can "
                                                             "answer here; nothing was changed.")
            return
        except (ValueError, approvals.ApprovalError) as exc:
            await self._tell(channel, user, click.thread_ts, f"Not answered: {exc}")
            return
        if result.answered:
            self.stats["answered"] += 1
            return  # the CLOSED event edits the message
        if result.outcome == approvals.NOT_APPROVER:  # (audited by the gate keeper)
            self.stats["refused"] += 1
            may = ", ".join(_who(a) for a in result.approvers if not a.startswith(approvals.SLACK_CHANNEL)) or \
                "members of the approver channel"
            await self._tell(channel, user, click.thread_ts, "⛔ You are not an approver of this gate; nothing was "
                                                             f"changed. It may be answered by: {may}.")
        elif result.outcome == approvals.DECIDED and result.first is not None:
            await self._refuse(click, f"stale: the gate was closed already ({result.first.describe()})",
                               f"Already answered: {outcome(gate, result.first)}.", late=True)
        else:
            await self._refuse(click, "stale or forged: no such gate is pending", escape(approvals.explain(result)),
                               late=True)

    async def _refuse(self, click: _Click, why: str, told: str, *, late: bool = False) -> None:
        """A click that decides nothing: one log line, an audit record, and the clicker told (when Slack said
        who and where)."""
        self.stats["late" if late else "forged"] += 1
        logger.log(logging.INFO if late else logging.WARNING, "slack: a gate button click of %s refused: %s",
                   click.user[:40] or "an unnamed user", why)
        await self.ctx.gate.refused(click.gate_id, f"{approvals.SLACK}:{click.user[:40] or '?'}",
                                    click.channel[:40] or "slack", f"refused: {why}")
        if click.user:
            await self._tell(click.channel, click.user, click.thread_ts, told)

    async def _tell(self, channel: str, user: str, thread_ts: str | None, text: str) -> None:
        """An ephemeral message: only the clicking user sees it."""
        if not channel:
            return
        with contextlib.suppress(Exception):
            in_thread: dict[str, Any] = {"thread_ts": thread_ts} if thread_ts else {}
            await asyncio.to_thread(self.web.chat_postEphemeral, channel=channel, user=user, text=text, **in_thread)

    async def stop(self) -> None:
        tasks = [t for t in (*self.clicks, *(e.task for e in self.posted.values())) if t is not None and not t.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=3)


def _why(exc: BaseException) -> str:
    response = getattr(exc, "response", None)
    if response is not None and hasattr(response, "get"):
        return f"Slack answered {response.get('error', 'an error')!r}"
    return f"{type(exc).__name__}: {exc}"
