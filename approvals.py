"""Approvals: the gates of client classes that cannot answer them, routed to the people the operator named.

Without an `approvals` section in plugins-enabled.json nothing here runs and every class behaves as the
spec says (proxy, Slack, swarm: refused at once; API: its 2 s window). With one, a gate raised by a
session whose class (and tool, and tables) has approvers waits for one of them, up to the configured
time (docs/approvals.md):

- `ApprovalRules` reads the section (`route`: who may answer one gate, and how long it waits);
- `ApprovalDesk` keeps the routed gates (in Redis with several instances), publishes them on the
  approver feed (the hub channel `FEED`: `approval` when one opens, `approval_closed` when it is
  decided or times out), decides who may answer (`admits`), and lets only the first answer count
  (`claim`: later answerers learn who was first);
- approver front-ends (shell windows with `!approver on`, Slack, the API's admin key, human MCP tokens)
  subscribe with `ApprovalDesk.watch()` and answer with `GateKeeper.answer(..., answerer=Approver(...))`.

docs/approvals.md and APPROVALS_INTERFACE.md describe the feed and the answer results for front-ends.
"""

from __future__ import annotations

import json
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import audit_log
import decisions
import events
import grants
import shared_gates
from config import ApprovalsConfig, Approvers, ClassApprovers, ConfigError

logger = logging.getLogger("agent_mcp.approvals")

#: The hub channel of the approver feed ('#' is in no client id, so no client can publish or read it as a session).
FEED = "#approvals"
#: Feed event names: a routed gate opened; it was decided, timed out or abandoned.
OPENED, CLOSED = "approval", "approval_closed"

#: Approver kinds. A gate's approver list holds SLACK users, a SLACK_CHANNEL, SHELL `*` (windows that opted
#: in), MCP token names and API `admin`; an answer comes from a SLACK user, a SHELL window, an MCP token or API.
SLACK, SLACK_CHANNEL, SHELL, MCP, API = "slack", "slack-channel", "shell", "mcp", "api"
KINDS = (SLACK, SLACK_CHANNEL, SHELL, MCP, API)
ANY_WINDOW, ADMIN = "*", "admin"

#: What an answer attempt came to (AnswerResult.outcome).
ANSWERED, NOT_APPROVER, DECIDED, UNKNOWN = "answered", "not_approver", "decided", "unknown"
#: Closing words besides the decision words of decisions.DECISIONS: nobody answered in time; the turn ended first.
TIMEOUT, ABANDONED = "timeout", "abandoned"

#: How long `!approver on` lasts without being renewed (the shell renews it when it reconnects).
WINDOW_SECONDS = 12 * 3600.0
#: Closed gates kept on one instance for late answerers.
KEPT_CLOSED = 4096
#: Longest text of one argument value in a gate's description.
ARG_CHARS = 300


class ApprovalError(ValueError):
    """An answer or an approver identity that is not well formed; the message says what to send instead."""


@dataclass(frozen=True, order=True)
class Approver:
    """Someone who may answer a routed gate, or who did: `kind` (KINDS) and `id`, written `kind:id`."""

    kind: str
    id: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ApprovalError(f"approver kind must be one of {', '.join(KINDS)}, not {self.kind!r}")
        if not self.id or len(self.id) > 128:
            raise ApprovalError("an approver needs an id of 1 to 128 characters")

    def __str__(self) -> str:
        return f"{self.kind}:{self.id}"

    @classmethod
    def parse(cls, text: str) -> Approver:
        """`slack:U123` → Approver("slack", "U123")."""
        kind, sep, ident = text.partition(":")
        if not sep:
            raise ApprovalError(f"an approver is written kind:id (e.g. slack:U0123ABCD), not {text[:60]!r}")
        return cls(kind, ident)

    def label(self) -> str:
        """How the requester is told who may answer."""
        return {SLACK: f"Slack user <@{self.id}>", SLACK_CHANNEL: f"Slack channel <#{self.id}>",
                SHELL: "shell approvers" if self.id == ANY_WINDOW else f"shell window {self.id}",
                MCP: f"MCP token '{self.id}'", API: "the API admin key"}[self.kind]


