"""What a shell.py window shows, and the keys it reads while busy: the gate panel, the answer streaming live,
the countdown of a waiting gate, and ``ShellUI``, which draws stream events and turns keys into gate
decisions. It never reads the terminal: tests feed it events and keys directly."""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable
from typing import Any

from rich.console import Console, ConsoleOptions, Group, RenderResult
from rich.live import Live
from rich.markdown import Markdown
from rich.panel import Panel
from rich.segment import Segment
from rich.table import Table
from rich.text import Text

from decisions import ALLOW, DEFAULT_MINUTES, PATTERN, REJECT, SESSION, TIMED
from shell_client import RequestRejected, ServerOffline, ShellClient, ShellError, ShellEvent, approval_gate

DEFAULT_GATE_PREVIEW = 200


def format_gate_args(tool_args: Any) -> str:
    """The tool arguments of a gate as ``key: value`` lines, without ``operation_type``."""
    if not isinstance(tool_args, dict):
        return str(tool_args)
    lines = []
    for key, value in tool_args.items():
        if key == "operation_type":
            continue
        shown = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        lines.append(f"{key}: {shown}")
    return "\n".join(lines)


_TABLE_LABELS = {
    "__meta__": "(metadata: SHOW/DESCRIBE)",
    "*": "* (any table: the statement could not be fully analysed)",
}


#: How a gate's operation is shown: ddl is named for what it allows (write never covers it).
_OPERATION_LABELS = {"ddl": "ddl (CREATE/DROP/ALTER/RENAME/TRUNCATE: changes the schema; write does not cover it)"}


def gate_panel(gate: dict[str, Any], preview_length: int, seconds_left: float | None = None) -> Panel:
    """The panel asking the user about one gate; arguments cut to ``preview_length`` characters."""
    tool_args = gate.get("tool_args") or {}
    operation = (
        str(tool_args.get("operation_type") or "unknown") if isinstance(tool_args, dict) else "unknown"
    )
    tables = [str(t) for t in gate.get("tables") or []]
    shown_tables = ", ".join(_TABLE_LABELS.get(t, t) for t in tables)
    args = format_gate_args(tool_args)
    truncated = len(args) > preview_length
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column()
    grid.add_row("Tool", Text(str(gate.get("tool_name", "?")), style="bold cyan"))
    grid.add_row("Operation", Text(_OPERATION_LABELS.get(operation, operation),
                                   style="green" if operation == "read" else "bold red"))
    grid.add_row("Tables", Text(shown_tables or "—"))
    grid.add_row("Arguments", Text((args[:preview_length] + "…") if truncated else (args or "(none)")))
    if truncated:
        note = f"(first {preview_length} of {len(args)} characters — press v to show all)"
        grid.add_row("", Text(note, style="dim"))
    if seconds_left is not None:
        grid.add_row(
            "Time left", Text(f"{math.ceil(seconds_left)} s, then the server rejects it", style="yellow")
        )
    if gate.get("shape"):
        grid.add_row("Shape", Text(str(gate["shape"]), style="dim"))  # what p (allow this shape) would allow
    asked = gate.get("elicitation") if isinstance(gate.get("elicitation"), dict) else None
    labels = {**_KEY_LABELS, **(_ASK_LABELS if asked else {})}
    parts: list[Any] = []
    for key in gate_keys(gate):
        parts += [(f"[{key}]", "bold red" if key == "r" else "bold green"), f" {labels[key]}   "]
    keys = Text.assemble(*parts, *((("[v]", "bold"), " show all arguments") if truncated else ()))
    title = f"❓ MCP server '{asked.get('server')}' asks" if asked else "⚠ the agent asks to run a tool"
    return Panel(
        Group(grid, Text(""), keys),
        title=f"⚖ approval asked for session {gate.get('session')} ({gate.get('client_label')})" if gate.get(
            "routed") else title,
        title_align="left",
        border_style="yellow",
        expand=False,
    )


def _render_answer(text: str, plain: bool) -> Text | Markdown:
    """Model answers are Markdown; command output is shown as it is (line breaks, `<ID>` and all)."""
    return Text(text) if plain else Markdown(text)


