"""agentctl's rate-limit commands: how many calls of each tool type a window allows, and whether hitting
the limit switches the type off (`rate_limits` of `plugins-enabled.json`)."""

from __future__ import annotations

import json
import re

from rich.markup import escape
from rich.table import Table

from agentctl_base import CommandBase, as_bool
from agentctl_files import InputError, field_value
from config import ENABLED_FILE, RateLimit

#: Rate-limit types of the spec; plugins may add their own (the type of a tool is its gate type).
RATE_TYPES = ("llm_call", "search", "extract", "drive", "db", "system", "agent_call", "mcp")
RATE_TYPE = re.compile(r"^[a-z][a-z0-9_]{0,63}$")


class RateLimitCommands(CommandBase):
    """ratelimit-list, ratelimit-set, ratelimit-autodisable."""

    def cmd_ratelimit_list(self, args: list[str]) -> None:
        """ratelimit-list: calls allowed per window for each tool type, and which types auto-disable."""
        self._args(args, self.cmd_ratelimit_list, 0)
        limits = {k: v.model_dump() for k, v in self.files.enabled.rate_limits.items()}
        if self.term.json_output:
            self.term.json({"rate_limits": limits})
            return
        table = Table("type", "calls", "window (s)", "auto_disable")
        for kind, limit in limits.items():
            table.add_row(
                escape(kind),
                str(limit["calls"]),
                f"{limit['window_seconds']:g}",
                "yes" if limit["auto_disable"] else "no",
            )
        self.term.table(table)

    def cmd_ratelimit_set(self, args: list[str]) -> None:
        """ratelimit-set <type> <calls> <window_seconds>: allow that many calls of a tool type per window."""
        kind, calls, window = self._args(args, self.cmd_ratelimit_set, 3)
        if not RATE_TYPE.match(kind):
            raise InputError(
                f"invalid type '{kind}': lower-case letters, digits and '_' (such as {', '.join(RATE_TYPES)})"
            )
        base = {"calls": 0, "window_seconds": 0}
        values = {"calls": field_value(RateLimit, "calls", calls, base),
                  "window_seconds": field_value(RateLimit, "window_seconds", window, base)}
        raw = self.files.raw(ENABLED_FILE)
        limits = raw.setdefault("rate_limits", {})
        if kind not in limits and kind not in RATE_TYPES:
            self.term.warn(f"'{kind}' is not a type of the spec ({', '.join(RATE_TYPES)}); it only applies if a "
                           "plugin's tools use that gate type")
        limits.setdefault(kind, {"auto_disable": False}).update(values)
        self.files.save(ENABLED_FILE, raw)
        unlimited = not values["calls"] or not values["window_seconds"]
        self.term.done(f"rate limit {kind}: unlimited (0 means no limit)" if unlimited
                       else f"rate limit {kind}: {values['calls']} calls per {values['window_seconds']}s")

    def cmd_ratelimit_autodisable(self, args: list[str]) -> None:
        """ratelimit-autodisable <type> <true|false>: whether hitting the limit switches the tool type off."""
        kind, text = self._args(args, self.cmd_ratelimit_autodisable, 2)
        limits = self.files.enabled.rate_limits
        if kind not in limits:
            raise self._unknown("rate-limit type", kind, list(limits))
        raw = self.files.raw(ENABLED_FILE)
        raw["rate_limits"][kind]["auto_disable"] = value = as_bool(text)
        self.files.save(ENABLED_FILE, raw)
        self.term.done(f"rate limit {kind}: auto_disable = {json.dumps(value)}")
