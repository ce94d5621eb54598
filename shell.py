"""Interactive terminal client for agent-mcp's shell endpoint (``plugin_client_shellpy``, port 8765).

Four modules, each usable on its own:

- ``shell_client.ShellClient``: async HTTP/SSE client, no terminal. Server tests drive this class.
- ``shell_ui.ShellUI``: draws stream events on a rich Console and turns single keys into gate decisions;
  it never reads the terminal, so tests feed it events and keys directly.
- ``shell_terminal.Terminal``: prompt-toolkit reading lines and keys (tests substitute a fake).
- here, ``Shell``: the prompt loop. Local ``!``-commands are ``cmd_<name>`` methods whose docstrings
  are the help text; everything else is POSTed to ``/submit``. And the command line (``main``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, wait_exponential

from config import CODE_DIR, load_env
from shell_client import (
    DEFAULT_PORT,
    DEFAULT_URL,
    SESSION_FILE,
    AuthRequired,
    RequestRejected,
    ServerOffline,
    ShellClient,
    ShellError,
    find_token,
    load_or_create_client_id,
)
from shell_terminal import PromptInterrupted, Terminal
from shell_ui import ShellUI

HISTORY_FILE = "~/.agent_mcp_shell_history"


class Shell:
    """The interactive loop: banner, prompt, local ``!`` commands, submit, wait for the turn's end."""

    def __init__(
        self,
        client: ShellClient,
        terminal: Any,
        *,
        server_url: str | None = None,
        retry_initial: float = 0.5,
        retry_max: float = 10.0,
    ) -> None:
        self.client = client
        self.terminal = terminal
        self.console: Console = terminal.console
        self.server_url = server_url or client.base_url
        self.ui = ShellUI(self.console, client, on_attention=terminal.interrupt_prompt)
        client.on_state = self.ui.connection_changed
        self._retry_initial, self._retry_max = retry_initial, retry_max
        self._running = True
        self._draft = ""
        self._switch_after_turn = False
        self._approving: asyncio.Task[None] | None = None

    async def run(self) -> int:
        """Connect, show the banner and serve the prompt until !exit or Ctrl-D; return the exit code."""
        health = await self._wait_for_server()
        if health is None:
            return 2
        await self._banner(health)
        consumer = asyncio.create_task(self._consume())
        try:
            with contextlib.suppress(ShellError):
                await self.client.connect(max_wait=5.0)
            while self._running:
                if self.ui.fatal:
                    return 2
                if self.ui.busy:
                    await self._wait_turn()
                    continue
                if self._switch_after_turn:
                    await self._replace_deleted_session()
                    continue
                try:
                    text = await self.terminal.prompt(
                        default=self._draft,
                        toolbar=self._toolbar,
                        # Read while the prompt waits, when a turn another window started may be running.
                        should_abort=lambda: self.ui.busy or bool(self.ui.fatal),  # type: ignore[redundant-expr]  # later
                    )
                except PromptInterrupted as exc:
                    self._draft = exc.text
                    continue
                except EOFError:
                    break
                self._draft = ""
                await self.handle_line(text)
            return 0
        finally:
            for task in (consumer, self._approving):
                if task is not None:
                    task.cancel()
            await asyncio.wait([consumer])

    async def handle_line(self, text: str) -> None:
        """Run a local ``!`` command, or submit the text (commands included) to the server."""
        stripped = text.strip()
        if not stripped:
            return
        if stripped.startswith("!") and "\n" not in stripped:
            name, _, arg = stripped[1:].partition(" ")
            handler = getattr(self, f"cmd_{name.lower()}", None)
            if handler is not None and await handler(arg.strip()):
                return
        await self._submit(text.strip("\n"))

    # ---- local commands: return True when handled here, False to send the line to the server

    async def cmd_exit(self, arg: str) -> bool:
        """!exit — leave the shell (also !quit, or Ctrl-D on an empty prompt; Ctrl-C never quits)."""
        self._running = False
        return True

    async def cmd_quit(self, arg: str) -> bool:
        """!quit — same as !exit."""
        return await self.cmd_exit(arg)

    async def cmd_session(self, arg: str) -> bool:
        """!session <ID> attach — switch this shell to session ID (full id or shorthand like 101) at once;
        !session new — start a new, empty session in this shell (the old one is kept)."""
        parts = arg.split()
        if [p.lower() for p in parts] == ["new"]:
            await self._new_session()
            return True
        if len(parts) == 1 or (len(parts) == 2 and parts[1].lower() == "attach"):
            await self._attach(parts[0])
            return True
        if len(parts) == 2 and parts[1].lower() == "delete":
            self._switch_after_turn = self.ui.expect_deletion = await self._is_current(parts[0])
        return False

    async def cmd_gate_preview_length(self, arg: str) -> bool:
        """!gate_preview_length [N] — show or set how many characters of gate arguments are shown (200)."""
        if arg:
            if not arg.isdigit() or int(arg) < 1:
                self.ui.note("usage: !gate_preview_length [N]  (N >= 1)", "red")
                return True
            self.ui.gate_preview_length = int(arg)
        self.ui.note(f"gate preview length: {self.ui.gate_preview_length} characters", "")
        return True

    async def cmd_approver(self, arg: str) -> bool:
        """!approver on|off — this window answers gates of other sessions routed to shell approvers (or stops)."""
        if arg.lower() not in ("on", "off"):
            self.ui.note(f"approver: {'on' if self._approving else 'off'} — usage: !approver on|off", "")
            return True
        try:
            await self.client.set_approver(arg.lower() == "on")
        except ShellError as exc:
            self.ui.note(f"!approver {arg}: {exc}", "red")
            return True
        if self._approving is not None:
            self._approving.cancel()
        self._approving = asyncio.create_task(self._follow_approvals()) if arg.lower() == "on" else None
        self.ui.note(f"approver {arg.lower()}: this window {'now answers' if self._approving else 'no longer answers'}"
                     " gates routed to shell approvers", "green")
        return True

    async def _follow_approvals(self) -> None:
        with contextlib.suppress(ShellError):
            async for event in self.client.approvals():
                await self.ui.handle_event(event)

    async def cmd_clear(self, arg: str) -> bool:
        """!clear — clear the screen."""
        self.console.clear()
        return True

    async def cmd_help(self, arg: str) -> bool:
        """!help — list these client commands, then ask the server for its own."""
        self.console.print(Text("Client commands (handled by this shell):", style="bold"))
        for name in sorted(n for n in dir(self) if n.startswith("cmd_")):
            doc = (getattr(self, name).__doc__ or "").strip().splitlines()
            self.console.print(Text("  " + (doc[0] if doc else "!" + name[4:])))
        self.console.print(
            Text("Keys: Enter send · Esc-Enter newline · Ctrl-C stop the turn · Ctrl-D quit", style="dim")
        )
        return False

    # ---- helpers

    async def _attach(self, session_id: str) -> None:
        try:
            info = await self.client.attach(session_id)
        except ShellError as exc:
            self.ui.note(f"cannot attach: {exc}", "red")
            return
        self.ui.note(
            f"attached to session {_short(info['client_id'])} {_shorthand(info)}— model {info.get('model', '?')}, "
            f"{info.get('history_length', 0)} messages",
            "green",
        )

    async def _is_current(self, session_id: str) -> bool:
        if session_id == self.client.client_id:
            return True
        try:
            found = await self.client.sessions(session_id)
        except ShellError:
            return False
        return bool(found) and found[0].get("client_id") == self.client.client_id

    async def _replace_deleted_session(self) -> None:
        self._switch_after_turn = False
        with contextlib.suppress(ShellError):
            new_id = await self.client.new_session()
            self.ui.note(f"this session was deleted — now using a new session {_short(new_id)}", "green")
        self.ui.expect_deletion = False

    async def _new_session(self) -> None:
        previous = self.client.client_id
        try:
            new_id = await self.client.new_session()
        except ShellError as exc:
            self.ui.note(f"cannot start a new session: {exc}", "red")
            return
        self.ui.note(f"new session {_short(new_id)} — the previous one ({_short(previous)}) is kept: "
                     f"!session {previous} attach goes back", "green")

    async def _submit(self, text: str) -> None:
        self.ui.begin_turn(plain=text.lstrip().startswith("!"), text=text)
        try:
            await self.client.submit(text)
        except AuthRequired as exc:
            self.ui.end_turn()
            self.ui.fatal = str(exc)
            self.ui.note(str(exc), "bold red")
        except ServerOffline:
            self.ui.end_turn()
            self._draft = text
            self.ui.note("server offline — not sent; your text is back in the prompt", "yellow")
        except RequestRejected as exc:
            self.ui.end_turn()
            self.ui.note(f"the server refused the message: {exc.message}", "red")

    async def _wait_turn(self) -> None:
        async with self.terminal.key_mode() as keys:
            while self.ui.busy:
                key_task = asyncio.ensure_future(keys.get())
                idle_task = asyncio.ensure_future(self.ui.wait_idle())
                done, pending = await asyncio.wait({key_task, idle_task}, return_when=asyncio.FIRST_COMPLETED)
                for task in pending:
                    task.cancel()
                if key_task in done:
                    await self.ui.handle_key(key_task.result())

    async def _consume(self) -> None:
        try:
            async for event in self.client.events():
                await self.ui.handle_event(event)
        except AuthRequired as exc:
            if not self.ui.fatal:
                self.ui.connection_changed("unauthorized", str(exc))

    async def _wait_for_server(self) -> dict[str, Any] | None:
        def offline(retry: RetryCallState) -> None:
            self.ui.note(f"server offline — retrying in {retry.upcoming_sleep:g} s ({self.server_url})", "yellow")

        try:
            return await AsyncRetrying(
                wait=wait_exponential(multiplier=self._retry_initial, max=self._retry_max),
                retry=retry_if_exception_type(ServerOffline), before_sleep=offline, reraise=True,
            )(self.client.health)
        except AuthRequired as exc:
            self.ui.note(str(exc), "bold red")
        except RequestRejected as exc:
            self.ui.note(f"{self.server_url} is not an agent-mcp shell endpoint? /health said {exc}", "red")
        return None

    async def _banner(self, health: dict[str, Any]) -> None:
        try:
            found = await self.client.sessions(self.client.client_id)
        except ShellError:
            found = []
        info = found[0] if found else {}
        model = info.get("model") or health.get("default_model") or "?"
        models = ", ".join(str(m) for m in health.get("models") or [])
        grid = Table.grid(padding=(0, 2))
        grid.add_column(style="bold")
        grid.add_column()
        grid.add_row("Server", Text(self.server_url))
        grid.add_row(
            "Session", Text(f"{_short(self.client.client_id)} {_shorthand(info) or '(new)'}".rstrip())
        )
        grid.add_row("Model", Text(f"{model}" + (f"   (available: {models})" if models else "")))
        hints = Text(
            "Enter send · Esc-Enter newline · !help commands · !exit quit · Ctrl-C stop the turn", style="dim"
        )
        self.console.print(
            Panel(Group(grid, hints), title="agent-mcp shell", title_align="left", expand=False)
        )

    def _toolbar(self) -> str:
        state = {"connected": "online", "reconnecting": "reconnecting…", "offline": "offline — retrying"}
        return (
            f" {self.server_url} · session {_short(self.client.client_id)} · "
            f"{state.get(self.client.state, self.client.state)} · Esc-Enter newline · Ctrl-D quit"
        )


