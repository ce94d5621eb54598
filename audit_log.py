"""A data dir's audit log and grants as agentctl reads them, also while the server is stopped:
the records (with a routed gate's detail for a person), verifying the chain, the grants the server
would honour, revoking them offline.

The log is written by `grants.GrantStore.audit` and chained by `audit_chain`.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import sqlite3
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import audit_chain
from audit_chain import AUDIT_FIELDS, AuditError, Head
from grants import OLDER_FORMAT, Grant, GrantStore, from_record, shared_grant, stored_grant


def routed_detail(asked: list[str], client: str, by: str, channel: str, waited: float) -> str:
    """The `detail` of the audit record deciding a gate routed to approvers (approvals.py): where it was
    asked, who answered through which channel, how long it waited."""
    return json.dumps({"routed": True, "asked": asked, "client": client, "by": by, "channel": channel,
                       "waited_s": round(waited, 3)}, ensure_ascii=False)


def describe_detail(detail: str | None) -> str:
    """The `detail` of a routed gate's audit record as one line for a person (`agentctl audit`); "" for others."""
    try:
        data = json.loads(detail or "")
    except ValueError:
        return ""
    if not isinstance(data, dict) or data.get("routed") is not True:
        return ""
    answered = f"answered by {data.get('by')} via {data.get('channel')}" if data.get("by") else "nobody answered"
    return (f"routed ({data.get('client')}) to {', '.join(data.get('asked') or [])}; {answered} after "
            f"{float(data.get('waited_s') or 0):.1f} s")


def shown(record: dict[str, Any]) -> str:
    """An audit record's outcome as `agentctl audit` shows it: with a routed gate's line (`describe_detail`)."""
    return " — ".join(filter(None, [record["outcome"], describe_detail(record["detail"])]))


def read_audit(path: Path, since: float | None = None, session: str | None = None) -> Iterator[dict[str, Any]]:
    """The audit records of a data dir's log, oldest first (for `agentctl audit`)."""
    with audit_chain.open_readonly(path) as db:
        query = f"SELECT {', '.join(AUDIT_FIELDS)} FROM audit WHERE ts >= ? AND (? IS NULL OR session = ?) ORDER BY seq"
        try:
            for row in db.execute(query, (since or 0, session, session)):
                record = dict(zip(AUDIT_FIELDS, row, strict=True))
                record["tables"] = json.loads(record["tables"] or "[]")
                yield record
        except (sqlite3.DatabaseError, ValueError) as exc:
            raise AuditError(f"{path} is not a readable audit log ({exc}): run agentctl audit-verify") from None


@dataclass
class HeadSource:
    """Heads kept outside the data dir to check the log against: `text` holds them (`audit_chain.heads_in`);
    `required`: it must hold a head of this log (an operator's head file), else heads of other logs and no
    head at all are passed over (a server log that also covers earlier logs)."""

    text: str
    where: str
    required: bool = True


def verify_file(path: Path, key_file: Path | None = None, shared_head: str | None = None,
                sources: Sequence[HeadSource] = ()) -> audit_chain.Verified:
    """Check a data dir's audit chain against its key and head, and every grant row of the file (for `agentctl
    audit-verify`); AuditError (one line) says what does not hold. `shared_head`: the head checkpointed in Redis,
    when sessions are there; `sources`: heads kept elsewhere (a head file, the server's log, `--head`);
    the grants kept in Redis are checked apart (`check_shared_grants`)."""
    key = audit_chain.load_key(key_file or audit_chain.key_path(path.parent), create=False)
    head_file = path.parent / audit_chain.HEAD_FILE
    head = audit_chain.read_head(head_file, key)
    others = [(Head.unseal(shared_head, key, "in Redis"), "checkpointed in Redis")] if shared_head else []
    with audit_chain.open_readonly(path) as db:
        log_id = audit_chain.read_meta(db).get("log_id", "")
        for source in sources:
            others += _heads(source, key, log_id)
        try:
            db.execute("BEGIN")  # the chain and the grants table as of one moment (the server may be writing)
        except sqlite3.DatabaseError:
            pass  # not an SQLite file: verify_log says so
        found = audit_chain.verify_log(db, key, head, str(head_file), others)
        try:
            rows = db.execute("SELECT id, session, record, mac FROM grants").fetchall()
        except sqlite3.DatabaseError as exc:
            raise AuditError(f"its grants table cannot be read ({exc}): the file is damaged") from None
    bad = []
    for grant_id, session, record, mac in rows:
        _, why = stored_grant(key, f"sqlite:{found.head.log_id}", str(session), str(grant_id), str(record), mac,
                              found)
        if why:
            bad.append(f"grant {grant_id!r} of session {str(session)[:64]!r}: {why}")
    if bad:
        raise AuditError(f"{len(bad)} row(s) of its grants table are not the server's: {'; '.join(bad)}; the server "
                         "never honours them and drops them at its next start (audited as grant_forged): keep a "
                         "copy of the file as evidence")
    return found


