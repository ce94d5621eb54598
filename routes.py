"""The request pipeline: `process_request()` for every client, `!command` dispatch, the `@model` prefix.

Every front door (shell.py, the API, the proxy, Slack, swarm calls) hands its text to
`submit()` / `process_request()` as a typed `Request`, from which the core builds the request's
`turns.Turn` once and passes it down;
commands are answered here (handlers in commands.py and gate.py), everything else becomes an LLM
turn (agents.py). The runtime is assembled in build.py; HTTP helpers of the client plugins are in
plugins/_http.py.
Each request ends with exactly one `done` event on the session's stream, except a request
cancelled by a newer one from the same client, which ends with a `[cancelled]` status line.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import uuid
from collections.abc import AsyncGenerator, Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

import client_classes
import sessions
import state
import stores
import turns
from events import LOST, Event, EventHub

logger = logging.getLogger("agent_mcp.routes")

CANCEL_GRACE_SECONDS = 5


# ── Submitting ──────────────────────────────────────────────────────────────────────────────


@dataclass(frozen=True)
class Request:
    """One message a client hands in: who sends it, as which client class, and what it may do.

    Built once by the client plugin that owns the client's namespace, which states the class here
    (its `CLIENT_NAMESPACES` entry, or the shell's for the token-authenticated shell endpoint); the
    core never derives it again from the client id. `process_request` builds the `Turn` from it.
    """

    client_id: str
    #: The client class (client_classes.CLASSES) the plugin vouches for.
    kind: str
    text: str = ""
    #: Answer this request's LLM turn with this registry model (the session keeps its own); None: the session's.
    model: str | None = None
    #: The model of a session this request creates; None or not a registry model: the server's default.
    default_model: str | None = None
    #: The client plugin authenticated an administrator (the API's admin token): see `client_classes.may_administer`.
    admin: bool = False
    #: The token-authenticated shell endpoint sent it: ★ commands and the `@model` gate bypass.
    interactive: bool = False
    #: Who the plugin proved the caller to be (`api:key`, `proxy:alice`): rate limits count by it.
    identity: str | None = None
    #: The history a session this request creates starts with (the proxy's earlier turns of a conversation).
    history: tuple[dict[str, Any], ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in client_classes.CLASSES:
            raise ValueError(f"Request: client class {self.kind!r} is not one of {', '.join(client_classes.CLASSES)}")

    def turn(self, turn_id: str | None = None) -> turns.Turn:
        """The request's turn: its class and privileges as stated here, never from the client id."""
        # Only the boolean True a plugin sets vouches for anything (fail closed on a stray truthy value).
        return turns.Turn(self.client_id, turn_id or uuid.uuid4().hex[:16], self.kind, admin=self.admin is True,
                          interactive=self.interactive is True, model=self.model or None,
                          identity=self.identity or None)


@dataclass(frozen=True)
class Submitted:
    """A submitted request: its turn id (carried by every event it produces) and its task."""

    id: str
    task: asyncio.Task[None]


async def cancel_active_task(rt: state.Runtime, client_id: str) -> None:
    """Cancel the client's running and waiting requests and wait until they have cleaned up; with several
    instances, those on the others too (they end by themselves; the session's lease orders what comes next)."""
    if rt.signals is not None:
        await rt.signals.send("cancel", client_id)
    await _cancel_here(rt.active_tasks, client_id)


#: Why a stopped request was cancelled (POST /stop): it says `[stopped]` and then ends with its own `done`,
#: where a request replaced by a newer one says `[cancelled]` and leaves the `done` to the newer one.
STOPPED = "stopped"


async def _cancel_here(requests: state.Requests, client_id: str, why: str | None = None) -> None:
    tasks = [t for t in requests.get(client_id, ()) if not t.done() and t is not asyncio.current_task()]
    for task in tasks:
        task.cancel(why)
    if tasks:
        await asyncio.wait(tasks, timeout=CANCEL_GRACE_SECONDS)


async def submit(rt: state.Runtime, request: Request, *, cancel_running: bool = True) -> Submitted:
    """Start a request as a task and return it.

    With `cancel_running` (what shell.py and the API do) the client's running request is
    cancelled first; without it the new request waits until the session is free, so several
    requests on one session are answered one after another, each with its own events.
    """
    client_id = request.client_id
    if cancel_running:
        await cancel_active_task(rt, client_id)
    if rt.closing:  # checked after the last await: end_all either refuses this request or sees its task
        raise sessions.Stopping(STOPPING)
    turn_id = uuid.uuid4().hex[:16]
    task = asyncio.create_task(process_request(request, rt=rt, turn_id=turn_id), name=f"request:{client_id}")
    untrack = _track(rt.active_tasks, client_id, task, turn_id)
    task.add_done_callback(lambda _: untrack())
    return Submitted(turn_id, task)


async def stop(rt: state.Runtime, client_id: str) -> bool:
    """Cancel the client's requests without starting another; each cancelled one says `[stopped]` (a status
    with `"stopped": true`) and then ends with its `done` (clients that wait for `done`, as the original API
    client does, stop waiting; a `?turn_id=` stream ends there). Returns
    whether anything was running (with several instances: here, or on another by the session's mark)."""
    elsewhere = False
    if rt.signals is not None:
        await rt.signals.send("stop", client_id)
        stored = await rt.sessions.store.fetch(client_id)
        elsewhere = stored is not None and stored.running is not None
    return await _stop_here(rt.active_tasks, rt.hub, client_id) or elsewhere


async def _stop_here(requests: state.Requests, hub: EventHub, client_id: str) -> bool:
    stopped = [turn_id for task, turn_id in requests.get(client_id, {}).items() if not task.done()]
    await _cancel_here(requests, client_id, STOPPED)
    for turn_id in stopped:
        with _as_turn(client_id, turn_id):
            hub.done(client_id)
    return bool(stopped)


def _as_turn(client_id: str, turn_id: str) -> contextlib.AbstractContextManager[turns.Turn | None]:
    """Publish as request `turn_id` from outside it (its events carry the id; nothing else of a turn is read
    there, so the least privileged class is as good as its own)."""
    return turns.running(turns.Turn(client_id, turn_id, client_classes.UNKNOWN))


def _track(requests: state.Requests, client_id: str, task: asyncio.Task[None], turn_id: str) -> Callable[[], None]:
    """Put `task` among the client's requests, with its turn id; returns the undo."""
    group = requests.setdefault(client_id, {})
    group[task] = turn_id

    def untrack() -> None:
        group.pop(task, None)
        if not group and requests.get(client_id) is group:
            del requests[client_id]

    return untrack


def running(requests: state.Requests) -> list[asyncio.Task[None]]:
    """Every request still running on this instance (of the runtime's `active_tasks`)."""
    return [t for group in requests.values() for t in group if not t.done()]


async def end_all(rt: state.Runtime) -> None:
    """The server stops: cancel every request, each of which tells its clients it was interrupted
    (`error` + `done`, as a killed server's turns do) and keeps its user's message; wait for them."""
    rt.closing = True
    tasks = running(rt.active_tasks)
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=CANCEL_GRACE_SECONDS)