class _LiveAnswer:
    """The answer so far, cut to its last lines so the newest text stays in view."""

    def __init__(self, parts: list[str], plain: bool) -> None:
        self.parts, self.plain = parts, plain

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        lines = console.render_lines(
            _render_answer("".join(self.parts), self.plain), options.update(height=None), pad=False
        )
        keep = max(1, console.size.height - 2)
        for line in lines[-keep:]:
            yield from line
            yield Segment.line()


class _Countdown:
    """One line showing how long a gate still waits."""

    def __init__(self, deadline: float, tool: str, keys: list[str]) -> None:
        self.deadline, self.tool, self.keys = deadline, tool, keys

    def __rich__(self) -> Text:
        left = max(0, math.ceil(self.deadline - time.monotonic()))
        return Text(f"⏳ {left} s left to answer {self.tool}: {' / '.join(self.keys)}", style="yellow")


#: The keys that answer a gate; t (allow for a while) asks for the default minutes.
_GATE_KEYS = {"a": ALLOW, "t": TIMED, "s": SESSION, "p": PATTERN, "r": REJECT}
_KEY_LABELS = {"a": "allow once", "t": f"allow for {DEFAULT_MINUTES} min", "s": "allow for this session",
               "p": "allow this shape", "r": "reject"}
#: The keys of an MCP server's question (an elicitation, docs/approvals.md): values go by /gate_response `content`.
_ASK_LABELS = {"a": "yes (the form's defaults)", "r": "no (decline)"}
_DECISION_LINES = {
    ALLOW: ("✓ allowed once — {tool} proceeds", "green"),
    TIMED: (f"✓ allowed for {DEFAULT_MINUTES} min (!grants to see or revoke) — {{tool}} proceeds", "green"),
    SESSION: ("✓ allowed for this session (!grants to see or revoke) — {tool} proceeds", "green"),
    PATTERN: ("✓ allowed for calls of this shape (!grants to see or revoke) — {tool} proceeds", "green"),
    REJECT: ("✗ rejected — {tool} is blocked", "red"),
}


def gate_keys(gate: dict[str, Any]) -> list[str]:
    """The keys that answer `gate`: allow once and reject always, the grants the server offers for it."""
    offered = gate.get("grants")
    offered = offered if isinstance(offered, list) else [SESSION]  # a server from before grants
    return [k for k, d in _GATE_KEYS.items() if d in (ALLOW, REJECT) or d in offered]