def approvers_of(entry: Approvers) -> frozenset[Approver]:
    """The approver list one config entry names."""
    found = {Approver(SLACK, u) for u in entry.slack_users} | {Approver(MCP, n) for n in entry.mcp_tokens}
    if entry.slack_channel:
        found.add(Approver(SLACK_CHANNEL, entry.slack_channel))
    if entry.shell:
        found.add(Approver(SHELL, ANY_WINDOW))
    if entry.api_admin:
        found.add(Approver(API, ADMIN))
    return frozenset(found)


@dataclass(frozen=True)
class Route:
    """Where one gate goes: who may answer it, and how long it waits."""

    approvers: tuple[Approver, ...]
    timeout: float

    def who(self) -> str:
        """The approvers, as the requester reads them."""
        return ", ".join(a.label() for a in self.approvers)

    def admits(self, answerer: Approver, channel: str = "") -> bool:
        """Whether `answerer`, answering through `channel`, is one of this gate's approvers. A shell window
        counts when shell approvers are (the desk checks that it opted in); a Slack user answering in the
        approver channel counts when the route names that channel and no Slack users."""
        listed = set(self.approvers)
        if answerer in listed:
            return True
        if answerer.kind == SHELL:
            return answerer.id != ANY_WINDOW and Approver(SHELL, ANY_WINDOW) in listed
        if answerer.kind == SLACK and channel.startswith(SLACK_CHANNEL + ":"):
            users = [a for a in listed if a.kind == SLACK]
            return not users and Approver(SLACK_CHANNEL, channel.split(":", 1)[1]) in listed
        return False


class ApprovalRules:
    """The `approvals` section, checked against the client classes: `route` says where a gate goes."""

    def __init__(self, config: ApprovalsConfig, classes: Iterable[str], interactive: Iterable[str] = ()):
        known, own = list(classes), set(interactive)
        for name in config.classes:
            where = f"plugins-enabled.json: field 'approvals.classes.{name}'"
            if name not in known:
                raise ConfigError(f"{where}: not a client class; the classes are "
                                  f"{', '.join(k for k in known if k not in own)}")
            if name in own:
                raise ConfigError(f"{where}: {name} sessions are answered by their own user (their window shows "
                                  "the gate); remove this entry")
        self.config = config

    @property
    def configured(self) -> bool:
        return bool(self.config.classes)

    def route(self, kind: str, tool: str, section: str, keys: Iterable[str]) -> Route | None:
        """Who answers a gate of client class `kind` on `tool` (a `db` gate: on tables `keys`), or None when
        nobody (then the class's own behaviour applies). A table's entry beats the tool's, which beats the
        class's; a statement on several tables goes only to approvers of every one, and waits the shortest
        of their times."""
        entry = self.config.classes.get(kind)
        if entry is None:
            return None
        chosen = [self._entry(entry, tool, section, k) for k in (keys if section == "db" else [tool])] or [entry]
        people = frozenset.intersection(*(approvers_of(e) for e in chosen))
        if not people:
            return None
        timeout = min(e.timeout_seconds or self.config.timeout_seconds for e in chosen)
        return Route(tuple(sorted(people)), timeout)

    @staticmethod
    def _entry(entry: ClassApprovers, tool: str, section: str, key: str) -> Approvers:
        if section == "db":
            table = entry.tables.get(key) or next((v for k, v in entry.tables.items() if k.lower() == key.lower()),
                                                  None)
            if table is not None:
                return table
        return entry.tools.get(tool) or entry


# ── What travels on the feed ────────────────────────────────────────────────────────────────


