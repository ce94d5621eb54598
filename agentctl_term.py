"""agentctl's terminal: what it prints (rich tables, or one JSON document per command with --json),
and its argument parser."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, NoReturn

from prompt_toolkit import PromptSession
from prompt_toolkit.completion import CompleteEvent, WordCompleter
from prompt_toolkit.history import InMemoryHistory
from prompt_toolkit.key_binding import KeyBindings, KeyPressEvent
from rich.console import Console
from rich.table import Table

from agentctl_files import (
    InputError,
)

RESTART = "Restart agent-mcp.py for the change to take effect."


class Terminal:
    """Operator IO: rich output; input from prompt-toolkit on a terminal, else line by line from stdin."""

    def __init__(self, json_output: bool = False, session: PromptSession[str] | None = None):
        """`session`: a prompt-toolkit session to read from (tests pass one on a pipe input)."""
        self.tty = session is not None or (sys.stdin.isatty() and sys.stdout.isatty())
        self.json_output = json_output
        width = None if sys.stdout.isatty() else 200  # piped output is for grep: do not wrap tables at 80 columns
        self.out = Console(width=width, highlight=False)
        self.err = Console(stderr=True, width=width, highlight=False)
        self._session = session
        #: What the next `done` says instead of RESTART (a running server applied the change itself).
        self.applied: str | None = None

    def ask(self, question: str, words: list[str] | None = None) -> str:
        """One line from the operator; EOFError at the end of input."""
        if self.tty:
            if self._session is None:
                self._session = PromptSession(history=InMemoryHistory())
            completer = WordCompleter(words, sentence=True) if words else None
            return self._session.prompt(question, completer=completer, key_bindings=_TAB)
        if question:  # piped input: questions go to stderr, so stdout holds only the answers (--json)
            self.err.print(question, end="", markup=False)
        line = sys.stdin.readline()
        if not line:
            raise EOFError
        return line.rstrip("\n")

    def say(self, text: str, style: str | None = None) -> None:
        """A remark; with --json on stderr, so stdout holds one JSON document per command."""
        (self.err if self.json_output else self.out).print(text, style=style, markup=False)

    def line(self, text: str) -> None:
        """One line on stdout, never wrapped (for grep, and for files other commands read back)."""
        print(text)

    def done(self, text: str) -> None:
        """A change was written: say what, and that the server reads it at start."""
        note, self.applied = self.applied or RESTART, None
        if self.json_output:
            self.json({"done": text, "note": note})
            return
        self.out.print(f"✓ {text}", style="green", markup=False)
        self.out.print(note, style="dim", markup=False)

    def warn(self, text: str) -> None:
        self.err.print(f"warning: {text}", style="yellow", markup=False)

    def error(self, text: str) -> None:
        self.err.print(f"agentctl: {text}", style="red", markup=False, soft_wrap=True)  # one line for grep

    def table(self, table: Table) -> None:
        self.out.print(table)

    def json(self, data: Any) -> None:
        # Plain print: rich would re-wrap long strings and break the JSON for other programs.
        print(json.dumps(data, indent=2, ensure_ascii=False, default=str))


def _tab_bindings() -> KeyBindings:
    """Tab completes a unique prefix in place at the first press (prompt-toolkit's own Tab may first open a
    menu of that one word); with several candidates it behaves as usual: common part, then the menu."""
    bindings = KeyBindings()

    @bindings.add("tab")
    def _complete(event: KeyPressEvent) -> None:
        buffer = event.current_buffer
        if buffer.completer is None:
            return
        found = list(buffer.completer.get_completions(buffer.document, CompleteEvent(completion_requested=True)))
        if len(found) == 1:
            buffer.cancel_completion()
            buffer.apply_completion(found[0])
        elif buffer.complete_state:
            buffer.complete_next()
        else:
            buffer.start_completion(insert_common_part=True)

    return bindings


_TAB = _tab_bindings()


class ArgParser(argparse.ArgumentParser):
    """argparse that reports bad input as InputError (exit 1) instead of exiting with status 2."""

    def error(self, message: str) -> NoReturn:
        raise InputError(f"{message}\nusage: {self.format_usage().removeprefix('usage: ').strip()}")
