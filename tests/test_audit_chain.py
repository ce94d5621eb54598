"""The audit log's keyed chain and its head: every tampering found (on copies of one real log), one line each.

The log is written by the server's own GrantStore; each case copies the data dir, damages one thing and
runs `agentctl audit-verify` (in process, through its `main`; one case as a subprocess to see stderr
whole), which must exit 2 with one line naming what does not hold, never a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import os
import shutil
import sqlite3
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import agentctl
import audit_chain
import audit_log
import grants
from audit_chain import AuditRecord
from tests.conftest import ROOT, ConfigDir

MODEL = {"type": "OPENAI", "model_id": "m", "host": "http://127.0.0.1:9/v1"}
FIELDS = ", ".join(audit_chain.AUDIT_FIELDS)


def _write_log(data_dir: Path, records: int = 8, key_file: Path | None = None) -> grants.Grant:
    """A real log: decisions, a grant (bound to its record), its uses, a policy change; closed cleanly."""

    async def run() -> grants.Grant:
        store = grants.GrantStore(data_dir / grants.AUDIT_FILE, key_file=key_file)
        await store.open()
        try:
            decision = grants.Decision("allow_session", "shell")
            grant = grants.new_grant("c1", decision, "db_query", "db", ["users"], "write")
            call = AuditRecord.call("c1", "db_query", "write", ["users"])
            grant.audit_seq = store.audit(call.grant("shell", "granted", grant.id))
            store.add(grant)
            for i in range(records - 2):
                store.used(grant)
                used = AuditRecord.call("c1", "db_query", "write", ["users"], {"sql": f"UPDATE users SET n = {i}"})
                store.audit(used.grant_used("shell:c1", grant.id))
            store.audit(AuditRecord.policy("shell", "tools", ["web_search"], ["read"], "auto-allow"))
            return grant
        finally:
            await store.close()

    return asyncio.run(run())


@pytest.fixture(scope="module")
def real_log(tmp_path_factory) -> Path:
    """A config dir whose data dir holds a real log of 8 records, its key and its head."""
    cfg = ConfigDir(tmp_path_factory.mktemp("log"))
    cfg.models = {"m": MODEL}
    cfg.write()
    _write_log(cfg.path / "data")
    return cfg.path


def _copy(real_log: Path, tmp_path: Path) -> Path:
    target = tmp_path / "cfg"
    shutil.copytree(real_log, target)
    return target


@contextlib.contextmanager
def _db(cfg: Path) -> Iterator[sqlite3.Connection]:
    """The copy's log, autocommit, closed afterwards (so no WAL is left behind)."""
    with contextlib.closing(sqlite3.connect(cfg / "data" / grants.AUDIT_FILE, isolation_level=None)) as db:
        yield db


def _rows(db: sqlite3.Connection) -> list[list]:
    return [list(r) for r in db.execute(f"SELECT {FIELDS}, prev, hash FROM audit ORDER BY seq")]


def _rewrite(cfg: Path, link: Callable[[str, list], str], change: Callable[[list[list]], list[list]]) -> None:
    """Replace every record by `change(rows)`, chained again with `link(prev, fields)` from the first record's
    stored link (what an attacker without the key can read)."""
    with _db(cfg) as db:
        rows = change(_rows(db))
        db.execute("DELETE FROM audit")
        prev = rows[0][-2]
        for row in rows:
            fields = row[:len(audit_chain.AUDIT_FIELDS)]
            mac = link(prev, fields)
            db.execute(f"INSERT INTO audit ({FIELDS}, prev, hash) VALUES ({', '.join('?' * (len(fields) + 2))})",
                       (*fields, prev, mac))
            prev = mac


def _sha(prev: str, fields: list) -> str:
    return hashlib.sha256((prev + json.dumps(fields, ensure_ascii=False, default=str)).encode()).hexdigest()


def _wrong_key(prev: str, fields: list) -> str:
    return hmac.new(b"k" * 32, (prev + json.dumps(fields, ensure_ascii=False, default=str)).encode(),
                    hashlib.sha256).hexdigest()


def _edit(cfg: Path) -> None:
    with _db(cfg) as db:
        db.execute("UPDATE audit SET outcome = 'denied' WHERE seq = 3")