def trimmed(args: dict[str, Any]) -> dict[str, Any]:
    """A tool call's arguments for a person to read: long values cut to ARG_CHARS characters."""
    out: dict[str, Any] = {}
    for key, value in list(args.items())[:20]:
        text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
        out[str(key)[:60]] = text if len(text) <= ARG_CHARS else text[:ARG_CHARS] + "…"
    return out


@dataclass
class RoutedGate:
    """A gate routed to approvers, as the feed's `approval` event carries it (`to_dict`)."""

    gate_id: str
    session: str
    client_class: str
    client_label: str
    tool: str
    op: str
    tables: list[str]
    #: The SQL shape (values replaced by ?) of a db gate, else the trimmed arguments as JSON.
    summary: str
    args: dict[str, Any]
    #: Decision words this gate accepts besides allow and reject (decisions.GRANT_SCOPES it offers).
    scopes: list[str]
    raised_at: float
    deadline: float
    approvers: list[str]
    who: str
    turn: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RoutedGate:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})

    def route(self) -> Route:
        return Route(tuple(Approver.parse(a) for a in self.approvers), self.deadline - self.raised_at)

    def headline(self) -> str:
        """One line: `db_query (UPDATE users SET a = ? …)`."""
        what = self.summary if len(self.summary) <= 80 else self.summary[:79] + "…"
        return f"{self.tool} ({what})" if what else self.tool


@dataclass
class Closing:
    """How a routed gate ended (the feed's `approval_closed` event): `decision` is a decisions.DECISIONS word,
    TIMEOUT or ABANDONED; `by` the approver (`kind:id`) and `channel` what they answered through."""

    gate_id: str
    decision: str
    by: str = ""
    channel: str = ""
    at: float = field(default_factory=time.time)
    minutes: int | None = None
    waited: float = 0.0
    session: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Closing:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})

    def describe(self) -> str:
        """`allow by slack:U1 (slack) at 14:02:11`, `timeout at …`."""
        by = f" by {self.by}" + (f" ({self.channel})" if self.channel else "") if self.by else ""
        return f"{self.decision}{by} at {time.strftime('%H:%M:%S', time.localtime(self.at))}"


@dataclass(frozen=True)
class AnswerResult:
    """What an answer came to: ANSWERED (it decides the gate), NOT_APPROVER (refused, nothing changed;
    `approvers` says who may), DECIDED (someone answered first, or it timed out: `first` says who, how,
    when), UNKNOWN (no such gate pending: never existed, or its record is gone)."""

    outcome: str
    gate_id: str
    first: Closing | None = None
    approvers: tuple[str, ...] = ()

    @property
    def answered(self) -> bool:
        return self.outcome == ANSWERED


def explain(result: AnswerResult) -> str:
    """What an answer that did not decide its gate is told (the same words on every channel)."""
    if result.outcome == NOT_APPROVER:
        return (f"not an approver of this gate: it is answered by {', '.join(result.approvers)} "
                "(plugins-enabled.json approvals); nothing was changed")
    if result.outcome == DECIDED and result.first is not None:
        if result.first.decision == TIMEOUT:
            return "this gate timed out (rejected) before the answer came"
        if result.first.decision == ABANDONED:
            return "this gate is closed: its turn ended before an answer came"
        return f"this gate was already answered: {result.first.describe()}"
    return f"no pending gate '{result.gate_id[:64]}': it was answered, timed out or never existed"


@dataclass(frozen=True)
class FeedEvent:
    """One event of the approver feed: `name` OPENED (`gate`) or CLOSED (`closing`)."""

    name: str
    gate: RoutedGate | None = None
    closing: Closing | None = None


async def on_the_wire(feed: AsyncIterator[FeedEvent]) -> AsyncIterator[tuple[str, dict[str, Any]]]:
    """A desk's feed as (event name, JSON data) pairs, for an SSE response (the data are `to_dict()`s)."""
    async for ev in feed:
        item = ev.gate if ev.gate is not None else ev.closing
        if item is not None:
            yield ev.name, item.to_dict()


