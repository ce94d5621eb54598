"""agentctl's gate commands: the gate defaults every session starts from (`gate-defaults.json`: which
tables and tools run without a human's approval)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from rich.markup import escape
from rich.table import Table

import gate_policy
from agentctl_base import CommandBase, as_bool
from agentctl_files import ALL_GATED, InputError
from config import GATE_DEFAULTS_FILE, GateDefaults


class GateCommands(CommandBase):
    """gate-list, gate-set, gate-reset."""

    def cmd_gate_list(self, args: list[str]) -> None:
        """gate-list: the gate defaults every session starts from (auto-allow = no approval asked)."""
        self._args(args, self.cmd_gate_list, 0)
        gates: GateDefaults = self.files.parsed(GATE_DEFAULTS_FILE)
        if self.term.json_output:
            self.term.json({"db": {k: v.model_dump() for k, v in gates.db.items()},
                            "tools": {k: v.model_dump() for k, v in gates.tools.items()}})
            return
        table = Table("scope", "name", "read", "write", "ddl")
        listed: list[tuple[str, str, tuple[bool, ...]]] = [
            *(("db", key, (perm.read, perm.write, perm.ddl)) for key, perm in gates.db.items()),
            *(("tools", key, (perm.read, perm.write)) for key, perm in gates.tools.items())]
        for scope, key, values in listed:
            table.add_row(scope, escape(key), *("auto-allow" if v else "gated" for v in values),
                          *(("—",) if scope == "tools" else ()), style="yellow" if any(values) else None)
        self.term.table(table)
        self.term.say("db keys: a table, * (every other table), __meta__ (SHOW, DESCRIBE, …); tools: a tool or *. "
                      "ddl (CREATE, DROP, ALTER, RENAME, TRUNCATE) is never covered by write. "
                      "Anything absent is gated.", style="dim")

    def _gate_target(self, args: list[str], handler: Callable[..., Any], extra: int) -> tuple[str, str, list[str]]:
        """(section, key, remaining words) from `db <table> …` or `<tool> …`."""
        section = "db" if args and args[0] == "db" else "tools"
        words = self._args(args[1:] if section == "db" else args, handler, extra + 1)
        if not words[0] or any(c.isspace() for c in words[0]):
            raise InputError(f"invalid {'table' if section == 'db' else 'tool'} name {words[0]!r}")
        return section, words[0], words[1:]

    def cmd_gate_set(self, args: list[str]) -> None:
        """gate-set [db] <table|tool|*|__meta__> <read|write|ddl> <true|false> [--force]: true = auto-allow.

        `gate-set db users write false` gates writes to the table users; `gate-set db logs ddl true`
        lets CREATE/DROP/ALTER/RENAME/TRUNCATE of logs run unasked (write never covers them; db only);
        `gate-set db * read true`
        lets reads of every other table run unasked; `gate-set ddgs_search read true` lets that tool
        run unasked; `gate-set * write false` gates writes of every tool without its own entry.
        A tool name that no plugin or core module declares is refused (a typo would change nothing)
        unless --force is given (tools of MCP servers).
        """
        force = "--force" in args
        section, key, (operation, text) = self._gate_target([a for a in args if a != "--force"],
                                                            self.cmd_gate_set, 2)
        if section == "tools":
            self._check_tools([key], force)
        try:  # checked and applied as the server's gate keeper does (gate_policy)
            if operation == gate_policy.BOTH:
                raise gate_policy.PolicyError(f"invalid operation '{operation}': name read, write or ddl")
            change = gate_policy.PolicyChange.parse(section, key, operation, as_bool(text), "agentctl")
        except gate_policy.PolicyError as exc:
            hint = " (gate-set db <table> ddl …)" if operation == "ddl" else ""
            raise InputError(f"{exc}{hint}") from None
        entry = gate_policy.apply(self.files.parsed(GATE_DEFAULTS_FILE), change)
        raw = self.files.raw(GATE_DEFAULTS_FILE)  # edited in place: the file keeps its layout
        raw.setdefault(section, {}).setdefault(key, entry.model_dump()).update(
            {op: getattr(entry, op) for op in change.ops})
        value = change.allowed
        self.files.save(GATE_DEFAULTS_FILE, raw)
        what = f"{section} {key}" if section == "db" else f"tool {key}"
        self.term.done(f"{what}: {operation} {'auto-allowed' if value else 'gated'}")

    def cmd_gate_reset(self, args: list[str]) -> None:
        """gate-reset [db <table> | <tool>]: gate everything again, or drop one entry (it falls back to *)."""
        raw = self.files.raw(GATE_DEFAULTS_FILE)
        if not args:
            raw.update(copy.deepcopy(ALL_GATED))
            self.files.save(GATE_DEFAULTS_FILE, raw)
            self.term.done("every gate is on again (db and tools)")
            return
        section, key, _ = self._gate_target(args, self.cmd_gate_reset, 0)
        if key not in raw.get(section, {}):
            self.term.say(f"{section} has no entry '{key}'; nothing to do.")
            return
        del raw[section][key]
        self.files.save(GATE_DEFAULTS_FILE, raw)
        self.term.done(f"removed the {section} entry '{key}'")