async def signalled(requests: state.Requests, hub: EventHub, what: str, client_id: str) -> None:
    """Another instance asks this one to cancel (`cancel`) or stop (`stop`) a session's requests."""
    await (_stop_here(requests, hub, client_id) if what == "stop" else _cancel_here(requests, client_id))


def ends_turn(ev: Event) -> bool:
    """Whether `ev` is the last event of its request: its `done`, or the status of its cancellation."""
    return ev.name == "done" or (ev.name == "status" and ev.data.get("cancelled") is True)


async def delete_session(rt: state.Runtime, client_id: str, *, remember: bool = True,
                         announce: bool = True) -> stores.Session | None:
    """The one way a session is deleted, whoever asks: the shell's, API's and MCP server's delete,
    `!session <id> delete` (another session now, its own once it has answered: `Turn.ends_session`) and the
    proxy's throwaway task sessions. Its requests here are cancelled, then the session manager forgets it, whose
    `forgotten` hooks drop the rest (event channel, rate-limit windows, grants, the proxy's conversation
    index), as they do for an expired or evicted session; then those on other instances are cancelled.

    With `remember`, a client that comes back is told (see SessionManager.delete); with `announce`, every
    window still following the id is told now (a throwaway session has none). A session already gone:
    only its event channel is dropped, and None returned.
    """
    await _cancel_here(rt.active_tasks, client_id)
    session = rt.sessions.get(client_id)
    if session is not None:
        await rt.sessions.delete(client_id, remember)  # its `forgotten` hooks drop the rest
    if rt.signals is not None:
        # Only once the store has forgotten it: a request running on another instance then ends after the
        # deletion, so its last save is refused and that instance forgets the session too. Told first, it could
        # save just before the deletion and keep the deleted session (and its history) in its memory.
        await rt.signals.send("cancel", client_id)
    if session is None:
        rt.hub.drop(client_id)
        return None
    if announce:
        # Every window still following the id is told now, not only with its next message: the event opens the
        # id's next channel, which their subscriptions move on to. It belongs to no turn (not the deleting one's).
        with turns.running(None):
            rt.hub.publish(client_id, "status", {"text": f"[session] this session ({session.shorthand}) was deleted; "
                                                         "the next message here starts a new, empty one",
                                                 "session_deleted": True})
    return session