def audit_detail(gate: RoutedGate, closing: Closing) -> str:
    """The audit record's `detail` of a routed gate's decision (audit_log.routed_detail)."""
    return audit_log.routed_detail(gate.approvers, gate.client_class, closing.by, closing.channel, closing.waited)


# ── The desk ────────────────────────────────────────────────────────────────────────────────


class ApprovalDesk:
    """The routed gates of this instance (and, on Redis, of every instance), and their feed."""

    def __init__(self, rules: ApprovalRules, hub: events.EventHub, store: shared_gates.SharedApprovals | None = None,
                 clock: Callable[[], float] = time.time):
        self.rules = rules
        self.hub = hub
        self.store = store
        self.clock = clock
        self._open: dict[str, RoutedGate] = {}
        self._closings: OrderedDict[str, Closing] = OrderedDict()
        self._windows: dict[str, float] = {}

    def route(self, kind: str, tool: str, section: str, keys: Iterable[str]) -> Route | None:
        return self.rules.route(kind, tool, section, keys)

    async def open(self, gate: RoutedGate) -> None:
        """Record a routed gate and announce it on the feed."""
        self._open[gate.gate_id] = gate
        if self.store is not None:
            await self.store.add(gate.gate_id, json.dumps(gate.to_dict(), ensure_ascii=False), gate.deadline)
        self.hub.publish(FEED, OPENED, gate.to_dict())

    async def get(self, gate_id: str) -> tuple[RoutedGate | None, Closing | None]:
        """(the gate, its closing) on any instance; (None, None) for a gate that was not routed."""
        if gate_id in self._open or gate_id in self._closings:
            return self._open.get(gate_id), self._closings.get(gate_id)
        if self.store is None:
            return None, None
        described, closed = await self.store.get(gate_id)
        return (RoutedGate.from_dict(json.loads(described)) if described else None,
                Closing.from_dict(json.loads(closed)) if closed else None)

    async def claim(self, closing: Closing) -> tuple[bool, Closing | None]:
        """Make `closing` the gate's outcome if nothing decided it yet: (True, None); else (False, the first
        outcome), or (False, None) for a gate that is not known (not routed, or its record is gone)."""
        gate_id = closing.gate_id
        if self.store is not None:
            won, first = await self.store.claim(gate_id, json.dumps(closing.to_dict(), ensure_ascii=False))
            if won:
                self._keep(closing)
            return won, Closing.from_dict(json.loads(first)) if first else None
        if gate_id in self._closings:
            return False, self._closings[gate_id]
        if gate_id not in self._open:
            return False, None
        self._keep(closing)
        return True, None

    def _keep(self, closing: Closing) -> None:
        self._closings[closing.gate_id] = closing
        while len(self._closings) > KEPT_CLOSED:
            self._closings.popitem(last=False)

    async def close(self, gate: RoutedGate, closing: Closing) -> None:
        """The gate is over (its turn has the decision): off the open list, and the feed says how it ended."""
        self._open.pop(gate.gate_id, None)
        if gate.gate_id not in self._closings:
            self._keep(closing)
        if self.store is not None:
            await self.store.closed(gate.gate_id)
        self.hub.publish(FEED, CLOSED, closing.to_dict())

    async def admits(self, gate: RoutedGate, answerer: Approver | None, channel: str) -> bool:
        """Whether `answerer` may answer `gate` (a shell window only while it has opted in)."""
        if answerer is None or not gate.route().admits(answerer, channel):
            return False
        return answerer.kind != SHELL or await self.is_window(answerer.id)

    async def pending(self) -> list[RoutedGate]:
        """The routed gates still open (of every instance on Redis), soonest deadline first."""
        now = self.clock()
        if self.store is not None:
            found = [RoutedGate.from_dict(json.loads(g)) for g in await self.store.open_ones()]
        else:
            found = list(self._open.values())
        return sorted((g for g in found if g.deadline > now), key=lambda g: g.deadline)

    def watch(self) -> AsyncGenerator[FeedEvent, None]:
        """The approver feed from this call on: every open routed gate first (as OPENED events), then every
        event as it comes. A front-end shows a gate on OPENED and takes it away on CLOSED (`closing` says who
        decided); the feed ends when the server stops."""
        return self._watch(self.hub.last_id(FEED))

    async def _watch(self, mark: int) -> AsyncGenerator[FeedEvent, None]:
        told = set()
        for gate in await self.pending():
            told.add(gate.gate_id)
            yield FeedEvent(OPENED, gate=gate)
        async for ev in self.hub.subscribe(FEED, last_event_id=mark):
            if ev.name == OPENED and ev.data.get("gate_id") not in told:
                yield FeedEvent(OPENED, gate=RoutedGate.from_dict(ev.data))
            elif ev.name == CLOSED:
                told.discard(ev.data.get("gate_id"))
                yield FeedEvent(CLOSED, closing=Closing.from_dict(ev.data))

    def wire(self) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        """`watch()` as (event name, JSON data) pairs, for an SSE response (`on_the_wire`)."""
        return on_the_wire(self.watch())

    # ── shell windows that approve ──

    async def set_window(self, window: str, on: bool) -> None:
        """A shell window opts in (`!approver on`) or out; it lasts WINDOW_SECONDS unless renewed."""
        if self.store is not None:
            await self.store.set_window(window, on, WINDOW_SECONDS)
        now = self.clock()
        self._windows = {w: until for w, until in self._windows.items() if until > now}
        if on:
            self._windows[window] = now + WINDOW_SECONDS
        else:
            self._windows.pop(window, None)

    async def is_window(self, window: str) -> bool:
        """Whether shell window `window` has opted in (on any instance)."""
        if self.store is not None:
            return await self.store.window(window)
        return self._windows.get(window, 0) > self.clock()