def _heads(source: HeadSource, key: bytes, log_id: str) -> list[tuple[Head, str]]:
    """The heads of log `log_id` in one source, each named by where it is (file and line)."""
    heads = [(Head.unseal(text, key, f"{source.where} line {number}"), f"{source.where} line {number}")
             for text, number in audit_chain.heads_in(source.text)]
    ours = [(h, w) for h, w in heads if h.log_id == log_id]
    if source.required and not ours:
        what = f"only heads of other logs ({', '.join(sorted({h.log_id for h, _ in heads}))})" if heads else "no head"
        raise AuditError(f"{source.where} holds {what}, none of this log ({log_id}): the log was replaced, or "
                         "that is not its head (agentctl audit-head prints it)")
    return ours


def check_shared_grants(key: bytes, prefix: str, entries: Sequence[tuple[str, str, str, bool]]) -> None:
    """Every grant kept in Redis under `prefix`, (session, grant id, value, tombstoned) each, as the server would
    take it; AuditError names those it would ignore as forgeries."""
    bad = []
    for session, grant_id, value, tombstoned in entries:
        _, why = shared_grant(key, f"redis:{prefix}", session, grant_id, value, tombstoned)
        if why and why != OLDER_FORMAT:
            bad.append(f"grant {grant_id[:64]!r} in {prefix}grants:{session[:64]}: {why}")
    if bad:
        raise AuditError(f"{len(bad)} grant(s) kept in Redis are not the server's: {'; '.join(bad)}; no instance "
                         "honours them (each audits them as grant_forged when it meets them): delete them with "
                         "redis-cli HDEL once recorded")


def read_grants(path: Path, now: float | None = None, key_file: Path | None = None) -> list[Grant]:
    """The grants that can still allow and whose rows carry the server's MAC for this log and their session
    (for `agentctl grants`; the server also checks them against the chain: `agentctl audit-verify`)."""
    now = time.time() if now is None else now
    key = audit_chain.load_key(key_file or audit_chain.key_path(path.parent), create=False)
    with audit_chain.open_readonly(path) as db:
        try:
            store = f"sqlite:{audit_chain.read_meta(db).get('log_id', '')}"
            rows = db.execute("SELECT id, session, record, mac FROM grants").fetchall()
        except sqlite3.DatabaseError as exc:
            raise AuditError(f"{path} is not a readable audit log ({exc}): run agentctl audit-verify") from None
    found = []
    for grant_id, session, record, mac in rows:
        grant, _ = stored_grant(key, store, session, grant_id, record, mac, None)
        if grant is None and hmac.compare_digest(audit_chain.legacy_grant_mac(key, record), mac or ""):
            # Written before grants were bound (the server checks its chain record), if kept where it was made.
            legacy = from_record(record)
            grant = legacy if (legacy.id, legacy.session) == (grant_id, session) else None
        if grant is not None:
            found.append(grant)
    return sorted((g for g in found if g.active(now)), key=lambda g: g.created)


def revoke_offline(path: Path, which: str, actor: str, key_file: Path | None = None) -> list[Grant]:
    """Revoke grants in a data dir while the server is stopped (`which`: an id, or `all`), audited like the
    server does; AuditError when the server holds the file or the log does not verify."""

    async def run() -> list[Grant]:
        store = GrantStore(path, key_file=key_file)
        await store.open()
        try:
            return [g for session in list(store.grants) for g in store.revoke(session, which, actor,
                                                                               detail="offline (agentctl)")]
        finally:
            await store.close()

    return asyncio.run(run())