FELL_BEHIND = ("the answer is incomplete: this client read it more slowly than it was produced and fell more "
               "than {buffer} events behind, so part of it was lost; the request was cancelled, send it again (and "
               "read the stream as it comes)")


async def run_turn(rt: state.Runtime, request: Request, *, cancel_running: bool = False
                   ) -> AsyncGenerator[Event, None]:
    """Submit the request and yield the events of this request only, ending with its `done`.

    For client plugins that answer one request per HTTP call or message (proxy, Slack, API
    `wait`, MCP). If the caller stops iterating early (its client went away), the request is
    cancelled. A request cancelled by a newer one ends with a `status` event whose data has
    `"cancelled": true`.
    """
    client_id = request.client_id
    events = rt.hub.subscribe(client_id, rt.hub.last_id(client_id), report_gaps=True)
    turn = await submit(rt, request, cancel_running=cancel_running)
    finished = False
    try:
        async for ev in events:
            if ev.name == LOST:
                # The reader fell behind the event buffer: what it would answer has a hole. An error (and
                # no end) instead, and the turn is cancelled below: no client takes a gapped answer as whole.
                logger.warning("a reader of %s fell more than %d events behind; its request ends with an error",
                               client_id, rt.hub.buffer)
                yield Event(ev.id, "error", {"message": FELL_BEHIND.format(buffer=rt.hub.buffer), "kind": "lost"},
                            turn.id)
                return
            if ev.turn != turn.id:
                continue
            finished = ends_turn(ev)
            yield ev
            if finished:
                return
    finally:
        await events.aclose()
        if not finished and not turn.task.done():
            turn.task.cancel()


async def wait_turn(rt: state.Runtime, request: Request, seconds: float, *, cancel_running: bool = False,
                    on_event: Callable[[Event], None] | None = None) -> dict[str, Any]:
    """Run one request to its end (or for `seconds`, then cancel it): `{"status", "text"}` with status
    complete, error, timeout or cancelled, and `"error"` when the agent reported one. `on_event` sees each
    event of the request as it comes (the MCP server asks its gates as elicitation forms)."""
    parts: list[str] = []
    error: str | None = None
    status = "complete"
    async with contextlib.aclosing(run_turn(rt, request, cancel_running=cancel_running)) as events:
        try:
            async with asyncio.timeout(seconds):
                async for ev in events:
                    if on_event is not None:
                        on_event(ev)
                    if ev.name == "tok":
                        parts.append(str(ev.data.get("text", "")))
                    elif ev.name == "error":
                        error = error or str(ev.data.get("message", "error"))
                    elif ends_turn(ev) and ev.name != "done":
                        status = "cancelled"
        except TimeoutError:
            status = "timeout"  # leaving run_turn early cancelled the request
    answer: dict[str, Any] = {"status": "error" if error is not None and status == "complete" else status,
                              "text": "".join(parts)}
    if error is not None:
        answer["error"] = error
    return answer