class ShellUI:
    """Draws stream events on a rich Console and turns single keys into gate decisions.

    Feed it events with handle_event() and keys with handle_key() ("a", "s", "r", "v", "c-c");
    it never reads the terminal. Call begin_turn() before submitting: the turn's answer then
    streams live (on a terminal console) until its ``done``. Events that arrive outside a turn are
    printed when complete. ``busy`` is true while a turn runs or a gate waits for its key;
    ``on_attention()`` is called when a gate (or a fatal error) arrives while no turn is active.
    """

    def __init__(
        self,
        console: Console,
        client: ShellClient,
        *,
        gate_preview_length: int = DEFAULT_GATE_PREVIEW,
        on_attention: Callable[[], None] | None = None,
    ) -> None:
        self.console = console
        self.client = client
        self.gate_preview_length = gate_preview_length
        self.on_attention = on_attention
        self.pending_gates: list[dict[str, Any]] = []
        self.fatal: str | None = None
        self._turn = False
        self._plain = False
        self._parts: list[str] = []
        self._live: Live | None = None
        self._live_kind = ""
        self._idle = asyncio.Event()
        self._idle.set()
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self._deadlines: dict[str, float] = {}
        self._hinted = False
        self._connection = "idle"
        self._mine: list[str] = []  # texts this window sent whose `user` event has not come back yet
        self._checking: asyncio.Future[None] | None = None
        #: A turn this window stopped (Ctrl-C): its late events are dropped up to its `done`, so nothing of it
        #: prints after the next prompt.
        self._swallow = False
        #: This window deleted its own session and moves to a new one: the server's notice of it is not shown.
        self.expect_deletion = False

    @property
    def busy(self) -> bool:
        """True while a turn is active or a gate is waiting for a decision."""
        return self.fatal is None and (self._turn or bool(self.pending_gates))

    async def wait_idle(self) -> None:
        """Return once ``busy`` is false."""
        await self._idle.wait()

    def begin_turn(self, plain: bool = False, text: str | None = None) -> None:
        """Mark the start of a turn the user submitted: its answer streams live until ``done``.

        ``plain`` shows the output as it is instead of as Markdown (for ``!command`` output);
        ``text`` is what was sent, which this window already shows (its ``user`` event is not repeated).
        """
        if text is not None:
            self._mine.append(text)
        self._flush()
        self._turn = True
        self._plain = plain
        self._update_idle()

    def end_turn(self) -> None:
        """Mark the turn as over without a ``done`` (the submit failed)."""
        self._flush()
        self._turn = False
        self._update_idle()

    def note(self, message: str, style: str = "dim") -> None:
        """Print one line of the shell's own (never markup-interpreted)."""
        self._flush()
        self.console.print(Text(message, style=style))

    async def handle_event(self, event: ShellEvent) -> None:
        """Draw one stream event; unknown event names are ignored."""
        if self._swallow:  # the rest of a turn this window stopped
            self._swallow = event.name != "done"
            return
        handler = getattr(self, f"_on_{event.name}", None)
        if handler is not None:
            handler(event.data)

    async def handle_key(self, key: str) -> None:
        """React to one key while busy: a/s/r answer the oldest gate, v shows its arguments, c-c stops."""
        if key == "c-c":
            await self.interrupt()
            return
        if not self.pending_gates:
            return
        lowered = key.lower()
        if lowered == "v":
            self._show_full_args(self.pending_gates[0])
        elif lowered in gate_keys(self.pending_gates[0]):
            await self.answer_gate(_GATE_KEYS[lowered])
        elif not self._hinted:
            self._hinted = True
            self.console.print(
                Text(f"waiting for a gate decision: {' / '.join(gate_keys(self.pending_gates[0]))} "
                 "(v shows all arguments)", style="yellow")
            )

    async def answer_gate(self, decision: str) -> None:
        """Send ``decision`` for the oldest pending gate and say so."""
        if not self.pending_gates:
            return
        gate = self.pending_gates.pop(0)
        gate_id = str(gate.get("gate_id", ""))
        self._stop_countdown()
        self._forget_timer(gate_id)
        template, style = _DECISION_LINES[decision]
        try:
            await self.client.gate_response(gate_id, decision, DEFAULT_MINUTES if decision == TIMED else None,
                                            as_approver=bool(gate.get("routed")))
        except RequestRejected as exc:
            self.note(f"the gate is no longer pending ({exc.message})", "yellow")
        except ServerOffline as exc:
            self.pending_gates.insert(0, gate)
            self.note(f"could not send the decision: {exc} — press the key again", "red")
            return
        else:
            self.note(template.format(tool=gate.get("tool_name", "the tool")), style)
        self._hinted = False
        self._next_gate()
        self._update_idle()

    async def interrupt(self) -> None:
        """Ctrl-C: stop the running turn on the server (as chat REPLs do; its answer so far stays on screen, the
        rest never prints); with no turn of ours running, pending gates are rejected so their turn can end."""
        self._flush()
        if not self._turn:
            for _ in range(len(self.pending_gates)):
                await self.answer_gate("reject")
            self._update_idle()
            return
        self._turn = False
        self._drop_gates(None)  # they end with the turn
        self._swallow = True  # before the request: its `[stopped]` and `done` may arrive while it is under way
        try:
            stopped = await self.client.stop()
        except ShellError as exc:
            self._swallow = False
            self.note(f"stopped waiting, but the turn could not be stopped ({exc}); the rest of its answer is "
                      "printed when it ends", "yellow")
        else:
            self.note("stopped: the turn was cancelled (Ctrl-C)" if stopped else "stopped waiting", "yellow")
        self._update_idle()

    def connection_changed(self, state: str, detail: str) -> None:
        """ShellClient.on_state hook: report the stream going offline, coming back or refusing us."""
        previous, self._connection = self._connection, state
        if state == "offline" and previous != "offline":
            self.note(f"server offline — retrying ({detail})", "yellow")
        elif state == "connected" and previous == "offline":
            self.note("server back online", "green")
            if self._turn:  # the turn we wait for may have died with the server
                self._checking = asyncio.ensure_future(self._check_turn_alive())
        elif state == "unauthorized":
            self.fatal = detail
            self.note(detail, "bold red")
            self._update_idle()
            if self.on_attention is not None:
                self.on_attention()

    async def _check_turn_alive(self) -> None:
        """After a reconnect: if the server runs no request of this session, the turn was interrupted
        (the server restarted meanwhile); say so and give the prompt back instead of waiting forever."""
        try:
            rows = await self.client.sessions(self.client.client_id)
        except (ServerOffline, RequestRejected):
            return  # still unsure: the next reconnect asks again
        if self._turn and not any(row.get("running") for row in rows):
            self._flush()
            self.note("the turn was interrupted: the server restarted while it ran. Send the message again.",
                      "yellow")
            self._turn = False
            self._drop_gates(None)
            self._update_idle()

    # ---- event handlers

    def _on_tok(self, data: dict[str, Any]) -> None:
        text = data.get("text", "")
        if not isinstance(text, str) or not text:
            return
        self._parts.append(text)
        if self._turn and self.console.is_terminal and self._live_kind != "answer":
            self._stop_countdown()
            self._start_live("answer", _LiveAnswer(self._parts, self._plain), fps=12)

    def _on_user(self, data: dict[str, Any]) -> None:
        """A message sent to this session: shown unless this window sent it (another window did)."""
        text = str(data.get("text", ""))
        if text in self._mine:
            self._mine.remove(text)
            return
        self._flush()
        self._plain = text.lstrip().startswith("!")  # its answer is shown as this window shows its own
        self.console.print(Text.assemble((f"› {text}", "cyan"), ("  (sent from another window)", "dim")))

    def _on_status(self, data: dict[str, Any]) -> None:
        if data.get("session_deleted") is True:
            if not self.expect_deletion:  # another window or client deleted it: say so at once
                self.note(str(data.get("text", "")), "yellow")
            return
        self.note(str(data.get("text", "")), "dim")
        if data.get("cancelled") is True:
            self._drop_gates(None)  # the turn is gone, and its gates with it
        elif data.get("gate_id"):
            self._drop_gates(str(data["gate_id"]))  # decided elsewhere or timed out on the server

    def _on_error(self, data: dict[str, Any]) -> None:
        self.note(f"error: {data.get('message') or data.get('text') or 'the turn failed'}", "bold red")

    def _on_done(self, data: dict[str, Any]) -> None:
        self._flush()
        self._turn = False
        self._drop_gates(None)  # a finished turn waits for nothing
        self._update_idle()

    def _on_approval(self, data: dict[str, Any]) -> None:
        """A gate of another session routed to this window (`!approver on`): asked like one of our own."""
        if all(g.get("gate_id") != data.get("gate_id") for g in self.pending_gates):
            self._on_gate(approval_gate(data, time.time()))

    def _on_approval_closed(self, data: dict[str, Any]) -> None:
        """A routed gate was decided (here, by another approver, or it timed out): its panel goes."""
        if any(g.get("gate_id") == data.get("gate_id") for g in self.pending_gates):
            by = f" by {data['by']} ({data.get('channel')})" if data.get("by") else ""
            self.note(f"the approval for session {data.get('session')} was answered{by}: {data.get('decision')}",
                      "yellow")
            self._drop_gates(str(data.get("gate_id")))

    def _on_gate(self, data: dict[str, Any]) -> None:
        self._flush()
        gate = dict(data)
        gate_id = str(gate.get("gate_id", ""))
        timeout = gate.get("timeout_seconds")
        seconds_left = None
        if isinstance(timeout, int | float) and not isinstance(timeout, bool) and timeout > 0:
            seconds_left = float(timeout)
            self._deadlines[gate_id] = time.monotonic() + seconds_left
            self._timers[gate_id] = asyncio.get_running_loop().call_later(seconds_left, self._expire, gate_id)
        self.pending_gates.append(gate)
        self.console.print(gate_panel(gate, self.gate_preview_length, seconds_left))
        if len(self.pending_gates) == 1:
            self._start_countdown(gate)
        self._update_idle()
        if not self._turn and self.on_attention is not None:
            self.on_attention()

    # ---- helpers

    def _show_full_args(self, gate: dict[str, Any]) -> None:
        self._stop_countdown()
        self.console.print(Text(f"all arguments of {gate.get('tool_name', 'the tool')}:", style="bold"))
        self.console.print(Text(format_gate_args(gate.get("tool_args") or {}) or "(none)"), soft_wrap=True)
        self.console.print(Text("a allow once / s allow for this session / r reject", style="yellow"))
        self._start_countdown(gate)

    def _next_gate(self) -> None:
        if self.pending_gates:
            gate = self.pending_gates[0]
            self.console.print(Text(f"next gate: {gate.get('tool_name', '?')} — {' / '.join(gate_keys(gate))}",
                                    style="yellow"))
            self._start_countdown(gate)

    def _expire(self, gate_id: str) -> None:
        self._timers.pop(gate_id, None)
        for index, gate in enumerate(self.pending_gates):
            if str(gate.get("gate_id", "")) == gate_id:
                del self.pending_gates[index]
                if index == 0:
                    self._stop_countdown()
                self.note(
                    f"⌛ the gate for {gate.get('tool_name', 'the tool')} timed out (rejected)", "yellow"
                )
                if index == 0:
                    self._next_gate()
                break
        self._update_idle()

    def _drop_gates(self, gate_id: str | None) -> None:
        """Forget one pending gate (or all, with None) that the server no longer waits for."""
        kept = []
        for gate in self.pending_gates:
            gid = str(gate.get("gate_id", ""))
            if gate_id is None or gid == gate_id:
                self._forget_timer(gid)
            else:
                kept.append(gate)
        if len(kept) != len(self.pending_gates):
            first_gone = not kept or kept[0] is not self.pending_gates[0]
            self.pending_gates[:] = kept
            if first_gone:
                self._stop_countdown()
                self._hinted = False
                self._next_gate()
            self._update_idle()

    def _forget_timer(self, gate_id: str) -> None:
        timer = self._timers.pop(gate_id, None)
        if timer is not None:
            timer.cancel()
        self._deadlines.pop(gate_id, None)

    def _start_countdown(self, gate: dict[str, Any]) -> None:
        deadline = self._deadlines.get(str(gate.get("gate_id", "")))
        if deadline is not None and self.console.is_terminal and self._live is None:
            countdown = _Countdown(deadline, str(gate.get("tool_name", "the tool")), gate_keys(gate))
            self._start_live("countdown", countdown, fps=2)

    def _stop_countdown(self) -> None:
        if self._live is not None and self._live_kind == "countdown":
            self._live.stop()
            self._live, self._live_kind = None, ""

    def _start_live(self, kind: str, renderable: Any, fps: float) -> None:
        self._live = Live(
            renderable,
            console=self.console,
            refresh_per_second=fps,
            transient=kind == "countdown",
            redirect_stdout=False,
            redirect_stderr=False,
        )
        self._live_kind = kind
        self._live.start(refresh=True)

    def _flush(self) -> None:
        """Put the text streamed so far on screen for good (the final Markdown render)."""
        text = "".join(self._parts)
        self._parts.clear()
        live, kind = self._live, self._live_kind
        self._live, self._live_kind = None, ""
        if live is not None and kind == "answer":
            # A non-transient Live re-renders in full (overflow "visible") when stopped.
            live.update(_render_answer(text, self._plain))
            live.stop()
            return
        if live is not None:
            live.stop()
        if text.strip():
            self.console.print(_render_answer(text, self._plain))

    def _update_idle(self) -> None:
        if self.busy:
            self._idle.clear()
        else:
            self._idle.set()
