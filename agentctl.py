#!/usr/bin/env python3
"""agentctl: the operator's control panel for plugins, models, ports, rate limits and gate defaults.

`python agentctl.py <command> [args]` runs one command; without a command it opens a prompt.
It edits `plugins-enabled.json`, `llm-models.json` and `gate-defaults.json` of the config
directory (never `plugin-manifest.json`, which belongs to plugin authors). Every write is
checked with the pydantic models the server loads, lands through a temporary file and a rename,
keeps fields agentctl does not know, and is refused when it would stop the server from starting.

The commands live in one module per noun, each a mixin of `AgentCtl`: `agentctl_plugins` (plugins and
ports), `agentctl_models`, `agentctl_limits` (rate limits), `agentctl_gates`, `agentctl_audit` (grants and
the audit log), `agentctl_repair`, `agentctl_db`; this module joins them and holds the command line.

Exit codes: 0 done, 1 invalid input (nothing was changed), 2 a config file is missing, malformed
or cannot be written (nothing was changed).
"""

from __future__ import annotations

import logging
import os
import shlex
import sys
from collections.abc import Callable
from pathlib import Path

import grants
from agentctl_audit import AuditCommands
from agentctl_base import suggest
from agentctl_db import DbCommands
from agentctl_files import CtlError, FileProblem, InputError
from agentctl_gates import GateCommands
from agentctl_limits import RateLimitCommands
from agentctl_models import ModelCommands
from agentctl_plugins import PluginCommands
from agentctl_repair import RepairCommands
from agentctl_term import ArgParser, Terminal
from config import CODE_DIR


class AgentCtl(PluginCommands, ModelCommands, RateLimitCommands, GateCommands, AuditCommands, RepairCommands,
               DbCommands):
    """Every command of every group, run one at a time or from the prompt; `help` lists them.

    A command is a `cmd_<name>` method of a group (dashes in the command become underscores) taking the words
    after it; its docstring is the help text, whose first line is `usage: what it does`.
    """

    def commands(self) -> dict[str, Callable[[list[str]], None]]:
        return {name[4:].replace("_", "-"): getattr(self, name) for name in dir(self) if name.startswith("cmd_")}

    def run(self, words: list[str]) -> int:
        """Run one command line; return its exit code, reporting any failure on stderr."""
        name, args = words[0].lower(), words[1:]
        handler = self.commands().get(name)
        self._files = None  # read the files afresh: someone may have edited them since the last command
        try:
            if handler is None:
                close = suggest(name, list(self.commands()))
                hint = f" (did you mean {' or '.join(close)}?)" if close else ""
                raise InputError(f"unknown command '{name}'{hint}; 'help' lists the commands")
            handler(args)
        except CtlError as exc:
            return self._failed(str(exc), exc.exit_code)
        except grants.AuditError as exc:
            return self._failed(str(exc), FileProblem.exit_code)
        except (KeyboardInterrupt, EOFError):
            return self._failed("cancelled; nothing was changed", 1)
        return 0

    def _failed(self, message: str, code: int) -> int:
        """Say why a command failed; with --json also as its one JSON document on stdout."""
        self.term.error(message)
        if self.term.json_output:
            self.term.json({"error": message, "exit_code": code})
        return code

    def prompt(self) -> int:
        """The interactive prompt: one command per line until quit, exit or end of input."""
        if self.term.tty:  # piped commands get no banner and no prompt: only each command's output
            self.term.say("agentctl: type help for the commands, quit to leave.", style="bold")
        worst = 0
        while True:
            try:
                line = self.term.ask("agentctl> " if self.term.tty else "", [*self.commands(), "quit", "exit"])
            except EOFError:
                break
            except KeyboardInterrupt:
                continue
            try:
                words = shlex.split(line)
            except ValueError as exc:
                self.term.error(f"cannot read that line: {exc}")
                worst = max(worst, 1)
                continue
            if not words:
                continue
            if words[0].lower() in ("quit", "exit"):
                break
            worst = max(worst, self.run(words))
        # On a terminal the operator saw every error; piped commands report the worst one.
        return 0 if self.term.tty else worst

    def cmd_help(self, args: list[str]) -> None:
        """help [command]: list the commands, or show one command's help."""
        commands = self.commands()
        if args:
            handler = commands.get(args[0].lower())
            if handler is None:
                raise self._unknown("command", args[0], list(commands))
            self.term.say(_dedent(handler.__doc__ or ""))
            return
        rows = [(handler.__doc__ or "").strip().splitlines()[0].partition(": ")[::2] for handler in commands.values()]
        width = max(len(usage) for usage, _ in rows)
        for usage, what in rows:  # plain lines: no padding after the text
            self.term.say(f"{usage:<{width}}  {what}".rstrip())
        extra = "quit or exit leaves the prompt. " if self.in_prompt else ""
        self.term.say(f"{extra}Global options: --config-dir DIR, --json (every listing as JSON).", style="dim")


def _dedent(doc: str) -> str:
    lines = doc.strip().splitlines()
    return "\n".join([lines[0], *(line.strip() for line in lines[1:])])


class _OnceHandler(logging.Handler):
    """Shows config warnings (unknown fields) once each, as agentctl warnings."""

    def __init__(self, term: Terminal):
        super().__init__(logging.WARNING)
        self.term = term
        self.seen: set[str] = set()

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage().replace(" ignored", " (kept)")
        if message not in self.seen:
            self.seen.add(message)
            self.term.warn(message)


def main(argv: list[str] | None = None) -> int:
    """Run one command, or the prompt without one; return the exit code (0 ok, 1 bad input, 2 file problem)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = ArgParser(prog="agentctl.py", add_help=False, allow_abbrev=False)
    parser.add_argument("--config-dir", default=None)
    parser.add_argument("--json", action="store_true")
    term = Terminal()
    try:
        opts, words = parser.parse_known_args(argv)
    except InputError as exc:
        term.error(str(exc))
        return 1
    term.json_output = opts.json
    if words[:1] in (["-h"], ["--help"]):
        words = ["help", *words[1:]]
    # The library's log lines go to this terminal while the command runs (and only then: main may run in a
    # process that logs elsewhere, such as the test suite).
    logger = logging.getLogger("agent_mcp")
    handler, propagate = _OnceHandler(term), logger.propagate
    logger.addHandler(handler)
    logger.propagate = False
    try:
        config_dir = Path(opts.config_dir).resolve() if opts.config_dir else CODE_DIR
        ctl = AgentCtl(config_dir, term, in_prompt=not words)
        return ctl.prompt() if not words else ctl.run(words)
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate


if __name__ == "__main__":
    try:
        code = main()
        sys.stdout.flush()
    except BrokenPipeError:  # `agentctl --json … | head`: the reader has all it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        code = 0
    sys.exit(code)