def _delete(cfg: Path) -> None:
    with _db(cfg) as db:
        db.execute("DELETE FROM audit WHERE seq = 4")


def _delete_and_renumber(cfg: Path) -> None:
    with _db(cfg) as db:
        db.execute("DELETE FROM audit WHERE seq = 4")
        db.execute("UPDATE audit SET seq = seq + 99 WHERE seq > 4")
        db.execute("UPDATE audit SET seq = seq - 100 WHERE seq > 99")


def _insert(cfg: Path) -> None:
    """A forged record in the middle, the ones after it moved up, every link kept plausible."""
    with _db(cfg) as db:
        rows = _rows(db)
        forged = [*rows[2][:len(audit_chain.AUDIT_FIELDS)]]
        forged[0], forged[9] = 4, "allowed (forged)"
        db.execute("UPDATE audit SET seq = seq + 100 WHERE seq >= 4")
        db.execute("UPDATE audit SET seq = seq - 99 WHERE seq > 100")
        db.execute(f"INSERT INTO audit ({FIELDS}, prev, hash) VALUES ({', '.join('?' * 14)})",
                   (*forged, rows[2][-1], _sha(rows[2][-1], forged)))


def _append(cfg: Path) -> None:
    with _db(cfg) as db:
        last = _rows(db)[-1]
        fields = [last[0] + 1, *last[1:len(audit_chain.AUDIT_FIELDS)]]
        db.execute(f"INSERT INTO audit ({FIELDS}, prev, hash) VALUES ({', '.join('?' * 14)})",
                   (*fields, last[-1], _sha(last[-1], fields)))


def _reorder(cfg: Path) -> None:
    with _db(cfg) as db:
        db.execute("UPDATE audit SET seq = 100 WHERE seq = 5")
        db.execute("UPDATE audit SET seq = 5 WHERE seq = 6")
        db.execute("UPDATE audit SET seq = 6 WHERE seq = 100")


def _recomputed_sha(cfg: Path) -> None:
    def change(rows: list[list]) -> list[list]:
        rows[2][9] = "denied"
        return rows
    _rewrite(cfg, _sha, change)


def _recomputed_other_key(cfg: Path) -> None:
    _rewrite(cfg, _wrong_key, lambda rows: rows)


def _truncate_tail(cfg: Path) -> None:
    with _db(cfg) as db:
        db.execute("DELETE FROM audit WHERE seq > 6")


def _empty_table(cfg: Path) -> None:
    with _db(cfg) as db:
        db.execute("DELETE FROM audit")


def _empty_file(cfg: Path) -> None:
    (cfg / "data" / grants.AUDIT_FILE).write_bytes(b"")


def _garbage_file(cfg: Path) -> None:
    (cfg / "data" / grants.AUDIT_FILE).write_bytes(os.urandom(4096))


def _replaced_by_another_log(cfg: Path) -> None:
    """Another log, valid in itself, written with the same key (another data dir of the same operator)."""
    other = cfg.parent / "other"
    other.mkdir()
    shutil.copy(cfg / "data" / audit_chain.KEY_FILE, other / audit_chain.KEY_FILE)
    _write_log(other, records=8)
    for suffix in ("", "-wal", "-shm"):
        (cfg / "data" / (grants.AUDIT_FILE + suffix)).unlink(missing_ok=True)
    shutil.copy(other / grants.AUDIT_FILE, cfg / "data" / grants.AUDIT_FILE)


def _replaced_by_an_older_copy(cfg: Path) -> None:
    """The same log as it was earlier (a backup), head left as it is now."""
    older = cfg.parent / "older"
    shutil.copytree(cfg / "data", older)
    with contextlib.closing(sqlite3.connect(older / grants.AUDIT_FILE, isolation_level=None)) as db:
        db.execute("DELETE FROM audit WHERE seq > 5")
    shutil.copy(older / grants.AUDIT_FILE, cfg / "data" / grants.AUDIT_FILE)


def _head_missing(cfg: Path) -> None:
    (cfg / "data" / audit_chain.HEAD_FILE).unlink()


def _head_damaged(cfg: Path) -> None:
    (cfg / "data" / audit_chain.HEAD_FILE).write_text("{not json")


