"""The audit log's proof: records chained with a keyed MAC, a head checkpointed outside the log, and the check.

Each record carries `HMAC-SHA256(key, previous MAC + its fields)`; the key lives in
`<data dir>/audit-key` (0600, created at the first start; `AGENT_AUDIT_KEY_FILE` points elsewhere, e.g. to
one key shared by the instances of one Redis), never in the log. Without the key nobody can write a record
that verifies, so an edit, insertion, deletion or reorder, or a chain recomputed with plain SHA-256 or
another key, breaks the chain. Cutting the tail or emptying the file leaves a valid-looking shorter chain:
the head (record count + last MAC, itself MACed), written to `<data dir>/audit-head` after every batch, to
the server log and to Redis when sessions are there, says how long the log was. A log id, bound into the
first MAC, tells one log from another (a replaced file).

Logs written before the key (a plain SHA-256 chain) are taken over at the first start: their chain is
checked, and the first keyed record's MAC covers the last unkeyed hash and says how many there were, so
the old records can no longer be changed unnoticed either (`audit_migrated` records it).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import secrets
import sqlite3
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from secret_files import SecretFileError, ensure_secret_file, read_secret_file, write_private

KEY_FILE = "audit-key"
HEAD_FILE = "audit-head"
FORMAT = "hmac-sha256-v1"
GENESIS = "0" * 64
#: The columns of an audit record that its MAC covers, in order.
AUDIT_FIELDS = ("seq", "ts", "event", "session", "actor", "tool", "op", "tables", "args_digest", "outcome",
                "grant_id", "detail")
#: The event recorded when a session's grants end with it (deleted, expired, evicted).
GRANTS_DROPPED = "grants_dropped"
#: The event recorded when a stored grant that is not the server's is found and ignored.
GRANT_FORGED = "grant_forged"
#: The event recorded when a call's client went away while its gate waits.
CLIENT_GONE = "client_gone"
META_TABLE = "CREATE TABLE IF NOT EXISTS audit_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)"


@dataclass(frozen=True)
class AuditRecord:
    """One entry of the audit log before it is chained (`grants.GrantStore.audit` adds its seq, time and
    MAC): the event, who caused it, what it was about. Made only by the constructor of its kind."""

    event: str
    actor: str = ""
    session: str = ""
    tool: str = ""
    op: str = ""
    tables: tuple[str, ...] = ()
    #: The call's arguments: the log keeps only their digest.
    args: Any = None
    outcome: str = ""
    grant_id: str = ""
    detail: str = ""

    # ── a gated call, then what became of it ──

    @classmethod
    def call(cls, session: str, tool: str, op: str, tables: Iterable[str] = (), args: Any = None) -> AuditRecord:
        """The gated call that `decision`, `grant` and `grant_used` records are about (no event yet)."""
        return cls("", session=session, tool=tool, op=op, tables=tuple(tables), args=args)

    def with_detail(self, detail: str) -> AuditRecord:
        """The same call with `detail` (a routed gate's: who was asked, who answered, how long it waited)."""
        return replace(self, detail=detail)

    def decision(self, actor: str, outcome: str) -> AuditRecord:
        """The call was allowed once, rejected, timed out or could not be asked."""
        return replace(self, event="decision", actor=actor, outcome=outcome)

    def grant(self, actor: str, outcome: str, grant_id: str) -> AuditRecord:
        """An answer to the call created a grant (its record comes first: the grant is bound to it)."""
        return replace(self, event="grant", actor=actor, outcome=outcome, grant_id=grant_id)

    def grant_used(self, actor: str, grant_id: str) -> AuditRecord:
        """An active grant allowed the call without asking."""
        return replace(self, event="grant_used", actor=actor, outcome="allowed", grant_id=grant_id)

    # ── other events ──

    def client_gone(self, actor: str, outcome: str) -> AuditRecord:
        """The client of the call went away while its gate waits (the gate stays open for its approvers)."""
        return replace(self, event=CLIENT_GONE, actor=actor, outcome=outcome)

    @classmethod
    def approval_refused(cls, session: str, actor: str, tool: str, op: str, tables: Iterable[str],
                         detail: str, why: str = "not an approver of this gate") -> AuditRecord:
        """An answer to a routed gate was refused: by default, its sender is not an approver of it."""
        return cls("approval_refused", actor, session, tool, op, tuple(tables), outcome=why, detail=detail)

    @classmethod
    def revoke(cls, session: str, actor: str, tool: str, op: str, tables: Iterable[str], grant_id: str,
               detail: str = "") -> AuditRecord:
        return cls("revoke", actor, session, tool, op, tuple(tables), outcome="revoked", grant_id=grant_id,
                   detail=detail)

    @classmethod
    def grant_forged(cls, session: str, grant_id: str, where: str, why: str) -> AuditRecord:
        """A stored grant that is not the server's (copied from another session or store, edited, replayed
        after its revocation) was found where grants are loaded from, and ignored."""
        return cls(GRANT_FORGED, "agent-mcp", session, outcome="ignored (forged)", grant_id=grant_id,
                   detail=f"{where}: {why}")

    @classmethod
    def grants_dropped(cls, session: str) -> AuditRecord:
        """A session's grants ended with it (deleted, expired, evicted)."""
        return cls(GRANTS_DROPPED, session=session, outcome="the session ended")

    @classmethod
    def migrated(cls, unkeyed: int) -> AuditRecord:
        """A log written before the key was taken over (see the module docstring)."""
        return cls("audit_migrated", actor="agent-mcp", outcome="keyed",
                   detail=f"records 1-{unkeyed} were written before the audit key (plain SHA-256 chain, intact "
                          "when taken over); from here on every record carries a keyed MAC")

    @classmethod
    def policy(cls, actor: str, section: str, keys: Iterable[str], ops: Iterable[str], outcome: str,
               session: str = "") -> AuditRecord:
        """A change of the gates: of one session (`session`, by a gate command) or of the defaults."""
        keys = list(keys)
        return cls("policy", actor, session, "" if section == "db" else ",".join(keys), "+".join(ops),
                   tuple(keys) if section == "db" else (), outcome=outcome)

    @classmethod
    def config(cls, actor: str, file: str, outcome: str, detail: str = "") -> AuditRecord:
        """A config file the running server saved for an operator."""
        return cls("config", actor, tool=file, outcome=outcome, detail=detail)


class AuditError(Exception):
    """The audit log, its key or its head cannot be trusted; the one-line message says what and what to do."""


def key_path(data_dir: Path, env: dict[str, str] | None = None) -> Path:
    """Where the audit key is: `AGENT_AUDIT_KEY_FILE`, else `<data dir>/audit-key`."""
    own = (env or {}).get("AGENT_AUDIT_KEY_FILE")
    return Path(own) if own else Path(data_dir) / KEY_FILE


def load_key(path: Path, *, create: bool) -> bytes:
    """The audit key (created, 0600, when `create` and missing); AuditError when missing, unsafe or malformed."""
    try:
        if create:
            raw, _ = ensure_secret_file(path, lambda: (secrets.token_hex(32) + "\n").encode(), "the audit key")
        else:
            raw = read_secret_file(path, "the audit key")
    except SecretFileError as exc:
        raise AuditError(str(exc)) from None
    text = raw.decode("ascii", "replace").strip()
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = b""
    if len(key) < 32:
        raise AuditError(f"{path} is not an audit key (64 hex digits): restore it from a backup; without it the "
                         "log cannot be verified")
    return key


def _mac(key: bytes, text: str) -> str:
    return hmac.new(key, text.encode(), hashlib.sha256).hexdigest()


def record_mac(key: bytes, prev: str, fields: list[Any]) -> str:
    """The MAC of one record: its fields (AUDIT_FIELDS order) after the MAC of the one before."""
    return _mac(key, prev + json.dumps(fields, ensure_ascii=False, default=str))


def record_hash(prev: str, fields: list[Any]) -> str:
    """The unkeyed SHA-256 link of logs written before the key (checked, never written any more)."""
    return hashlib.sha256((prev + json.dumps(fields, ensure_ascii=False, default=str)).encode()).hexdigest()


def start_mac(key: bytes, log_id: str, unkeyed: int, unkeyed_last: str) -> str:
    """What the first keyed record links to: the log id and the unkeyed records before it (0 and GENESIS if none)."""
    return _mac(key, f"start:{log_id}:{unkeyed}:{unkeyed_last}")


def grant_mac(key: bytes, store: str, session: str, record: str) -> str:
    """The MAC of a stored grant: its JSON record, bound to the store that keeps it (`sqlite:<log id>`,
    `redis:<prefix>`) and the session it is kept under, so a row added, edited, or copied into another
    session or store does not carry a valid one."""
    return _mac(key, "grant-v2:" + json.dumps([store, session]) + "\n" + record)


def legacy_grant_mac(key: bytes, record: str) -> str:
    """The MAC of a grant row written before grants were bound to their store and session (checked, never
    written any more: such a row counts only when the verified chain also backs it)."""
    return _mac(key, "grant:" + record)


@dataclass(frozen=True)
class Head:
    """How long a log was when last checkpointed: its id, the record count, the last record's MAC."""

    log_id: str
    count: int
    last: str

    def sealed(self, key: bytes) -> str:
        """The head as one JSON line, MACed (the head file, the log line, the Redis value)."""
        body = {"log": self.log_id, "count": self.count, "last": self.last}
        return json.dumps({**body, "mac": _mac(key, "head:" + json.dumps(body, sort_keys=True))}, sort_keys=True)

    @classmethod
    def unseal(cls, text: str, key: bytes, where: str) -> Head:
        """A head read back; AuditError when it is not one or its MAC does not match (changed or another key)."""
        try:
            data = json.loads(text)
            head = cls(str(data["log"]), int(data["count"]), str(data["last"]))
            mac = str(data["mac"])
        except (ValueError, KeyError, TypeError):
            raise AuditError(f"audit head {where} is damaged (not a head record): the log cannot be checked for a "
                             "cut tail; restore the head from a backup or the server log") from None
        if not hmac.compare_digest(json.loads(head.sealed(key))["mac"], mac):
            raise AuditError(f"audit head {where} does not match its MAC: it was changed or written with another "
                             "key")
        return head


#: What precedes a head on a line of the server's log (and of `agentctl audit-head`).
HEAD_LINE = "audit head "


def heads_in(text: str) -> list[tuple[str, int]]:
    """The sealed heads in a text (a head file, `agentctl audit-head` output, the server's log), each with its
    line number: a line that is a head, or that holds `audit head {…}`; other lines are passed over."""
    found, decoder = [], json.JSONDecoder()
    for number, line in enumerate(text.splitlines(), 1):
        start = line.find(HEAD_LINE)
        start = line.find("{", start) if start >= 0 else (0 if line.lstrip().startswith("{") else -1)
        if start < 0:
            continue
        try:
            value, _ = decoder.raw_decode(line.lstrip() if start == 0 else line[start:])
        except ValueError:
            value = None
        if isinstance(value, dict) and {"log", "count", "last", "mac"} <= set(value):
            found.append((json.dumps(value, sort_keys=True), number))
    return found


def write_head(path: Path, head: Head, key: bytes) -> None:
    write_private(path, (head.sealed(key) + "\n").encode())


def read_head(path: Path, key: bytes) -> Head | None:
    """The head file, or None when there is none; AuditError when damaged."""
    try:
        text = read_secret_file(path, "the audit head").decode("utf-8", "replace")
    except SecretFileError as exc:
        if not path.exists():
            return None
        raise AuditError(str(exc)) from None
    return Head.unseal(text, key, str(path))


@dataclass
class Verified:
    """What a verified log holds: its head as it is now, the grant records in it (grant id → seq), how many
    records are unkeyed, how many were written after the checkpointed head."""

    head: Head
    grant_records: dict[str, int]
    unkeyed: int
    after_checkpoint: int = 0
    #: Grants the chain says were revoked, and sessions whose grants ended with them (session → last seq):
    #: a stored row of one of those is never honoured again, however valid its MAC (a replayed row).
    revoked: set[str] = field(default_factory=set)
    dropped: dict[str, int] = field(default_factory=dict)
    #: The session each grant record names (grant id → session).
    grant_sessions: dict[str, str] = field(default_factory=dict)
    #: Where the heads it was checked against came from (the head file first).
    heads: list[str] = field(default_factory=list)

    def backs(self, grant_id: str, session: str, audit_seq: int) -> bool:
        """Whether the chain holds this grant's record, for this session, and neither its revocation nor its
        session's end."""
        return self.why_not(grant_id, session, audit_seq) is None

    def why_not(self, grant_id: str, session: str, audit_seq: int) -> str | None:
        """Why the chain does not back this grant (None when it does), for a log line or audit-verify."""
        if self.grant_records.get(grant_id) != audit_seq:
            return "its grant record is not in the verified audit chain"
        if self.grant_sessions.get(grant_id, session) != session:
            return f"its grant record is of session {self.grant_sessions[grant_id]}, not {session}"
        if grant_id in self.revoked:
            return "it was revoked (a copy put back after its revocation)"
        if self.dropped.get(session, 0) >= audit_seq:
            return "its session's grants ended (a copy put back after the session ended)"
        return None


def read_meta(db: sqlite3.Connection) -> dict[str, str]:
    try:
        return dict(db.execute("SELECT key, value FROM audit_meta"))
    except sqlite3.DatabaseError:  # no table, or not an SQLite file: verify_log says which
        return {}


def verify_rows(rows: Iterable[tuple[Any, ...]], key: bytes, meta: dict[str, str], head: Head | None,
                where: str, others: Sequence[tuple[Head, str]] = ()) -> Verified:
    """Check `(…AUDIT_FIELDS, prev, mac)` rows in seq order against the log's meta and its checkpointed `head`,
    then against every head of `others` (head, where it was found) of this log; AuditError names the first
    record that breaks the chain, or how the log differs from a head."""
    log_id, unkeyed = meta.get("log_id", ""), int(meta.get("unkeyed", "0") or 0)
    if meta.get("format") != FORMAT or not log_id:
        raise AuditError("the log has no keyed-chain header (audit_meta): the file was replaced or damaged")
    if head is None:
        raise AuditError(f"its head {where} is missing: cannot tell whether the log's tail was cut; "
                         "restore it from a backup or from the last 'audit head' line of the server log")
    if head.log_id != log_id:
        raise AuditError(f"the log is not the one its head describes (log {log_id}, head of log {head.log_id}): "
                         "the file was replaced")
    prev, expected = GENESIS, 1
    at_head = start_mac(key, log_id, unkeyed, GENESIS) if unkeyed == 0 else None
    grant_records: dict[str, int] = {}
    grant_sessions: dict[str, str] = {}
    others = [(h, w) for h, w in others if h.log_id == log_id]
    wanted = {h.count for h, _ in others}
    at: dict[int, str] = {0: start_mac(key, log_id, 0, GENESIS)} if unkeyed == 0 else {}
    revoked: set[str] = set()
    dropped: dict[str, int] = {}
    for row in rows:
        fields, stored_prev, stored = list(row[:len(AUDIT_FIELDS)]), row[-2], str(row[-1])
        seq = fields[0]
        if seq != expected:
            raise AuditError(f"record {expected} is missing (the next one is {seq}): records were deleted, "
                             "inserted or renumbered")
        if seq == unkeyed + 1:  # the first keyed record links to the log id and the unkeyed records
            prev = start_mac(key, log_id, unkeyed, prev)
        if stored_prev != prev:
            raise AuditError(f"record {seq}: its link to the record before does not match (a record was deleted, "
                             "inserted, moved or changed)")
        if seq <= unkeyed:
            if record_hash(prev, fields) != stored:
                raise AuditError(f"record {seq} (written before the key) does not match its hash: it was changed")
        elif not hmac.compare_digest(record_mac(key, prev, fields), stored):
            raise AuditError(f"record {seq} does not match its MAC: it was changed, or the chain was recomputed "
                             "without the key")
        if fields[2] == "grant" and fields[10]:
            grant_records[str(fields[10])] = seq
            grant_sessions[str(fields[10])] = str(fields[3] or "")
        elif fields[2] == "revoke" and fields[10]:
            revoked.add(str(fields[10]))
        elif fields[2] == GRANTS_DROPPED:
            dropped[str(fields[3])] = seq
        if seq == head.count:
            at_head = stored
        if seq in wanted:
            at[seq] = stored
        prev, expected = stored, expected + 1
    count = expected - 1
    if count < max(head.count, unkeyed):
        raise AuditError(f"the log has {count} records but its head says {head.count}: the tail was cut "
                         f"({head.count - count} records missing) or the file was emptied")
    if at_head is None or not hmac.compare_digest(at_head, head.last):
        raise AuditError(f"record {head.count} is not the one its head recorded: the log was replaced or "
                         "rewritten")
    for other, found_in in others:
        if other.count > count:
            raise AuditError(f"the log has {count} records but the head {found_in} says {other.count}: the tail "
                             f"was cut ({other.count - count} records missing) and {where} put back to match, or "
                             "the log and its head replaced by an older copy")
        if other.count not in at or not hmac.compare_digest(at[other.count], other.last):
            raise AuditError(f"record {other.count} is not the one the head {found_in} recorded: the log was "
                             "replaced or rewritten")
    last = prev if count > unkeyed else start_mac(key, log_id, unkeyed, prev)
    heads = [where, *dict.fromkeys(w for _, w in others)]
    return Verified(Head(log_id, count, last), grant_records, unkeyed, count - head.count, revoked, dropped,
                    grant_sessions, heads)


def verify_log(db: sqlite3.Connection, key: bytes, head: Head | None, where: str,
               others: Sequence[tuple[Head, str]] = ()) -> Verified:
    """Verify an open log against its head (`where`: the head's file) and `others` (heads kept elsewhere);
    AuditError (one line) when anything does not hold."""
    try:
        rows = db.execute(f"SELECT {', '.join(AUDIT_FIELDS)}, prev, hash FROM audit ORDER BY seq")
        return verify_rows(rows, key, read_meta(db), head, where, others)
    except sqlite3.DatabaseError as exc:
        raise AuditError(f"not a readable audit log ({exc}): it is damaged or not an SQLite file; "
                         "restore it from a backup") from None


@contextlib.contextmanager
def open_readonly(path: Path) -> Iterator[sqlite3.Connection]:
    """An existing log, read-only (a missing file is an AuditError, never created)."""
    if not path.exists():
        raise AuditError(f"{path} does not exist: the server has recorded no gate decision in this data dir")
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    except sqlite3.Error as exc:
        raise AuditError(f"{path} cannot be opened ({exc})") from None
    with contextlib.closing(db):
        yield db