# ── The steps of a routed gate (called by gate.GateKeeper.ask / answer) ─────────────────────


async def opening(desk: ApprovalDesk, hub: events.EventHub, gate: RoutedGate, gate_id: str, seconds: float) -> None:
    """Put a gate on the feed and tell its requester who it waits for."""
    gate.gate_id, gate.raised_at = gate_id, desk.clock()
    gate.deadline = gate.raised_at + seconds
    await desk.open(gate)
    hub.publish(gate.session, "status", {
        "text": f"[gate ⏳] {gate.headline()}: waiting for approval by {gate.who} (up to {seconds:g} s)",
        "gate_id": gate_id, "waiting_for": gate.who, "approvers": gate.approvers})


def answered(gate: RoutedGate, word: str, by: str, channel: str, minutes: int | None = None) -> Closing:
    """The closing an approver's answer would make."""
    now = time.time()
    return Closing(gate.gate_id, word, by, channel, now, minutes if word == decisions.TIMED else None,
                   max(0.0, now - gate.raised_at), gate.session)


async def timed_out(desk: ApprovalDesk, gate: RoutedGate) -> grants.Decision | None:
    """Claim the timeout; when an answer was claimed first (on any instance), that answer as a decision."""
    won, first = await desk.claim(answered(gate, TIMEOUT, "", ""))
    if won or first is None or first.decision not in decisions.DECISIONS:
        return None
    return grants.Decision(first.decision, first.by, first.minutes or decisions.DEFAULT_MINUTES)


async def closing(desk: ApprovalDesk, gate: RoutedGate) -> Closing:
    """The gate's turn has its decision (or was cancelled: ABANDONED): close it on the feed; how it closed."""
    final = answered(gate, ABANDONED, "", "")
    try:
        won, first = await desk.claim(final)
        final = first if not won and first is not None else desk._closings.get(gate.gate_id) or final
        await desk.close(gate, final)
    except Exception:  # the turn goes on; the gate expires on its own
        logger.exception("closing routed gate %s failed", gate.gate_id)
    return final