def _head_lowered_with_tail(cfg: Path) -> None:
    """Tail cut and the head's count lowered to match (its MAC cannot be recomputed without the key)."""
    _truncate_tail(cfg)
    path = cfg / "data" / audit_chain.HEAD_FILE
    head = json.loads(path.read_text())
    with _db(cfg) as db:
        head["count"], head["last"] = 6, _rows(db)[-1][-1]
    path.write_text(json.dumps(head))


def _meta_changed(cfg: Path) -> None:
    with _db(cfg) as db:
        db.execute("UPDATE audit_meta SET value = 'feedfacefeedface' WHERE key = 'log_id'")


def _meta_dropped(cfg: Path) -> None:
    with _db(cfg) as db:
        db.execute("DROP TABLE audit_meta")


def _key_missing(cfg: Path) -> None:
    (cfg / "data" / audit_chain.KEY_FILE).unlink()


def _key_readable(cfg: Path) -> None:
    os.chmod(cfg / "data" / audit_chain.KEY_FILE, 0o644)


def _key_replaced(cfg: Path) -> None:
    (cfg / "data" / audit_chain.KEY_FILE).write_text(os.urandom(32).hex())
    os.chmod(cfg / "data" / audit_chain.KEY_FILE, 0o600)


def _grant_row_forged(cfg: Path) -> None:
    """A grants row added by hand: the real grant's record widened to another table, under a new id."""
    with _db(cfg) as db:
        (record, mac) = db.execute("SELECT record, mac FROM grants").fetchone()
        forged = {**json.loads(record), "id": "gforged", "keys": ["salaries"]}
        db.execute("INSERT INTO grants (id, session, record, mac) VALUES (?, ?, ?, ?)",
                   ("gforged", "c1", json.dumps(forged, sort_keys=True), mac))


def _grant_row_moved(cfg: Path) -> None:
    with _db(cfg) as db:
        db.execute("UPDATE grants SET session = 'c9'")


def _grant_row_replayed(cfg: Path) -> None:
    """The grant revoked (offline, audited), then its saved row put back: a valid MAC, a revoke in the chain."""
    with _db(cfg) as db:
        saved = db.execute("SELECT id, session, record, mac FROM grants").fetchone()
    audit_log.revoke_offline(cfg / "data" / grants.AUDIT_FILE, "all", actor="agentctl")
    with _db(cfg) as db:
        db.execute("INSERT INTO grants (id, session, record, mac) VALUES (?, ?, ?, ?)", saved)


#: (case, damage, what the one line must say)
TAMPERING = [
    ("edited record", _edit, "record 3 does not match its MAC"),
    ("deleted record", _delete, "record 4 is missing"),
    ("deleted record, the rest renumbered", _delete_and_renumber, "record 4"),
    ("inserted record", _insert, "record 4 does not match its MAC"),
    ("appended record without the key", _append, "record 9 does not match its MAC"),
    ("reordered records", _reorder, "record 5"),
    ("chain recomputed with plain SHA-256", _recomputed_sha, "record 1 does not match its MAC"),
    ("chain recomputed with another key", _recomputed_other_key, "record 1 does not match its MAC"),
    ("tail cut", _truncate_tail, "has 6 records but its head says 8: the tail was cut"),
    ("every record deleted", _empty_table, "has 0 records but its head says 8"),
    ("file emptied", _empty_file, "not a readable audit log"),
    ("file replaced by garbage", _garbage_file, "not a readable audit log"),
    ("file replaced by another valid log", _replaced_by_another_log, "the file was replaced"),
    ("file replaced by an older copy", _replaced_by_an_older_copy, "has 5 records but its head says 8"),
    ("head missing", _head_missing, "is missing: cannot tell whether the log's tail was cut"),
    ("head damaged", _head_damaged, "is damaged"),
    ("tail cut and head lowered to match", _head_lowered_with_tail, "does not match its MAC"),
    ("log id changed", _meta_changed, "the file was replaced"),
    ("chain header dropped", _meta_dropped, "no keyed-chain header"),
    ("key missing", _key_missing, "does not exist"),
    ("key readable by others", _key_readable, "run chmod 600"),
    ("key replaced", _key_replaced, "does not match its MAC"),
    ("grants row forged", _grant_row_forged, "grant 'gforged' of session 'c1': its MAC does not hold"),
    ("grants row moved to another session", _grant_row_moved, "of session 'c9': it holds a grant of session 'c1'"),
    ("grants row put back after its revoke", _grant_row_replayed, "put back after its revocation"),
]