_GONE = {"deleted": "with !session … delete or the API, maybe from another window",
         "expired": "idle longer than its client class keeps sessions",
         "evicted": "the least recently used over its client class's cap"}


async def process_request(request: Request, *, rt: state.Runtime, turn_id: str | None = None) -> None:
    """Handle one message of a client: commands, a command batch, or an LLM turn; then `done`.

    Requests on one session run one at a time, in the order they were submitted. The request's
    turn is built here, once, from what its plugin stated (`Request`). A plugin may call this
    directly (the spec's path): the request is then tracked in `rt.active_tasks` like a submitted
    one, so a newer request or a delete cancels it.
    """
    client_id, text = request.client_id, request.text
    wanted = request.default_model
    model = wanted if wanted is not None and wanted in rt.config.models else rt.config.default_model
    turn = request.turn(turn_id)
    task = asyncio.current_task()
    # A plugin may call this directly: then the request tracks itself (a submitted one is tracked already).
    untrack: Callable[[], None] = (lambda: None) if task is None or task in rt.active_tasks.get(client_id, ()) \
        else _track(rt.active_tasks, client_id, task, turn.id)
    cancelled = started = done = False

    async def end_turn() -> None:  # while the session is still held: see SessionManager.hold
        nonlocal done
        rt.hub.done(client_id)
        done = True
        await rt.hub.sent()

    with turns.running(turn):
        try:
            # Added without awaiting, so requests take the session in the order they arrived.
            session, added = rt.sessions.get_or_add(client_id, model, turn.kind)
            if added and request.history:
                session.history = [dict(m) for m in request.history]
            # From here on the turn holds its session (what `!commands` and the agent loop receive), and is the
            # current one: what they set on it (ends_session) is read in `finally` below.
            turn = held = turn.holding(session)
            with turns.running(held):
                # An LLM turn saves its user message first thing: the session's mark as running goes with that save.
                async with rt.sessions.hold(session, turn.id, end_turn,
                                            saves_at_once=bool(text.strip()) and "!" not in text) as created:
                    started = True
                    why = await rt.sessions.take_gone(client_id) if created else None
                    if why is not None:
                        rt.hub.publish(client_id, "status", {
                            "text": f"[session] this session was {why} ({_GONE[why]}); this message starts a new, "
                                    "empty one", "session_gone": why})
                    rt.hub.publish(client_id, "user", {"text": text})  # every window shows who said what, in order
                    if turn.model is not None and turn.model not in rt.config.models:
                        rt.hub.error(client_id,
                                     f"unknown model '{turn.model}'; available: {', '.join(rt.config.models)}")
                    else:
                        await _process(rt, held, text)
        except asyncio.CancelledError as exc:
            cancelled = True
            if exc.args == (sessions.LEASE_LOST,):  # another instance ended this turn already, and said so
                raise
            if rt.closing:  # the server stops: as if it had been killed, but said at once
                interrupted(rt.hub, client_id, turn.id, INTERRUPTED if started else NOT_STARTED)
                raise
            if exc.args == (STOPPED,):  # stopped, not replaced: `stop` sends this turn's `done` right after
                rt.hub.publish(client_id, "status", {"text": "[stopped]", "stopped": True})
                raise
            # No `done`: the request that replaced this one sends its own, and a client must not
            # mistake this turn's end for the end of the newer one.
            rt.hub.publish(client_id, "status", {"text": "[cancelled]", "cancelled": True})
            raise
        except Exception as exc:
            if isinstance(exc, stores.SessionError):  # a dependency outage, not a bug: one line, no traceback
                logger.warning("request of %s failed: %s", client_id, exc)
            else:
                logger.exception("request of %s failed", client_id)
            detail = f": {type(exc).__name__}: {exc}" if turn.may_administer else " (details are in the server log)"
            if isinstance(exc, stores.StoreFault):  # locked, full, read-only: what it is and what to do, not a bug
                said = str(exc) if turn.may_administer else client_classes.without_locations(rt.config, str(exc))
                rt.hub.error(client_id, said, "store")
            else:
                if isinstance(exc, stores.SessionError):  # the store is unreachable: say so, whoever asks
                    detail = f": {exc}"
                rt.hub.error(client_id, f"internal error{detail}")
        finally:
            untrack()
            if not cancelled and not done:
                rt.hub.done(client_id)
            if turn.ends_session and rt.sessions.get(client_id) is turn.session:
                # After its answer and `done` reached every window: the one that asked already knows.
                await delete_session(rt, client_id, remember=False)


