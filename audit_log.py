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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import audit_chain
from audit_chain import AUDIT_FIELDS, AuditError, Head
from grants import Grant, GrantStore, from_record


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


def verify_file(path: Path, key_file: Path | None = None, shared_head: str | None = None) -> audit_chain.Verified:
    """Check a data dir's audit chain against its key and head (for `agentctl audit-verify`); AuditError (one
    line) says what does not hold. `shared_head`: the head checkpointed in Redis, when sessions are there."""
    key = audit_chain.load_key(key_file or audit_chain.key_path(path.parent), create=False)
    head_file = path.parent / audit_chain.HEAD_FILE
    head = audit_chain.read_head(head_file, key)
    with audit_chain.open_readonly(path) as db:
        found = audit_chain.verify_log(db, key, head, str(head_file))
    if shared_head is not None:
        other = Head.unseal(shared_head, key, "in Redis")
        if other.count > found.head.count or (other.count == found.head.count and other.last != found.head.last):
            raise AuditError(f"the head checkpointed in Redis says {other.count} records, {path} has "
                             f"{found.head.count} that do not end where it says: the log was cut or rewritten")
    return found


def read_grants(path: Path, now: float | None = None, key_file: Path | None = None) -> list[Grant]:
    """The grants that can still allow and that the server would honour (for `agentctl grants`)."""
    now = time.time() if now is None else now
    key = audit_chain.load_key(key_file or audit_chain.key_path(path.parent), create=False)
    with audit_chain.open_readonly(path) as db:
        try:
            rows = db.execute("SELECT record, mac FROM grants").fetchall()
        except sqlite3.DatabaseError as exc:
            raise AuditError(f"{path} is not a readable audit log ({exc}): run agentctl audit-verify") from None
    found = [from_record(r) for r, m in rows if hmac.compare_digest(audit_chain.grant_mac(key, r), m or "")]
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
