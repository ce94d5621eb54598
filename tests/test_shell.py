"""shell.py against a small in-process stand-in for the shell endpoint (real HTTP/SSE via uvicorn)."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import re
import socket
import uuid
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from httpx_sse import ServerSentEvent
from prompt_toolkit.application import create_app_session
from prompt_toolkit.input import create_pipe_input
from prompt_toolkit.output import DummyOutput
from rich.console import Console
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

import shell
from shell import Shell, resolve_base_url
from shell_client import AuthRequired, ServerOffline, SessionNotFound, ShellClient, ShellEvent, load_or_create_client_id
from shell_terminal import PromptInterrupted, Terminal
from shell_ui import ShellUI

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


# --------------------------------------------------------------------------- the stand-in server


class FakeServer:
    """Just enough of the shell endpoint's wire contract, with hooks to observe and steer it."""

    def __init__(self, token: str | None = None, crlf: bool = False) -> None:
        self.token = token
        self.crlf = crlf
        self.events: dict[str, list[tuple[int, str, str]]] = defaultdict(list)
        self.cond = asyncio.Condition()
        self.drops = 0
        self.submits: list[dict[str, Any]] = []
        self.gate_responses: list[dict[str, Any]] = []
        self.stops: list[str] = []
        self.stream_requests: list[tuple[str, str | None]] = []
        self.auth_headers: list[str | None] = []
        self.open_streams: Counter[str] = Counter()
        self.sessions: dict[str, dict[str, Any]] = {}
        self._next_short = 101
        self.on_submit: Callable[[str, str], Awaitable[None]] | None = None
        self.on_gate: Callable[[str, str], Awaitable[None]] | None = None
        self.url = ""

    def add_session(self, client_id: str, model: str = "m1", history_length: int = 0) -> dict[str, Any]:
        info = {
            "client_id": client_id,
            "shorthand_id": self._next_short,
            "model": model,
            "history_length": history_length,
        }
        self._next_short += 1
        self.sessions[client_id] = info
        return info

    async def push(self, client_id: str, name: str, data: dict[str, Any] | None = None) -> None:
        async with self.cond:
            events = self.events[client_id]
            events.append((len(events) + 1, name, json.dumps(data if data is not None else {})))
            self.cond.notify_all()

    async def drop_streams(self) -> None:
        async with self.cond:
            self.drops += 1
            self.cond.notify_all()

    def _denied(self, request: Request) -> Response | None:
        header = request.headers.get("authorization")
        self.auth_headers.append(header)
        if self.token and header != f"Bearer {self.token}":
            return JSONResponse({"error": "unauthorized"}, status_code=401)
        return None

    async def submit(self, request: Request) -> Response:
        if denied := self._denied(request):
            return denied
        body = await request.json()
        if not isinstance(body.get("client_id"), str) or not isinstance(body.get("text"), str):
            return JSONResponse({"error": "Missing fields"}, status_code=400)
        self.submits.append(body)
        if body["client_id"] not in self.sessions:
            self.add_session(body["client_id"])
        if self.on_submit is not None:
            await self.on_submit(body["client_id"], body["text"])
        return JSONResponse({"status": "OK"})

    async def stream(self, request: Request) -> Response:
        if denied := self._denied(request):
            return denied
        client_id = request.query_params.get("client_id")
        if not client_id:
            return JSONResponse({"error": "Missing client_id"}, status_code=400)
        last = request.headers.get("last-event-id")
        self.stream_requests.append((client_id, last))
        nl = "\r\n" if self.crlf else "\n"
        drops = self.drops
        position = int(last) if last else len(self.events[client_id])

        def ready() -> bool:
            return len(self.events[client_id]) > position or self.drops != drops

        async def body() -> AsyncIterator[str]:
            nonlocal position
            self.open_streams[client_id] += 1
            try:
                yield f": keepalive{nl}{nl}"
                while True:
                    async with self.cond:
                        await self.cond.wait_for(ready)
                        if self.drops != drops:
                            return
                        batch = self.events[client_id][position:]
                        position += len(batch)
                    for event_id, name, data in batch:
                        yield f"id: {event_id}{nl}event: {name}{nl}data: {data}{nl}{nl}"
            finally:
                self.open_streams[client_id] -= 1

        return StreamingResponse(body(), media_type="text/event-stream")

    async def gate_response(self, request: Request) -> Response:
        if denied := self._denied(request):
            return denied
        body = await request.json()
        self.gate_responses.append(body)
        if self.on_gate is not None:
            await self.on_gate(body["gate_id"], body["decision"])
        return JSONResponse({"status": "OK"})

    async def stop(self, request: Request) -> Response:
        """As the real endpoint: the stopped turn says [stopped] and ends with done before the answer."""
        if denied := self._denied(request):
            return denied
        client_id = (await request.json())["client_id"]
        self.stops.append(client_id)
        await self.push(client_id, "status", {"text": "[stopped]", "stopped": True})
        await self.push(client_id, "done")
        return JSONResponse({"status": "OK", "cancelled": True})

    async def health(self, request: Request) -> Response:
        if denied := self._denied(request):
            return denied
        return JSONResponse({"status": "healthy", "models": ["m1", "m2"], "default_model": "m1"})

    async def list_sessions(self, request: Request) -> Response:
        if denied := self._denied(request):
            return denied
        wanted = request.query_params.get("client_id")
        found = [
            info
            for info in self.sessions.values()
            if wanted is None or wanted in (info["client_id"], str(info["shorthand_id"]))
        ]
        return JSONResponse({"sessions": found})

    async def delete_session(self, request: Request) -> Response:
        if denied := self._denied(request):
            return denied
        sid = request.path_params["sid"]
        if self.sessions.pop(sid, None) is None:
            return JSONResponse({"error": "session not found"}, status_code=404)
        return JSONResponse({"status": "OK", "deleted": sid})

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/submit", self.submit, methods=["POST"]),
                Route("/stream", self.stream),
                Route("/gate_response", self.gate_response, methods=["POST"]),
                Route("/stop", self.stop, methods=["POST"]),
                Route("/health", self.health),
                Route("/sessions", self.list_sessions),
                Route("/session/{sid}", self.delete_session, methods=["DELETE"]),
            ]
        )


