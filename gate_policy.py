"""Gate policy: the gate defaults every session starts from (`gate-defaults.json`), changed one entry
at a time, checked and applied the same way wherever the change comes from.

The running server changes them only through its gate keeper (`gate.GateKeeper.set_policy`: the MCP
`set_gate_default` tool, agentctl through the server), which also saves, audits and tells the other
instances; agentctl, with no server running, checks and applies its `gate-set` with the same
`PolicyChange.parse` and `apply`. Imports only config and sql: agentctl loads it without the server.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import sql
from config import GateDefaults, GatePermission, ToolPermission, save_gate_defaults

SECTIONS = ("db", "tools")
#: Operations of a tool's gate and of a database gate (`ddl`: CREATE, DROP, ALTER, … never covered by write).
TOOL_OPERATIONS, DB_OPERATIONS = (sql.READ, sql.WRITE), sql.OPERATIONS
#: The operation word that means read and write.
BOTH = "both"
MAX_KEY = 128


class PolicyError(ValueError):
    """A change of the gate policy that cannot be made; the message says why."""


@dataclass(frozen=True)
class PolicyChange:
    """One entry of the gate defaults: `ops` of `key` (a table or `*`/`__meta__` in section db, a tool or
    `*` in section tools) run unasked (`allowed`) or are gated; `by` says who, for the audit log."""

    section: str
    key: str
    ops: tuple[str, ...]
    allowed: bool
    by: str

    @classmethod
    def parse(cls, section: str, key: str, operation: str, allowed: bool, by: str) -> PolicyChange:
        """A checked change; PolicyError says what is wrong. `operation` is one operation or `both`."""
        key = key.strip()
        if section not in SECTIONS:
            raise PolicyError(f"section must be db or tools, not {section!r}")
        if not key or len(key) > MAX_KEY or any(c.isspace() for c in key):
            raise PolicyError("key must be a tool name, a table name, '*' or '__meta__'")
        if operation == sql.DDL and section != "db":
            raise PolicyError("ddl is a permission of database tables only (section db)")
        known = DB_OPERATIONS if section == "db" else TOOL_OPERATIONS
        if operation != BOTH and operation not in known:
            raise PolicyError(f"invalid operation '{operation}': {', '.join(known)} or {BOTH}")
        ops = (sql.READ, sql.WRITE) if operation == BOTH else (operation,)
        return cls(section, key, ops, bool(allowed), by)

    def to_json(self) -> str:
        """The change as other instances receive it (`from_json`)."""
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> PolicyChange:
        data = json.loads(text)
        return cls(data["section"], data["key"], tuple(data["ops"]), bool(data["allowed"]), str(data["by"]))

    def outcome(self, note: str) -> str:
        """What the audit record of this change says happened."""
        return f"gate-defaults.json: {'auto-allow' if self.allowed else 'gated'} ({note})"


def apply(defaults: GateDefaults, change: PolicyChange) -> GatePermission | ToolPermission:
    """Make `change` in `defaults` (in memory, for every session that reads them); returns the new entry."""
    entries: dict[str, GatePermission] | dict[str, ToolPermission] = (
        defaults.db if change.section == "db" else defaults.tools)
    blank = GatePermission() if change.section == "db" else ToolPermission()
    entry = (entries.get(change.key) or blank).model_copy(update=dict.fromkeys(change.ops, change.allowed))
    entries[change.key] = entry  # type: ignore[assignment]  # the entry is of its section's type (blank above)
    return entry


def save(config_dir: Path, defaults: GateDefaults) -> str:
    """Write `defaults` to gate-defaults.json; what happened, as a note for the caller and the audit log
    (in force anyway when the file could not be written)."""
    try:
        return f"saved in {save_gate_defaults(config_dir, defaults)}"
    except Exception as exc:
        return f"in force, but NOT saved: {type(exc).__name__}: {exc}"
