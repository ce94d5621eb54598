"""shell.py's terminal: prompt-toolkit reads the lines and, while a turn runs, single keys; a rich Console
writes. Shell talks to it through a small interface, which tests replace with a fake."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from prompt_toolkit import PromptSession
from prompt_toolkit.history import FileHistory, InMemoryHistory
from prompt_toolkit.key_binding import KeyBindings
from prompt_toolkit.keys import Keys
from prompt_toolkit.patch_stdout import patch_stdout
from rich.console import Console


class PromptInterrupted(Exception):
    """The prompt was closed because an event needs the user's keys; ``text`` is what had been typed."""

    def __init__(self, text: str = "") -> None:
        super().__init__("prompt interrupted")
        self.text = text


def _prompt_bindings() -> KeyBindings:
    bindings = KeyBindings()

    @bindings.add("enter")
    def _enter(event: Any) -> None:
        # Keys already queued behind this Enter mean a paste without bracketed-paste support:
        # keep it one message by inserting the newline instead of submitting.
        queued = event.app.key_processor.input_queue
        if any(press.key != Keys.CPRResponse for press in queued):
            event.current_buffer.insert_text("\n")
        else:
            event.current_buffer.validate_and_handle()

    @bindings.add("escape", "enter")
    def _newline(event: Any) -> None:
        event.current_buffer.insert_text("\n")

    @bindings.add("c-c")
    def _clear(event: Any) -> None:
        # Clears the line and never quits (as in other REPLs); Ctrl-D or !exit quits.
        event.current_buffer.reset()

    return bindings


class Terminal:
    """The real terminal: prompt-toolkit reads lines and keys, a rich Console writes.

    Shell needs only: ``console``, ``await prompt(default, toolbar, should_abort)`` (raises
    EOFError on Ctrl-D at an empty prompt, PromptInterrupted after interrupt_prompt(); Ctrl-C only
    clears the line),
    ``interrupt_prompt()``, and ``key_mode()`` (async context manager giving an asyncio.Queue of
    key names such as "a" or "c-c" while the terminal is in raw mode). Tests substitute a fake.
    """

    def __init__(self, history_path: Path | None = None, console: Console | None = None) -> None:
        self.console = console or Console(highlight=False)
        history = FileHistory(str(history_path)) if history_path else InMemoryHistory()
        self._session: PromptSession[str] = PromptSession(
            history=history,
            multiline=False,  # Enter submits; Esc-Enter / Alt-Enter and pastes insert newlines
            key_bindings=_prompt_bindings(),
            prompt_continuation=lambda width, line_number, wrap_count: " " * width,
            refresh_interval=2.0,
        )

    async def prompt(
        self,
        default: str = "",
        toolbar: Callable[[], str] | None = None,
        should_abort: Callable[[], bool] | None = None,
    ) -> str:
        """Read one (possibly multi-line) message; events print above it meanwhile.

        ``should_abort`` is checked once the prompt runs, closing the race with interrupt_prompt().
        """

        def pre_run() -> None:
            if should_abort is not None and should_abort():
                self.interrupt_prompt()

        with patch_stdout(raw=True):
            try:
                return await self._session.prompt_async(
                    [("ansicyan bold", "› ")], default=default, bottom_toolbar=toolbar, pre_run=pre_run
                )
            except KeyboardInterrupt:  # prompt-toolkit's own SIGINT handling: a cleared line, not a quit
                return ""

    def interrupt_prompt(self) -> None:
        """Close a running prompt with PromptInterrupted, keeping what was typed."""
        app = self._session.app
        if app.is_running and not app.is_done:
            app.exit(exception=PromptInterrupted(self._session.default_buffer.text))

    @contextlib.asynccontextmanager
    async def key_mode(self) -> AsyncIterator[asyncio.Queue[str]]:
        """Raw mode: single keys (Ctrl-C included) arrive as names on the yielded queue."""
        keys: asyncio.Queue[str] = asyncio.Queue()
        terminal_input = self._session.input

        def on_ready() -> None:
            for press in terminal_input.read_keys():
                if press.key != Keys.CPRResponse:
                    keys.put_nowait(press.key.value if isinstance(press.key, Keys) else press.key)

        with terminal_input.raw_mode(), terminal_input.attach(on_ready):
            yield keys
