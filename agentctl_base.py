"""What every group of agentctl commands shares: the config files and terminal it works on, the checks of a
command's words (count, true/false, names nobody declares) and the "did you mean" of an unknown name."""

from __future__ import annotations

import difflib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import agentctl_remote
from agentctl_files import ConfigFiles, FileProblem, InputError
from agentctl_term import Terminal
from config import CORE_GATES

_TRUE, _FALSE = ("true", "yes", "on", "1"), ("false", "no", "off", "0")


def as_bool(text: str) -> bool:
    """The operator's true/false (also yes/no, on/off, 1/0); InputError for anything else."""
    word = text.strip().lower()
    if word not in _TRUE + _FALSE:
        raise InputError(f"{text} is not true/false")
    return word in _TRUE


def suggest(name: str, known: list[str]) -> list[str]:
    """What the operator probably meant: the names `name` begins (all of them, up to 3), else the closest one."""
    starting = [k for k in known if k.startswith(name.lower())] if name else []
    return starting[:3] if starting else difflib.get_close_matches(name, known, n=1)


class CommandBase:
    """The state and checks of agentctl's command groups (each a mixin of agentctl.AgentCtl).

    A command is a `cmd_<name>` method (dashes in the command become underscores) taking the words
    after it; its docstring is the help text, whose first line is `usage: what it does`.
    """

    def __init__(self, config_dir: Path, term: Terminal, in_prompt: bool = False):
        self.config_dir = config_dir
        self.term = term
        self.in_prompt = in_prompt
        self._files: ConfigFiles | None = None

    @property
    def files(self) -> ConfigFiles:
        if self._files is None:
            if not self.config_dir.is_dir():
                raise FileProblem(f"{self.config_dir}: config directory does not exist")
            self._files = ConfigFiles(self.config_dir)
            self._files.via_server = agentctl_remote.OwnedWriter(self._files.app_config(), self.term)
        return self._files

    def _usage(self, handler: Callable[..., Any]) -> str:
        return (handler.__doc__ or "").strip().splitlines()[0].split(": ", 1)[0]

    def _args(self, args: list[str], handler: Callable[..., Any], low: int, high: int | None = None) -> list[str]:
        if not low <= len(args) <= (low if high is None else high):
            raise InputError(f"usage: agentctl {self._usage(handler)}")
        return args

    def _unknown(self, kind: str, name: str, known: list[str]) -> InputError:
        close = suggest(name, known)
        hint = f"did you mean {' or '.join(close)}? " if close else ""
        return InputError(f"unknown {kind} '{name}'; {hint}known: {', '.join(known) or '(none)'}")

    def _known_tools(self) -> list[str]:
        """Tools the core and the manifest's plugins declare (an MCP server's tools are known only when it runs)."""
        plugins = [t for entry in self.files.manifest.plugins.values() for t in entry.tools]
        return sorted({*CORE_GATES, *plugins})

    def _check_tools(self, names: list[str], force: bool) -> None:
        """Refuse tool names nobody declares (a typo would silently gate or open nothing), unless forced."""
        known = self._known_tools()
        for name in names:
            if name == "*" or name in known:
                continue
            close = difflib.get_close_matches(name, known, n=3)
            hint = f"did you mean {', '.join(close)}? " if close else ""
            message = (f"no plugin or core module declares a tool '{name}'; {hint}known: {', '.join(known)}. "
                       "Tools of MCP servers (<server>_<tool>) are known only while they run")
            if not force:
                raise InputError(f"{message}; add --force to use the name anyway")
            self.term.warn(message)