INTERRUPTED = ("the turn was interrupted: the server running it stopped before it finished. Your message is kept "
               "in the history; send it again to get an answer.")
STOPPING = ("this server is stopping and starts no more turns; send the message again (behind a load balancer "
            "another instance takes it)")
NOT_STARTED = "the server stopped before this message's turn began (the session was busy); send it again."


def interrupted(hub: EventHub, client_id: str, turn_id: str, message: str = INTERRUPTED) -> None:
    """Tell a session's clients that its request `turn_id` died with its server: `error`, then `done`."""
    with _as_turn(client_id, turn_id):
        hub.error(client_id, message, "interrupted")
        hub.done(client_id)


async def _process(rt: state.Runtime, turn: turns.HeldTurn, text: str) -> None:
    """Answer the request: its `!command` lines, and its other text with an LLM turn. The one step past
    `process_request` that keeps the runtime; the LLM turn goes to the runtime's agent loop (agents.Agent)."""

    async def command(line: str) -> None:
        out = await run_command(rt.commands, turn, line)
        rt.hub.tok(turn.client_id, out if turn.may_administer else client_classes.without_locations(rt.config, out))

    async def llm(words: str) -> None:
        asked = _at_model(rt.config.models, turn, words)
        if isinstance(asked, str):
            rt.hub.tok(turn.client_id, asked)
        else:
            await rt.agent.dispatch_llm(*asked)

    stripped = text.strip()
    lines = text.split("\n")
    command_lines = [line.strip() for line in lines if line.lstrip().startswith("!")]
    if len(command_lines) > 1:
        # A batch: every `!` line runs in order, the remaining lines (if any) go to the model.
        for line in command_lines:
            await command(line)
            rt.hub.tok(turn.client_id, "\n")
        rest = "\n".join(line for line in lines if not line.lstrip().startswith("!")).strip()
        if rest:
            await llm(rest)
        return
    if stripped.startswith("!"):
        await command(stripped)
        return
    if not stripped:
        rt.hub.error(turn.client_id, "empty message: type a question or !help")
        return
    await llm(stripped)


def _at_model(models: Collection[str], turn: turns.HeldTurn, text: str) -> tuple[turns.HeldTurn, str] | str:
    """The turn and text of an LLM turn on the turn's model (default: the session's), or on a leading
    `@model` for this turn only: then, from the interactive shell, its tool calls also skip the human
    gate. An unknown `@model`: what the client is told instead."""
    if not text.startswith("@"):
        return turn, text
    first, _, rest = text.partition(" ")
    key = first[1:]
    if key not in models:
        # Paragraphs, not lines: chat apps and shell.py render an answer as Markdown, which joins single lines.
        return (f"ERROR: Unknown model '@{key}'.\n\nAvailable models: {', '.join(models)}"
                f"\n\nFor example: @{next(iter(models))} {rest.strip() or 'hello'}")
    return dataclasses.replace(turn, model=key, bypass_gates=turn.interactive), rest.strip()


async def run_command(commands: Mapping[str, turns.Command], turn: turns.HeldTurn, line: str) -> str:
    """Run one `!command` line of `turn`: the text its client is shown (unknown commands never reach the model)."""
    name, _, args = line.lstrip("!").partition(" ")
    name = name.strip().lower()
    command = commands.get(name)
    if command is None:
        return f"Unknown command: !{name}\nUse !help to see available commands.\n"
    try:
        out = await command.handler(turn, args.strip())
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        logger.exception("command !%s failed", name)
        out = f"ERROR: !{name} failed: {type(exc).__name__}: {exc}"
    return str(out) if out is not None else ""