class _Server(uvicorn.Server):
    """uvicorn without signal handling, telling us when it listens."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.ready = asyncio.Event()

    @contextlib.contextmanager
    def capture_signals(self):  # type: ignore[override]
        yield

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        self.ready.set()


def _bound_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


@contextlib.asynccontextmanager
async def serving(fake: FakeServer, sock: socket.socket | None = None) -> AsyncIterator[FakeServer]:
    sock = sock or _bound_socket()
    sock.listen(64)
    fake.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    config = uvicorn.Config(
        fake.app(), log_config=None, lifespan="off", ws="none", http="h11", timeout_graceful_shutdown=2
    )
    server = _Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    ready = asyncio.create_task(server.ready.wait())
    await asyncio.wait({task, ready}, return_when=asyncio.FIRST_COMPLETED)
    ready.cancel()
    try:
        yield fake
    finally:
        server.should_exit = True
        await task
        sock.close()


@pytest.fixture
async def fake() -> AsyncIterator[FakeServer]:
    async with serving(FakeServer()) as server:
        yield server


@pytest.fixture
async def client(fake: FakeServer) -> AsyncIterator[ShellClient]:
    c = ShellClient(fake.url, client_id="client-a", retry_initial=0.02, timeout=5)
    try:
        yield c
    finally:
        await c.aclose()


async def next_event(events: AsyncIterator[ShellEvent]) -> ShellEvent:
    async with asyncio.timeout(5):
        return await anext(events)


async def until_done(events: AsyncIterator[ShellEvent]) -> list[ShellEvent]:
    seen = []
    while not seen or seen[-1].name != "done":
        seen.append(await next_event(events))
    return seen


# --------------------------------------------------------------------------- SSE decoding


def test_shell_event_decodes_json_and_tolerates_plain_text() -> None:
    message = ServerSentEvent(event="tok", data='{"text": "a\\nb"}', id="3")
    assert ShellEvent.from_sse(message) == ShellEvent("tok", {"text": "a\nb"}, 3)
    assert ShellEvent.from_sse(ServerSentEvent(event="status", data="not json")).text == "not json"
    assert ShellEvent.from_sse(ServerSentEvent(event="done", data="")) == ShellEvent("done", {}, None)


# --------------------------------------------------------------------------- ShellClient


async def test_submit_posts_client_id_and_text(fake: FakeServer, client: ShellClient) -> None:
    assert await client.submit("hello\nworld") == {"status": "OK"}
    await client.submit("hi", default_model="m2")
    assert fake.submits == [
        {"client_id": "client-a", "text": "hello\nworld"},
        {"client_id": "client-a", "text": "hi", "default_model": "m2"},
    ]


@pytest.mark.parametrize("crlf", [False, True])
async def test_events_are_parsed_in_order(crlf: bool) -> None:
    async with serving(FakeServer(crlf=crlf)) as fake:
        async with ShellClient(fake.url, client_id="c1", retry_initial=0.02) as client:
            assert await client.connect(max_wait=5)
            gate = {
                "gate_id": "g1",
                "tool_name": "db_query",
                "tables": ["t"],
                "tool_args": {"sql": "DELETE FROM t", "operation_type": "write"},
            }
            await fake.push("c1", "tok", {"text": "first line\nsecond line\n"})
            await fake.push("c1", "status", {"text": "[db ▶] SELECT 1"})
            await fake.push("c1", "gate", gate)
            await fake.push("c1", "error", {"message": "boom"})
            await fake.push("c1", "done", {})
            events = client.events()
            got = await until_done(events)
            await events.aclose()
    assert [(e.id, e.name) for e in got] == [
        (1, "tok"),
        (2, "status"),
        (3, "gate"),
        (4, "error"),
        (5, "done"),
    ]
    assert got[0].text == "first line\nsecond line\n"
    assert got[1].text == "[db ▶] SELECT 1"
    assert got[2].data == gate
    assert got[3].data == {"message": "boom"}
    assert client.last_event_id == 5


async def test_dropped_stream_resumes_with_last_event_id(fake: FakeServer, client: ShellClient) -> None:
    await client.connect(max_wait=5)
    events = client.events()
    await fake.push("client-a", "tok", {"text": "one "})
    await fake.push("client-a", "tok", {"text": "two "})
    first = [await next_event(events), await next_event(events)]
    await fake.drop_streams()
    # Pushed while the client is (or is about to be) disconnected: must be replayed, once.
    await fake.push("client-a", "tok", {"text": "three"})
    await fake.push("client-a", "done", {})
    rest = await until_done(events)
    await events.aclose()
    assert [e.id for e in first + rest] == [1, 2, 3, 4]
    assert "".join(e.text for e in first + rest) == "one two three"
    assert fake.stream_requests == [("client-a", None), ("client-a", "2")]


async def test_attach_switches_the_running_stream_at_once(fake: FakeServer, tmp_path: Path) -> None:
    session_file = tmp_path / "session"
    session_file.write_text("client-a\n")
    fake.add_session("client-a")
    fake.add_session("client-b", model="m2", history_length=4)
    async with ShellClient(fake.url, session_file=session_file, retry_initial=0.02) as client:
        assert client.client_id == "client-a"
        await client.connect(max_wait=5)
        events = client.events()
        await fake.push("client-a", "tok", {"text": "old"})
        assert (await next_event(events)).text == "old"
        waiting = asyncio.ensure_future(next_event(events))  # blocked on session a's stream
        info = await client.attach("102")
        assert info["client_id"] == "client-b"
        assert client.client_id == "client-b"
        assert session_file.read_text().strip() == "client-b"
        assert fake.drops == 0 and fake.stream_requests[-1] == ("client-b", None)
        await fake.push("client-a", "tok", {"text": "stale"})
        await fake.push("client-b", "tok", {"text": "new"})
        event = await waiting
        assert (event.text, event.id) == ("new", 1)
        assert client.last_event_id == 1
        with pytest.raises(SessionNotFound):
            await client.attach("999")
        await events.aclose()


async def test_gate_response_sessions_and_health(fake: FakeServer, client: ShellClient) -> None:
    fake.add_session("client-a")
    assert (await client.health())["default_model"] == "m1"
    assert [s["shorthand_id"] for s in await client.sessions()] == [101]
    assert await client.sessions("101") == await client.sessions("client-a")
    assert await client.sessions("nope") == []
    await client.gate_response("g1", "allow_session")
    assert fake.gate_responses == [{"gate_id": "g1", "decision": "allow_session"}]
    with pytest.raises(ValueError):
        await client.gate_response("g1", "maybe")


async def test_an_auth_failure_says_where_the_token_came_from() -> None:
    async with serving(FakeServer(token="s3cret")) as fake:
        hint = "the token was read from /srv/data/shell-token; if the server keeps its data elsewhere, …"
        async with ShellClient(fake.url, client_id="c1", token="stale", auth_hint=hint) as client:
            with pytest.raises(AuthRequired, match=r"rejected the token.*read from /srv/data/shell-token"):
                await client.health()
        hint = "cannot read /srv/data/shell-token (Permission denied): run as the user who runs the server"
        async with ShellClient(fake.url, client_id="c1", auth_hint=hint) as client:
            with pytest.raises(AuthRequired, match=r"requires a token.*cannot read /srv/data/shell-token"):
                await client.health()


async def test_token_is_sent_and_missing_token_is_explained() -> None:
    async with serving(FakeServer(token="s3cret")) as fake:
        async with ShellClient(fake.url, client_id="c1") as anonymous:
            with pytest.raises(AuthRequired, match="--token or set AGENT_SHELL_TOKEN"):
                await anonymous.health()
            with pytest.raises(AuthRequired):
                await anext(anonymous.events())
        async with ShellClient(fake.url, client_id="c1", token="s3cret") as client:
            assert (await client.health())["status"] == "healthy"
            assert await client.connect(max_wait=5)
            assert "s3cret" not in repr(client)
        assert fake.auth_headers[-1] == "Bearer s3cret"


async def test_offline_server_is_retried_until_it_comes_up() -> None:
    sock = _bound_socket()  # bound but not listening: connections are refused
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    states: list[str] = []
    offline = asyncio.Event()

    def on_state(state: str, detail: str) -> None:
        states.append(state)
        if state == "offline":
            offline.set()

    async with ShellClient(
        url, client_id="c1", retry_initial=0.02, retry_max=0.05, on_state=on_state
    ) as client:
        with pytest.raises(ServerOffline):
            await client.submit("hi")
        assert not await client.connect(max_wait=0)
        await offline.wait()
        async with serving(FakeServer(), sock) as fake:
            assert await client.connect(max_wait=5)
            await fake.push("c1", "done")
            events = client.events()
            assert (await next_event(events)).name == "done"
            await events.aclose()
            await client.aclose()
    assert states[:2] == ["offline", "connected"]


def test_session_file_is_created_then_reused(tmp_path: Path) -> None:
    path = tmp_path / ".aiops_session_id"
    first = load_or_create_client_id(path)
    assert uuid.UUID(first).version == 4
    assert path.read_text().strip() == first
    assert load_or_create_client_id(path) == first
    path.write_text("  \n")
    assert load_or_create_client_id(path) not in ("", first)


def test_base_url_resolution() -> None:
    assert resolve_base_url(None, None, None, {}) == "http://127.0.0.1:8765"
    env = {"AGENT_SHELL_URL": "http://box:9000/"}
    assert resolve_base_url(None, None, None, env) == "http://box:9000"
    assert resolve_base_url(None, "other", None, env) == "http://other:9000"
    assert resolve_base_url(None, None, 1234, env) == "http://box:1234"
    assert resolve_base_url("https://x.example:8443", None, None, env) == "https://x.example:8443"
    with pytest.raises(ValueError):
        resolve_base_url("ftp://x", None, None, {})
    args = shell.build_parser().parse_args([])
    assert (args.session_file, args.token) == (".aiops_session_id", None)


# --------------------------------------------------------------------------- ShellUI


def _console(terminal: bool = False) -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    if terminal:
        return Console(file=out, force_terminal=True, width=80, height=24, color_system=None), out
    return Console(file=out, force_terminal=False, width=100), out


async def _feed(ui: ShellUI, *events: tuple[str, dict[str, Any]]) -> None:
    for name, data in events:
        await ui.handle_event(ShellEvent(name, data))


async def test_ui_renders_answer_status_and_error_in_order(client: ShellClient) -> None:
    console, out = _console()
    ui = ShellUI(console, client)
    ui.begin_turn()
    assert ui.busy
    await _feed(
        ui,
        ("tok", {"text": "# Plan\n\nI will **query**"}),
        ("tok", {"text": " the db.\n"}),
        ("status", {"text": "[db ▶] SELECT [bold]x[/bold] FROM t"}),
        ("tok", {"text": "- first\n- sec"}),
        ("tok", {"text": "ond\n"}),
        ("error", {"message": "model timed out"}),
        ("done", {}),
    )
    assert not ui.busy
    text = out.getvalue()
    assert "I will query the db." in text and "**" not in text
    assert "[db ▶] SELECT [bold]x[/bold] FROM t" in text  # server text is never markup
    assert "• second" in text
    assert "error: model timed out" in text
    order = [text.index(s) for s in ("Plan", "[db ▶]", "• first", "error: model")]
    assert order == sorted(order)


async def test_ui_shows_command_output_as_is(client: ShellClient) -> None:
    console, out = _console()
    ui = ShellUI(console, client)
    ui.begin_turn(plain=True)
    await _feed(ui, ("tok", {"text": "Commands:\n  !session [<ID> [delete]]\n  !reset"}), ("done", {}))
    assert "Commands:\n  !session [<ID> [delete]]\n  !reset" in out.getvalue()


async def test_ui_live_answer_keeps_the_whole_final_render(client: ShellClient) -> None:
    console, out = _console(terminal=True)
    ui = ShellUI(console, client)
    ui.begin_turn()
    for i in range(60):  # taller than the 24-line screen
        await ui.handle_event(ShellEvent("tok", {"text": f"- item {i}\n"}))
    await ui.handle_event(ShellEvent("done", {}))
    text = "\n".join(line.rstrip() for line in ANSI.sub("", out.getvalue()).splitlines())
    final = text[text.rindex("• item 0") :]
    assert all(re.search(rf"• item {i}$", final, re.MULTILINE) for i in range(60))


async def test_ui_gate_panel_keys_and_allow_session(fake: FakeServer, client: ShellClient) -> None:
    console, out = _console()
    ui = ShellUI(console, client, gate_preview_length=40)
    sql = "SELECT " + ", ".join(f"col{i}" for i in range(40)) + " FROM users JOIN orders"
    gate = {
        "gate_id": "g7",
        "tool_name": "db_query",
        "tables": ["users", "orders"],
        "tool_args": {"sql": sql, "operation_type": "write"},
        "timeout_seconds": 30,
    }
    ui.begin_turn()
    await ui.handle_event(ShellEvent("gate", gate))
    panel = out.getvalue()
    for expected in (
        "db_query",
        "write",
        "users, orders",
        "sql: SELECT col0",
        "…",
        "press v",
        "30 s",
        "[a] allow once",
        "[s] allow for this session",
        "[r] reject",
    ):
        assert expected in panel, expected
    assert "JOIN orders" not in panel
    assert ui.busy and ui.pending_gates
    await ui.handle_key("x")
    assert "waiting for a gate decision" in out.getvalue()
    await ui.handle_key("v")
    assert "JOIN orders" in out.getvalue()
    assert fake.gate_responses == []
    await ui.handle_key("s")
    assert fake.gate_responses == [{"gate_id": "g7", "decision": "allow_session"}]
    assert "allowed for this session" in out.getvalue()
    assert not ui.pending_gates
    await ui.handle_event(ShellEvent("done", {}))
    assert not ui.busy


async def test_ui_gate_timeout_and_interrupt(fake: FakeServer, client: ShellClient) -> None:
    console, out = _console()
    ui = ShellUI(console, client)
    await ui.handle_event(
        ShellEvent(
            "gate",
            {
                "gate_id": "g1",
                "tool_name": "web_search",
                "tool_args": {"query": "x"},
                "timeout_seconds": 0.05,
            },
        )
    )
    assert ui.busy
    await asyncio.wait_for(ui.wait_idle(), 5)
    assert "timed out" in out.getvalue() and fake.gate_responses == []

    ui.begin_turn()
    await _feed(
        ui,
        ("tok", {"text": "partial "}),
        ("gate", {"gate_id": "g2", "tool_name": "db_query", "tool_args": {}}),
    )
    await ui.handle_key("c-c")  # stops the turn on the server (its gate ends with it)
    assert not ui.busy and not ui.pending_gates
    assert fake.stops == [client.client_id] and fake.gate_responses == []
    # What the stopped turn still sends up to its done never prints; the next turn's events do.
    await _feed(ui, ("tok", {"text": "rest of it"}), ("status", {"text": "[stopped]", "stopped": True}), ("done", {}))
    ui.begin_turn()
    await _feed(ui, ("tok", {"text": "next answer"}), ("done", {}))
    shown = out.getvalue()
    assert "partial" in shown and "stopped: the turn was cancelled (Ctrl-C)" in shown and "next answer" in shown
    assert "rest of it" not in shown and "[stopped]" not in shown
    # With no turn of this window running, Ctrl-C rejects a pending gate (of another window's turn).
    await _feed(ui, ("gate", {"gate_id": "g3", "tool_name": "db_query", "tool_args": {}}))
    await ui.handle_key("c-c")
    assert fake.gate_responses == [{"gate_id": "g3", "decision": "reject"}] and fake.stops == [client.client_id]


async def test_ui_forgets_gates_the_server_no_longer_waits_for(fake: FakeServer, client: ShellClient) -> None:
    console, out = _console()
    ui = ShellUI(console, client)

    def gate(gate_id: str, tables: list[str] | None = None) -> tuple[str, dict[str, Any]]:
        return "gate", {"gate_id": gate_id, "tool_name": "db_query", "tables": tables or [],
                        "tool_args": {"sql": "CALL p()", "operation_type": "write"}, "timeout_seconds": 60}

    ui.begin_turn()
    await _feed(ui, gate("g1", ["*"]), gate("g2"))
    assert "any table: the statement could not be fully analysed" in out.getvalue()
    # Answered in another window (or timed out on the server): its resolution status names it.
    await _feed(ui, ("status", {"text": "[gate ✓] db_query: allowed once", "gate_id": "g1", "decision": "allow"}))
    assert [g["gate_id"] for g in ui.pending_gates] == ["g2"] and "next gate: db_query" in out.getvalue()
    # The turn was cancelled by a newer request: nothing is pending any more.
    await _feed(ui, ("status", {"text": "[cancelled]", "cancelled": True}))
    assert not ui.pending_gates
    await _feed(ui, gate("g3"), ("done", {}))
    assert not ui.pending_gates and not ui.busy and fake.gate_responses == []


# --------------------------------------------------------------------------- Shell (non-interactive)

_EOF = object()


class FakeTerminal:
    """Terminal stand-in: lines and keys come from queues, output goes to a StringIO."""

    def __init__(self) -> None:
        self.out = io.StringIO()
        self.console = Console(file=self.out, force_terminal=False, width=120)
        self.lines: asyncio.Queue[Any] = asyncio.Queue()
        self.keys: asyncio.Queue[str] = asyncio.Queue()
        self._interrupt: asyncio.Future[None] | None = None

    def feed(self, *lines: Any) -> None:
        for line in lines:
            self.lines.put_nowait(line)

    async def prompt(self, default: str = "", toolbar: Any = None, should_abort: Any = None) -> str:
        if should_abort is not None and should_abort():
            raise PromptInterrupted(default)
        self._interrupt = asyncio.get_running_loop().create_future()
        line_task = asyncio.ensure_future(self.lines.get())
        await asyncio.wait({line_task, self._interrupt}, return_when=asyncio.FIRST_COMPLETED)
        if not line_task.done():
            line_task.cancel()
            raise PromptInterrupted(default)
        line = line_task.result()
        if line is _EOF:
            raise EOFError
        return line

    def interrupt_prompt(self) -> None:
        if self._interrupt is not None and not self._interrupt.done():
            self._interrupt.set_result(None)

    @contextlib.asynccontextmanager
    async def key_mode(self) -> AsyncIterator[asyncio.Queue[str]]:
        yield self.keys


@contextlib.asynccontextmanager
async def running_shell(
    fake: FakeServer, session_file: Path, **kwargs: Any
) -> AsyncIterator[tuple[Shell, FakeTerminal]]:
    terminal = FakeTerminal()
    async with ShellClient(fake.url, session_file=session_file, retry_initial=0.02, **kwargs) as client:
        yield Shell(client, terminal), terminal


def _answer(fake: FakeServer, *parts: str) -> Callable[[str, str], Awaitable[None]]:
    async def on_submit(client_id: str, text: str) -> None:
        for part in parts:
            await fake.push(client_id, "tok", {"text": part})
        await fake.push(client_id, "done")

    return on_submit


async def test_shell_turn_and_local_commands(fake: FakeServer, tmp_path: Path) -> None:
    fake.on_submit = _answer(fake, "Hello **there**,\n", "second line")
    async with running_shell(fake, tmp_path / "sid") as (sh, term):
        term.feed(
            "!gate_preview_length 50", "hello", "first\nsecond", "!gate_preview_length", "!help", "!exit"
        )
        assert await asyncio.wait_for(sh.run(), 10) == 0
        assert sh.ui.gate_preview_length == 50
    text = term.out.getvalue()
    client_id = (tmp_path / "sid").read_text().strip()
    assert [s["text"] for s in fake.submits] == ["hello", "first\nsecond", "!help"]
    assert {s["client_id"] for s in fake.submits} == {client_id}
    assert fake.url in text and client_id[:8] in text and "m1" in text  # banner
    assert "Hello there," in text and "second line" in text
    assert "gate preview length: 50 characters" in text
    assert "!session <ID> attach" in text  # help from cmd_ docstrings


async def test_shell_waits_for_an_offline_server_then_serves(tmp_path: Path) -> None:
    sock = _bound_socket()  # bound but not listening until the fake serves on it
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    terminal = FakeTerminal()
    async with ShellClient(url, session_file=tmp_path / "sid", retry_initial=0.02) as client:
        sh = Shell(client, terminal, retry_initial=0.02, retry_max=0.05)
        third_retry = asyncio.Event()
        note = sh.ui.note

        def counting_note(text: str, style: str = "dim") -> None:
            note(text, style)
            if terminal.out.getvalue().count("server offline — retrying in") >= 3:
                third_retry.set()

        sh.ui.note = counting_note  # type: ignore[method-assign]
        run = asyncio.create_task(sh.run())
        await asyncio.wait_for(third_retry.wait(), 10)
        assert not run.done()
        async with serving(FakeServer(), sock) as fake:
            fake.on_submit = _answer(fake, "up now")
            terminal.feed("hello", "!exit")
            assert await asyncio.wait_for(run, 10) == 0
    text = terminal.out.getvalue()
    # exponential back-off up to retry_max: 0.02, 0.04, then 0.05 s
    assert "retrying in 0.02 s" in text and "retrying in 0.04 s" in text and "retrying in 0.05 s" in text
    assert url in text and "up now" in text


async def test_shell_stops_at_once_when_the_server_wants_a_token(tmp_path: Path) -> None:
    terminal = FakeTerminal()
    async with serving(FakeServer(token="s3cret")) as fake:
        async with ShellClient(fake.url, session_file=tmp_path / "sid") as client:
            assert await asyncio.wait_for(Shell(client, terminal).run(), 10) == 2
    text = terminal.out.getvalue()
    assert "token" in text.lower() and "server offline" not in text


async def test_shell_attach_and_delete_current_session(fake: FakeServer, tmp_path: Path) -> None:
    session_file = tmp_path / "sid"
    session_file.write_text("client-a")
    fake.add_session("client-a")
    fake.add_session("client-b", model="m2")

    async def on_submit(client_id: str, text: str) -> None:
        await fake.push(client_id, "tok", {"text": f"ok: {text}"})
        await fake.push(client_id, "done")
        if text.startswith("!session") and text.endswith("delete"):  # as the server: gone after the answer
            fake.sessions.pop(client_id, None)
            await fake.push(client_id, "status", {"text": "[session] this session (102) was deleted; …",
                                                  "session_deleted": True})

    fake.on_submit = on_submit
    async with running_shell(fake, session_file) as (sh, term):
        term.feed("!session 102", "hi", "!session 102 delete", "after", "!exit")  # bare: attaches in shell.py
        assert await asyncio.wait_for(sh.run(), 10) == 0
    new_id = session_file.read_text().strip()
    assert uuid.UUID(new_id).version == 4
    assert [(s["client_id"], s["text"]) for s in fake.submits] == [
        ("client-b", "hi"),
        ("client-b", "!session 102 delete"),
        (new_id, "after"),
    ]
    text = term.out.getvalue()
    assert "attached to session client-b (#102)" in text
    assert "ok: hi" in text and "ok: after" in text and "now using a new session" in text
    assert "this session (102) was deleted" not in text  # this window did it, and has moved on


async def test_shell_session_new_starts_an_empty_session_and_keeps_the_old(fake: FakeServer, tmp_path: Path) -> None:
    session_file = tmp_path / "sid"
    session_file.write_text("client-a")
    fake.add_session("client-a")
    fake.on_submit = _answer(fake, "ok")
    async with running_shell(fake, session_file) as (sh, term):
        term.feed("before", "!session new", "after", "!exit")
        assert await asyncio.wait_for(sh.run(), 10) == 0
    new_id = session_file.read_text().strip()
    assert uuid.UUID(new_id).version == 4
    assert [(s["client_id"], s["text"]) for s in fake.submits] == [("client-a", "before"), (new_id, "after")]
    assert "client-a" in fake.sessions  # nothing was deleted
    assert "!session client-a attach goes back" in term.out.getvalue()


async def test_ui_tells_a_window_its_session_was_deleted_elsewhere(client: ShellClient) -> None:
    console, out = _console()
    ui = ShellUI(console, client)
    await _feed(ui, ("status", {"text": "[session] this session (101) was deleted; the next message here starts a "
                                        "new, empty one", "session_deleted": True}))
    assert "this session (101) was deleted" in out.getvalue()


async def test_ui_shows_another_windows_command_output_with_its_line_breaks(client: ShellClient) -> None:
    console, out = _console()
    ui = ShellUI(console, client)
    ui.begin_turn(text="a question")  # this window's own turn first: rendered as Markdown
    await _feed(ui, ("user", {"text": "a question"}), ("tok", {"text": "one\ntwo"}), ("done", {}))
    await _feed(ui, ("user", {"text": "!session"}), ("tok", {"text": "Active sessions:\n  ID [101] a\n  ID [102] b"}),
                ("done", {}))
    await _feed(ui, ("user", {"text": "and you?"}), ("tok", {"text": "three\nfour"}), ("done", {}))
    lines = [line.rstrip() for line in out.getvalue().splitlines()]
    assert "one two" in lines  # a model's answer: Markdown joins its lines
    assert ["Active sessions:", "  ID [101] a", "  ID [102] b"] == lines[lines.index("Active sessions:"):][:3]
    assert "three four" in lines  # the next chat answer of the other window: Markdown again


async def test_shell_gate_keys_and_ctrl_c(fake: FakeServer, tmp_path: Path) -> None:
    async def on_submit(client_id: str, text: str) -> None:
        if text == "drop table":
            await fake.push(
                client_id,
                "gate",
                {
                    "gate_id": "g1",
                    "tool_name": "db_query",
                    "tables": ["t"],
                    "tool_args": {"sql": "DROP TABLE t", "operation_type": "write"},
                },
            )
        else:
            await fake.push(client_id, "tok", {"text": "thinking…"})

    async def on_gate(gate_id: str, decision: str) -> None:
        client_id = fake.submits[-1]["client_id"]
        await fake.push(client_id, "tok", {"text": f"gate said {decision}"})
        await fake.push(client_id, "done")

    fake.on_submit, fake.on_gate = on_submit, on_gate
    async with running_shell(fake, tmp_path / "sid") as (sh, term):
        seen = {"gate": asyncio.Event(), "tok": asyncio.Event()}
        handle = sh.ui.handle_event

        async def spy(event: ShellEvent) -> None:
            await handle(event)
            if event.name in seen:
                seen[event.name].set()

        sh.ui.handle_event = spy  # type: ignore[method-assign]
        term.feed("drop table", "slow question", _EOF)
        run = asyncio.create_task(sh.run())
        await asyncio.wait_for(seen["gate"].wait(), 5)
        term.keys.put_nowait("s")
        await asyncio.wait_for(seen["tok"].wait(), 5)
        seen["tok"].clear()
        await asyncio.wait_for(seen["tok"].wait(), 5)  # "thinking…" of the second turn
        term.keys.put_nowait("c-c")  # no done will come by itself: Ctrl-C stops the turn
        assert await asyncio.wait_for(run, 10) == 0
    assert fake.gate_responses == [{"gate_id": "g1", "decision": "allow_session"}]
    text = term.out.getvalue()
    assert "DROP TABLE t" in text and "gate said allow_session" in text and "the turn was cancelled" in text
    assert fake.stops == [fake.submits[-1]["client_id"]]


async def test_shell_without_token_says_how_to_pass_one(tmp_path: Path) -> None:
    async with serving(FakeServer(token="t0k")) as fake, running_shell(fake, tmp_path / "sid") as (sh, term):
        assert await asyncio.wait_for(sh.run(), 10) == 2
    assert "pass --token or set AGENT_SHELL_TOKEN" in term.out.getvalue()
    assert "t0k" not in term.out.getvalue()


# --------------------------------------------------------------------------- Terminal (prompt-toolkit)


@pytest.mark.parametrize(
    ("typed", "expected"),
    [
        ("hello\r", "hello"),
        ("one\x1b\rtwo\r", "one\ntwo"),  # Esc-Enter / Alt-Enter inserts a newline
        ("\x1b[200~pasted\r\nlines\x1b[201~\r", "pasted\nlines"),  # bracketed paste
        ("no\rbracketed\rpaste\r", "no\nbracketed\npaste"),  # keys queued behind Enter: a paste
        ("typo\x03fixed\r", "fixed"),  # Ctrl-C clears a non-empty line
    ],
)
async def test_terminal_prompt_keys(typed: str, expected: str) -> None:
    with create_pipe_input() as pipe, create_app_session(input=pipe, output=DummyOutput()):
        terminal = Terminal(None, console=Console(file=io.StringIO()))
        pipe.send_text(typed)
        assert await asyncio.wait_for(terminal.prompt(), 5) == expected


async def test_terminal_exits_interrupts_and_reads_keys() -> None:
    with create_pipe_input() as pipe, create_app_session(input=pipe, output=DummyOutput()):
        terminal = Terminal(None, console=Console(file=io.StringIO()))
        pipe.send_text("\x03\x03after two Ctrl-C\r")  # Ctrl-C on an empty prompt does not quit
        assert await asyncio.wait_for(terminal.prompt(), 5) == "after two Ctrl-C"
        pipe.send_text("\x04")
        with pytest.raises(EOFError):
            await asyncio.wait_for(terminal.prompt(), 5)
        with pytest.raises(PromptInterrupted) as interrupted:
            await asyncio.wait_for(terminal.prompt(default="draft", should_abort=lambda: True), 5)
        assert interrupted.value.text == "draft"
        async with terminal.key_mode() as keys:
            pipe.send_text("s\x03")
            assert [await asyncio.wait_for(keys.get(), 5) for _ in range(2)] == ["s", "c-c"]