def _verify(cfg: Path, capsys, *options: str, command: str = "audit-verify") -> tuple[int, str, str]:
    """`agentctl audit-verify` through its main; the logger it sets up for itself is put back afterwards."""
    logger = logging.getLogger("agent_mcp")
    handlers, propagate = logger.handlers[:], logger.propagate
    try:
        code = agentctl.main(["--config-dir", str(cfg), command, *options])
    finally:
        logger.handlers[:], logger.propagate = handlers, propagate
    out = capsys.readouterr()
    return code, out.out, out.err


def test_the_real_log_verifies(real_log, tmp_path, capsys) -> None:
    code, out, err = _verify(_copy(real_log, tmp_path), capsys)
    assert code == 0, err
    assert "8 records, chain intact and matches its head" in out


@pytest.mark.parametrize("damage,reason", [c[1:] for c in TAMPERING], ids=[c[0] for c in TAMPERING])
def test_every_tampering_is_found_with_one_line(real_log, tmp_path, capsys, damage, reason) -> None:
    cfg = _copy(real_log, tmp_path)
    damage(cfg)
    code, out, err = _verify(cfg, capsys)
    assert code == 2, out
    line = err.strip()
    assert reason in line, line
    assert "\n" not in line and "Traceback" not in err + out


def test_a_damaged_log_is_one_line_on_stderr_of_the_real_cli(real_log, tmp_path) -> None:
    cfg = _copy(real_log, tmp_path)
    _garbage_file(cfg)
    done = subprocess.run([sys.executable, str(ROOT / "agentctl.py"), "--config-dir", str(cfg), "audit-verify"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "Traceback" not in done.stderr + done.stdout


def test_the_server_refuses_to_extend_a_log_that_does_not_verify(real_log, tmp_path) -> None:
    """Appending to a cut log would move the head over the gap: the store refuses to open it instead."""
    cfg = _copy(real_log, tmp_path)
    _truncate_tail(cfg)

    async def run() -> None:
        store = grants.GrantStore(cfg / "data" / grants.AUDIT_FILE)
        with pytest.raises(grants.AuditError, match=r"the tail was cut.*move .* aside"):
            await store.open()

    asyncio.run(run())
    with _db(cfg) as db:
        assert len(_rows(db)) == 6  # nothing was written


def test_records_written_after_the_last_checkpoint_are_accepted(real_log, tmp_path, capsys) -> None:
    """A server stopped between a commit and its head write: the file is longer than the head, validly MACed."""
    cfg = _copy(real_log, tmp_path)
    head_file = cfg / "data" / audit_chain.HEAD_FILE
    before = head_file.read_bytes()
    _write_more = grants.GrantStore(cfg / "data" / grants.AUDIT_FILE)

    async def run() -> None:
        await _write_more.open()
        _write_more.audit(AuditRecord.call("c1", "", "").decision("shell", "rejected"))
        await _write_more.close()

    asyncio.run(run())
    head_file.write_bytes(before)  # as if the head write after the last batch never happened
    code, out, err = _verify(cfg, capsys)
    assert code == 0 and "9 records, 1 after the last checkpoint" in out, err


def test_a_grant_row_not_backed_by_its_record_is_ignored_after_a_restart(real_log, tmp_path, caplog) -> None:
    cfg = _copy(real_log, tmp_path)
    path = cfg / "data" / grants.AUDIT_FILE
    with _db(cfg) as db:
        (record,) = db.execute("SELECT record FROM grants").fetchone()
        real = json.loads(record)
        forged = {**real, "id": "gforged", "keys": ["salaries"]}
        db.execute("INSERT INTO grants (id, session, record, mac) VALUES (?, ?, ?, ?)",
                   ("gforged", "c1", json.dumps(forged, sort_keys=True), "0" * 64))
        unmacked = {**real, "id": "gnomac"}
        db.execute("INSERT INTO grants (id, session, record) VALUES (?, ?, ?)",
                   ("gnomac", "c1", json.dumps(unmacked, sort_keys=True)))
        edited = {**real, "keys": ["users", "salaries"]}  # the real grant widened, its MAC left as it was
        db.execute("UPDATE grants SET record = ? WHERE id = ?", (json.dumps(edited, sort_keys=True), real["id"]))

    async def run() -> list[str]:
        store = grants.GrantStore(path)
        await store.open()
        try:
            return [g.id for g in store.active("c1")]
        finally:
            await store.close()

    with caplog.at_level("WARNING", logger="agent_mcp.grants"):
        assert asyncio.run(run()) == []
    ignored = [r.getMessage() for r in caplog.records if "is ignored as a forgery" in r.getMessage()]
    assert len(ignored) == 3 and all("its MAC does not hold" in m for m in ignored), ignored
    forged = [r for r in audit_log.read_audit(path) if r["event"] == audit_chain.GRANT_FORGED]
    assert sorted(r["grant_id"] for r in forged) == sorted(["gforged", "gnomac", real["id"]])


def test_a_grant_with_a_valid_mac_but_no_record_in_the_chain_is_ignored(real_log, tmp_path, caplog) -> None:
    """A row copied from another log of the same key (a valid MAC) is still not honoured: no grant record here."""
    cfg = _copy(real_log, tmp_path)
    key = audit_chain.load_key(cfg / "data" / audit_chain.KEY_FILE, create=False)
    grant = grants.new_grant("c1", grants.Decision("allow_session", "shell"), "db_query", "db", ["salaries"], "write")
    grant.audit_seq = 3  # a record of the chain, but not this grant's
    record = grants.canonical(grant)
    with _db(cfg) as db:
        (log_id,) = db.execute("SELECT value FROM audit_meta WHERE key = 'log_id'").fetchone()
        db.execute("INSERT INTO grants (id, session, record, mac) VALUES (?, ?, ?, ?)",
                   (grant.id, "c1", record, audit_chain.grant_mac(key, f"sqlite:{log_id}", "c1", record)))

    async def run() -> list[str]:
        store = grants.GrantStore(cfg / "data" / grants.AUDIT_FILE)
        await store.open()
        try:
            return [g.id for g in store.active("c1")]
        finally:
            await store.close()

    with caplog.at_level("WARNING", logger="agent_mcp.grants"):
        active = asyncio.run(run())
    assert grant.id not in active and len(active) == 1  # the real grant still holds
    assert any(grant.id in r.getMessage() and "not in the verified audit chain" in r.getMessage()
               for r in caplog.records)


def test_a_log_written_before_the_key_is_taken_over_and_then_protected(tmp_path, capsys) -> None:
    """The old format (plain SHA-256 chain, no meta, no head): checked, bound into the keyed chain, recorded."""
    cfg = ConfigDir(tmp_path / "cfg")
    cfg.path.mkdir()
    cfg.models = {"m": MODEL}
    cfg.write()
    data = cfg.path / "data"
    data.mkdir(mode=0o700)
    old = data / grants.AUDIT_FILE
    with contextlib.closing(sqlite3.connect(old, isolation_level=None)) as db:
        db.execute("CREATE TABLE audit (seq INTEGER PRIMARY KEY, ts REAL NOT NULL, event TEXT NOT NULL, session TEXT,"
                   " actor TEXT, tool TEXT, op TEXT, tables TEXT, args_digest TEXT, outcome TEXT, grant_id TEXT,"
                   " detail TEXT, prev TEXT NOT NULL, hash TEXT NOT NULL)")
        db.execute("CREATE TABLE grants (id TEXT PRIMARY KEY, session TEXT NOT NULL, record TEXT NOT NULL)")
        prev = audit_chain.GENESIS
        for seq in (1, 2, 3):
            fields = [seq, 1000.0 + seq, "decision", "c1", "shell", "t", "read", "[]", "", "allowed", "", ""]
            db.execute(f"INSERT INTO audit ({FIELDS}, prev, hash) VALUES ({', '.join('?' * 14)})",
                       (*fields, prev, _sha(prev, fields)))
            prev = _sha(prev, fields)

    async def run() -> None:
        store = grants.GrantStore(old)
        await store.open()
        await store.close()

    asyncio.run(run())
    records = list(audit_log.read_audit(old))
    assert [r["event"] for r in records] == ["decision"] * 3 + ["audit_migrated"]
    assert "records 1-3 were written before the audit key" in records[-1]["detail"]
    code, out, err = _verify(cfg.path, capsys)
    assert code == 0 and "4 records (the first 3 written before the audit key)" in out, err
    # An old record rewritten with its SHA chain recomputed: found now.
    with contextlib.closing(sqlite3.connect(old, isolation_level=None)) as db:
        rows = _rows(db)
        rows[1][9] = "denied"
        db.execute("DELETE FROM audit WHERE seq <= 3")
        prev = audit_chain.GENESIS
        for row in rows[:3]:
            fields = row[:12]
            db.execute(f"INSERT INTO audit ({FIELDS}, prev, hash) VALUES ({', '.join('?' * 14)})",
                       (*fields, prev, _sha(prev, fields)))
            prev = _sha(prev, fields)
    code, out, err = _verify(cfg.path, capsys)
    assert code == 2 and "record 4: its link to the record before does not match" in err, err


def test_the_key_and_the_head_are_private_and_the_key_is_never_in_the_log(real_log, tmp_path) -> None:
    cfg = _copy(real_log, tmp_path)
    data = cfg / "data"
    for name in (audit_chain.KEY_FILE, audit_chain.HEAD_FILE, grants.AUDIT_FILE):
        assert (data / name).stat().st_mode & 0o777 == 0o600, name
    key = (data / audit_chain.KEY_FILE).read_text().strip()
    assert key.encode() not in (data / grants.AUDIT_FILE).read_bytes()
    assert key not in (data / audit_chain.HEAD_FILE).read_text()


# ── with sessions on Redis ──────────────────────────────────────────────────────────────────────


async def test_a_grant_written_into_redis_by_hand_is_ignored(tmp_path, fake_openai, redis_store, caplog) -> None:
    """Another instance's grants come through Redis: only those MACed with the shared audit key count."""
    import shared_store
    from tests.conftest import openai_model
    from tests.runtime import runtime

    async with runtime(tmp_path, {"fake": openai_model(fake_openai)},
                       store=shared_store.open_store(redis_store, tmp_path)) as rt:
        store, link = rt.gate.grants, rt.link
        assert store is not None and link is not None
        real = grants.new_grant("c1", grants.Decision("allow_session", "shell"), "db_query", "db", ["users"], "write")
        real.audit_seq = store.audit(AuditRecord.call("c1", "", "").grant("", "", real.id))
        store.add(real)
        await store.flush()
        await store.refresh("c1")
        assert [g.id for g in store.active("c1")] == [real.id]
        forged = grants.new_grant("c1", grants.Decision("allow_session", "x"), "db_query", "db", ["salaries"], "write")
        record = grants.canonical(forged)
        key = link.key("grants", "c1")
        await link.client.hset(key, forged.id, json.dumps({"record": record, "mac": "0" * 64}))
        await link.client.hset(key, "gplain", record)  # the format before MACs
        with caplog.at_level("WARNING", logger="agent_mcp.grants"):
            await store.refresh("c1")
        assert [g.id for g in store.active("c1")] == [real.id]
        assert sum("is ignored as a forgery" in r.getMessage() for r in caplog.records) == 2
        head = json.loads(await link.client.get(link.key("audit-head", store._log_id)))
        assert head["count"] == 1  # the head is checkpointed in Redis too


def test_a_log_and_head_rolled_back_together_are_caught_by_the_head_in_redis(tmp_path, redis_store, capsys) -> None:
    """A backup of the log and its head, both valid, put back: only a head kept elsewhere can tell."""
    import shared_link

    cfg = ConfigDir(tmp_path / "cfg")
    cfg.path.mkdir()
    cfg.models = {"m": MODEL}
    cfg.env = {"SESSION_STORE": redis_store}
    cfg.write()
    data = cfg.path / "data"

    async def write(records: int) -> None:
        store = grants.GrantStore(data / grants.AUDIT_FILE)
        store.link = shared_link.Link(redis_store)
        await store.open()
        for _ in range(records):
            store.audit(AuditRecord.call("c1", "", "").decision("shell", "rejected"))
        await store.close()
        await store.link.client.aclose()

    asyncio.run(write(3))
    backup = tmp_path / "backup"
    shutil.copytree(data, backup)
    asyncio.run(write(2))
    assert _verify(cfg.path, capsys)[0] == 0
    for name in (grants.AUDIT_FILE, audit_chain.HEAD_FILE):
        shutil.copy(backup / name, data / name)
    code, out, err = _verify(cfg.path, capsys)
    assert code == 2 and "but the head checkpointed in Redis says 5" in err, err + out


def test_a_revoked_grants_row_put_back_is_not_honoured_again(real_log, tmp_path, caplog) -> None:
    """A copy of the row taken before the revoke carries a valid MAC; the chain's revoke record still wins."""
    cfg = _copy(real_log, tmp_path)
    path = cfg / "data" / grants.AUDIT_FILE
    with _db(cfg) as db:
        saved = db.execute("SELECT id, session, record, mac FROM grants").fetchone()
    assert [g.id for g in audit_log.revoke_offline(path, "all", actor="agentctl")] == [saved[0]]
    with _db(cfg) as db:
        db.execute("INSERT INTO grants (id, session, record, mac) VALUES (?, ?, ?, ?)", saved)

    async def run() -> list[str]:
        store = grants.GrantStore(path)
        await store.open()
        try:
            return [g.id for g in store.active("c1")]
        finally:
            await store.close()

    with caplog.at_level("WARNING", logger="agent_mcp.grants"):
        assert asyncio.run(run()) == []
    assert any(saved[0] in r.getMessage() and "it was revoked" in r.getMessage() for r in caplog.records)


# ── heads kept elsewhere: a rewound head file ─────────────────────────────────────────────────────────


def test_a_rewound_head_and_a_cut_tail_are_caught_by_every_head_kept_elsewhere(tmp_path, capsys) -> None:
    """The issue's case: the tail cut and an older copy of data/audit-head put back. The file and its head agree;
    `agentctl audit-head` printed into a file outside data/ at each start, the server log's start/stop lines,
    or a head passed on the command line do not."""
    from tests.runtime import entry

    cfg = ConfigDir(tmp_path / "cfg")
    cfg.path.mkdir()
    cfg.models = {"m": MODEL}
    cfg.write()
    data = cfg.path / "data"
    heads, server_log = tmp_path / "kept" / "audit-heads", tmp_path / "kept" / "agent-mcp.log"
    heads.parent.mkdir()

    def session(records: int) -> None:
        """One run of the server: its log as agent-mcp.py writes it at --log-level WARNING, then audit-head."""
        root = logging.getLogger()
        saved = root.handlers[:], root.level
        handler = logging.FileHandler(server_log)
        handler.setFormatter(entry()._FORMATTER)
        root.handlers[:], root.level = [handler], logging.WARNING
        try:
            async def run() -> None:
                store = grants.GrantStore(data / grants.AUDIT_FILE)
                await store.open()
                for _ in range(records):
                    store.audit(AuditRecord.call("c1", "", "").decision("shell", "rejected"))
                await store.close()

            asyncio.run(run())
        finally:
            handler.close()
            root.handlers[:], root.level = saved
        code, out, err = _verify(cfg.path, capsys, command="audit-head")
        assert code == 0, err
        with heads.open("a") as kept:
            kept.write(out)

    session(3)
    older_head = (data / audit_chain.HEAD_FILE).read_bytes()
    session(4)
    lines = [line for line in server_log.read_text().splitlines() if "audit head" in line]
    assert [line.rsplit("(", 1)[-1] for line in lines] == ["at start)", "at stop)"] * 2, lines  # at WARNING too
    (now,) = [line for line in heads.read_text().splitlines()][-1:]
    assert now.startswith("audit head {") and '"count": 7' in now
    # The honest log passes against every head.
    code, out, err = _verify(cfg.path, capsys, "--head-file", str(heads), "--log", str(server_log), "--head", now)
    assert code == 0, err
    assert "7 records, chain intact" in out and f"{heads} line 2" in out and f"{server_log} line" in out
    # Rewound: the tail cut to 3 records and the head file of that time put back.
    with _db(cfg.path) as db:
        db.execute("DELETE FROM audit WHERE seq > 3")
    (data / audit_chain.HEAD_FILE).write_bytes(older_head)
    code, out, err = _verify(cfg.path, capsys)
    assert code == 0 and "checked against: " in out  # the file and its head alone agree: what the issue found
    for options, where in [(("--head-file", str(heads)), f"{heads} line 2"),
                           (("--log", str(server_log)), f"{server_log} line"),
                           (("--head", now), "--head line 1")]:
        code, out, err = _verify(cfg.path, capsys, *options)
        assert code == 2, (options, out)
        line = err.strip()
        assert f"the log has 3 records but the head {where}" in line and "says 7: the tail was cut" in line, line
        assert "\n" not in line and "Traceback" not in err
    # audit-head refuses to print a head for a log that does not verify against what it can reach.
    with _db(cfg.path) as db:
        db.execute("UPDATE audit SET outcome = 'allowed' WHERE seq = 2")
    code, out, err = _verify(cfg.path, capsys, command="audit-head")
    assert code == 2 and "record 2 does not match its MAC" in err and "no head printed" in err and not out


def test_head_options_that_hold_no_head_of_this_log_are_refused(real_log, tmp_path, capsys) -> None:
    cfg = _copy(real_log, tmp_path)
    empty = tmp_path / "empty"
    empty.write_text("nothing here\n")
    code, _, err = _verify(cfg, capsys, "--head-file", str(empty))
    assert code == 2 and "holds no head, none of this log" in err, err
    other = tmp_path / "other"
    other.mkdir()
    shutil.copy(cfg / "data" / audit_chain.KEY_FILE, other / audit_chain.KEY_FILE)
    _write_log(other, records=3)
    code, _, err = _verify(cfg, capsys, "--head", (other / audit_chain.HEAD_FILE).read_text())
    assert code == 2 and "only heads of other logs" in err, err
    code, out, err = _verify(cfg, capsys, "--log", str(empty))  # a server log may hold none: passed over
    assert code == 0 and str(empty) not in out, err
    code, _, err = _verify(cfg, capsys, "--head-file", str(tmp_path / "missing"))
    assert code == 1 and "cannot be read" in err, err
    forged = json.loads((cfg / "data" / audit_chain.HEAD_FILE).read_text())
    forged["count"] = 99
    code, _, err = _verify(cfg, capsys, "--head", json.dumps(forged))
    assert code == 2 and "--head line 1 does not match its MAC" in err, err


def test_a_forged_grant_in_redis_fails_audit_verify(tmp_path, redis_store, capsys) -> None:
    """With sessions on Redis, the grants kept there are part of what audit-verify checks."""
    import redis

    import shared_link

    cfg = ConfigDir(tmp_path / "cfg")
    cfg.path.mkdir()
    cfg.models = {"m": MODEL}
    cfg.env = {"SESSION_STORE": redis_store}
    cfg.write()
    data = cfg.path / "data"

    async def write() -> None:
        store = grants.GrantStore(data / grants.AUDIT_FILE)
        store.link = shared_link.Link(redis_store)
        await store.open()
        grant = grants.new_grant("c1", grants.Decision("allow_session", "shell"), "db_query", "db", ["u"], "write")
        grant.audit_seq = store.audit(AuditRecord.call("c1", "db_query", "write", ["u"]).grant("shell", "", grant.id))
        store.add(grant)
        await store.close()
        await store.link.client.aclose()

    asyncio.run(write())
    code, out, err = _verify(cfg.path, capsys)
    assert code == 0 and "1 grant(s) in Redis" in out, err
    url, prefix = shared_link.split_prefix(redis_store)
    with redis.Redis.from_url(url, decode_responses=True) as client:
        ((grant_id, value),) = client.hgetall(prefix + "grants:c1").items()
        client.hset(prefix + "grants:c4", grant_id, value)
    code, out, err = _verify(cfg.path, capsys)
    assert code == 2 and f"grant {grant_id!r} in {prefix}grants:c4: it holds a grant of session 'c1'" in err, err