def _short(client_id: str) -> str:
    return client_id[:8] + "…" if len(client_id) > 8 else client_id


def _shorthand(info: dict[str, Any]) -> str:
    return f"(#{info['shorthand_id']}) " if info.get("shorthand_id") is not None else ""


# --------------------------------------------------------------------------- entry point


def resolve_base_url(url: str | None, host: str | None, port: int | None, env: dict[str, str]) -> str:
    """--url, else AGENT_SHELL_URL, else the default; --host / --port then replace those parts."""
    base = httpx.URL(url or env.get("AGENT_SHELL_URL") or DEFAULT_URL)
    if base.scheme not in ("http", "https") or not base.host:
        raise ValueError(f"not an http(s) URL: {base}")
    if host:
        base = base.copy_with(host=host)
    if port:
        base = base.copy_with(port=port)
    return str(base).rstrip("/")


def build_parser() -> argparse.ArgumentParser:
    """The command line of shell.py."""
    parser = argparse.ArgumentParser(
        prog="shell.py", description="Terminal client for the agent-mcp shell endpoint."
    )
    parser.add_argument("--url", help=f"server base URL (env AGENT_SHELL_URL, default {DEFAULT_URL})")
    parser.add_argument("--host", help="server host (default: the host of AGENT_SHELL_URL, else 127.0.0.1)")
    parser.add_argument("--port", type=int, help=f"server port (default {DEFAULT_PORT})")
    parser.add_argument(
        "--session-file",
        default=SESSION_FILE,
        help=f"file holding this shell's client id (default ./{SESSION_FILE})",
    )
    parser.add_argument("--token", default=None, help="bearer token for the server (env AGENT_SHELL_TOKEN; default: "
                        "read from the server's token file)")
    parser.add_argument("--token-file", type=Path, default=None,
                        help="the server's token file (default $AGENT_DATA_DIR/shell-token, else data/shell-token "
                             "next to shell.py)")
    return parser


def _history_path(session_file: Path) -> Path:
    home_file = Path(os.path.expanduser(HISTORY_FILE))
    if home_file.parent.is_dir() and os.access(home_file.parent, os.W_OK):
        return home_file
    return session_file.resolve().parent / ".shell_history"


async def _run(base_url: str, token: str | None, auth_hint: str | None, session_file: Path) -> int:
    terminal = Terminal(_history_path(session_file))
    async with ShellClient(base_url, session_file=session_file, token=token, auth_hint=auth_hint) as client:
        return await Shell(client, terminal, server_url=base_url).run()


def main(argv: list[str] | None = None) -> int:
    """Parse the command line and run the shell; return the process exit code."""
    args = build_parser().parse_args(argv)
    try:
        base_url = resolve_base_url(args.url, args.host, args.port, dict(os.environ))
    except ValueError as exc:
        print(f"shell.py: {exc}", file=sys.stderr)
        return 2
    token, auth_hint = find_token(args.token, load_env(CODE_DIR), args.token_file)
    session_file = Path(args.session_file)
    try:
        load_or_create_client_id(session_file)
    except OSError as exc:
        print(f"shell.py: cannot use the session file {session_file}: {exc}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(_run(base_url, token, auth_hint, session_file))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
