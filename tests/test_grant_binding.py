"""A grant counts only where it was made: its session, its store (the log of audit.sqlite3, the Redis prefix).

Each case gives a real grant through the gate (a human answers allow_session), then does what someone
with write access to the store could: copy the stored grant into another session, edit a field, put it
back after `!grants revoke`, copy it from another store made with the same audit key. The gated call in
the session that was never asked stays gated, the copy is audited as `grant_forged` and warned about
(without the MAC or the key), and the honest grant keeps working where it was made.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

import audit_chain
import audit_log
import build
import grants
import shared_store
import state
from config import load_config
from tests.conftest import openai_model
from tests.runtime import ALL_GATED, Recorder, add_plugin_tools, runtime, turn
from tests.test_grants import BASE, _Args, call

SQL = {"sql": BASE}


def _tools(rt: state.Runtime) -> None:
    add_plugin_tools(rt, "plugin_test_grants", [Recorder().tool("db_query", _Args)], {"db_query": {"type": "db"}})


@contextlib.asynccontextmanager
async def _instance(path: Path, models: dict[str, Any], url: str | None, key: Path) -> AsyncIterator[state.Runtime]:
    """A runtime with sessions c1 and c4, the test tool, one audit key shared with the others; on `url`'s Redis."""
    await asyncio.to_thread(path.mkdir, exist_ok=True)
    store = shared_store.open_store(url, path) if url else None
    async with runtime(path, models, gates=ALL_GATED, store=store,
                       env={"AGENT_AUDIT_KEY_FILE": str(key), "GATE_TIMEOUT": "5"}) as rt:
        _tools(rt)
        for session in ("c1", "c4"):
            await rt.sessions.get_or_create(session, "fake")
        yield rt


async def _forged(rt: state.Runtime) -> list[dict[str, Any]]:
    """The grant_forged records of the runtime's audit log."""
    assert rt.gate.grants is not None
    await rt.gate.grants.flush()
    path = rt.config.data_dir() / grants.AUDIT_FILE
    return [r for r in audit_log.read_audit(path) if r["event"] == audit_chain.GRANT_FORGED]


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "is ignored as a forgery" in r.getMessage()]


def _no_secrets(lines: list[str], *secrets: str) -> None:
    for line in lines:
        assert all(s not in line for s in secrets), line


# ── Redis ─────────────────────────────────────────────────────────────────────────────────────────


def _other_prefix(url: str) -> str:
    """The fixture's URL with a prefix of its own below the fixture's (so the fixture removes its keys too)."""
    prefix = url.split("prefix=", 1)[1]
    return url.replace(f"prefix={prefix}", f"prefix={prefix}other-")


async def _entry(rt: state.Runtime, session: str) -> tuple[str, str]:
    """The (grant id, Redis value) of the session's one grant, as the server shared it."""
    assert rt.gate.grants is not None and rt.link is not None
    await rt.gate.grants.refresh(session)  # waits until this instance's own changes are in Redis
    ((grant_id, value),) = (await rt.link.client.hgetall(rt.link.key("grants", session))).items()
    return grant_id, value


async def test_redis_a_grant_copied_into_another_session_stays_gated_and_revoke_ends_it(
        tmp_path, fake_openai, redis_store, caplog) -> None:
    models = {"fake": openai_model(fake_openai)}
    async with _instance(tmp_path / "a", models, redis_store, tmp_path / "audit-key") as a:
        assert not await call(a, "db_query", SQL, answer="allow_session", client_id="c1")
        assert await call(a, "db_query", SQL, client_id="c1")  # the honest grant allows where it was made
        grant_id, value = await _entry(a, "c1")
        assert a.link is not None
        await a.link.client.hset(a.link.key("grants", "c4"), grant_id, value)  # the HSET, unchanged
        with caplog.at_level("WARNING", logger="agent_mcp.grants"):
            assert not await call(a, "db_query", SQL, client_id="c4")  # asked (and rejected): not ungated
        (forged,) = await _forged(a)
        assert forged["session"] == "c4" and forged["grant_id"] == grant_id and forged["outcome"] == "ignored (forged)"
        assert "copied into another session" in forged["detail"] and a.link.key("grants", "c4") in forged["detail"]
        (line,) = _warnings(caplog)
        assert grant_id in line and "'c4'" in line
        _no_secrets([line, forged["detail"]], json.loads(value)["mac"], (tmp_path / "audit-key").read_text().strip())
        # Revoked where it was made: gated there, and the copy (which never counted) still does not.
        out, _ = await turn(a, f"!grants revoke {grant_id}", client_id="c1")
        assert out.startswith(f"Revoked {grant_id}")
        assert not await call(a, "db_query", SQL, client_id="c1")
        assert not await call(a, "db_query", SQL, client_id="c4")
        assert len(await _forged(a)) == 1  # audited once per copy, not at every call


async def test_redis_an_edited_grant_is_ignored_and_audited(tmp_path, fake_openai, redis_store, caplog) -> None:
    models = {"fake": openai_model(fake_openai)}
    async with _instance(tmp_path / "a", models, redis_store, tmp_path / "audit-key") as a:
        assert not await call(a, "db_query", {"sql": "SELECT * FROM users"}, answer="allow_session", client_id="c1")
        grant_id, value = await _entry(a, "c1")
        data = json.loads(value)
        record = json.loads(data["record"])
        record["op"] = "write"  # a read grant widened to writes, its MAC left as it was
        data["record"] = json.dumps(record, sort_keys=True)
        assert a.link is not None
        await a.link.client.hset(a.link.key("grants", "c1"), grant_id, json.dumps(data))
        with caplog.at_level("WARNING", logger="agent_mcp.grants"):
            assert not await call(a, "db_query", SQL, client_id="c1")
        assert a.gate.grants is not None and a.gate.grants.active("c1") == []
        (forged,) = await _forged(a)
        assert forged["session"] == "c1" and "its MAC does not hold" in forged["detail"]
        assert len(_warnings(caplog)) == 1


async def test_redis_a_grant_put_back_after_its_revoke_counts_on_no_instance(
        tmp_path, fake_openai, redis_store, caplog) -> None:
    """Instance b learns of the revoke made on a from Redis (the revocation is recorded by grant id)."""
    models = {"fake": openai_model(fake_openai)}
    key = tmp_path / "audit-key"
    async with _instance(tmp_path / "a", models, redis_store, key) as a, \
            _instance(tmp_path / "b", models, redis_store, key) as b:
        assert not await call(a, "db_query", SQL, answer="allow_session", client_id="c1")
        grant_id, value = await _entry(a, "c1")
        assert await call(b, "db_query", SQL, client_id="c1")  # the other instance honours the real grant
        out, _ = await turn(a, f"!grants revoke {grant_id}", client_id="c1")
        assert out.startswith(f"Revoked {grant_id}")
        assert a.link is not None and a.gate.grants is not None
        await a.gate.grants.refresh("c1")  # the revoke is in Redis
        await a.link.client.hset(a.link.key("grants", "c1"), grant_id, value)  # the saved entry, replayed
        with caplog.at_level("WARNING", logger="agent_mcp.grants"):
            assert not await call(a, "db_query", SQL, client_id="c1")
            assert not await call(b, "db_query", SQL, client_id="c1")
        for rt in (a, b):
            (forged,) = await _forged(rt)
            assert forged["grant_id"] == grant_id and "put back after its revocation" in forged["detail"]
        # Even with the revocation's record removed from Redis, the instance that revoked it remembers.
        await a.link.client.delete(a.link.key("grants-revoked"))
        assert not await call(a, "db_query", SQL, client_id="c1")


async def test_redis_a_grant_put_back_after_its_session_ended_counts_on_no_instance(
        tmp_path, fake_openai, redis_store) -> None:
    """A session deleted on a ends its grants everywhere: the saved entry put back into a new c1 is refused."""
    models = {"fake": openai_model(fake_openai)}
    key = tmp_path / "audit-key"
    async with _instance(tmp_path / "a", models, redis_store, key) as a, \
            _instance(tmp_path / "b", models, redis_store, key) as b:
        assert not await call(a, "db_query", SQL, answer="allow_session", client_id="c1")
        grant_id, value = await _entry(a, "c1")
        await a.sessions.delete("c1")
        assert a.gate.grants is not None and a.link is not None
        await a.gate.grants.refresh("c1")  # the drop is in Redis
        assert await a.link.client.hget(a.link.key("grants-revoked"), grant_id) == "c1"
        await a.sessions.get_or_create("c1", "fake")
        await a.link.client.hset(a.link.key("grants", "c1"), grant_id, value)
        assert not await call(b, "db_query", SQL, client_id="c1")
        assert not await call(a, "db_query", SQL, client_id="c1")
        assert [f["grant_id"] for f in await _forged(b)] == [grant_id]


async def test_redis_a_use_counted_on_one_instance_does_not_put_back_a_grant_revoked_on_another(
        tmp_path, fake_openai, redis_store) -> None:
    models = {"fake": openai_model(fake_openai)}
    key = tmp_path / "audit-key"
    async with _instance(tmp_path / "a", models, redis_store, key) as a, \
            _instance(tmp_path / "b", models, redis_store, key) as b:
        assert not await call(a, "db_query", SQL, answer="allow_session", client_id="c1")
        assert a.gate.grants is not None and a.link is not None
        (held,) = a.gate.grants.active("c1")  # a's copy in memory, as a gated call on a holds it
        await _entry(a, "c1")
        out, _ = await turn(b, f"!grants revoke {held.id}", client_id="c1")
        assert out.startswith(f"Revoked {held.id}")
        assert b.gate.grants is not None
        await b.gate.grants.refresh("c1")  # b's revoke is in Redis
        a.gate.grants.used(held)  # a use a counted before it saw the revoke
        await a.gate.grants.refresh("c1")
        assert await a.link.client.hgetall(a.link.key("grants", "c1")) == {}
        assert not await call(a, "db_query", SQL, client_id="c1")
        assert await _forged(a) == []  # nothing forged: the use was not written over the revoke


async def test_redis_a_grant_copied_from_another_prefix_is_ignored(tmp_path, fake_openai, redis_store,
                                                                   caplog) -> None:
    """Two stores on one Redis with one audit key: a grant of one is not a grant of the other."""
    models = {"fake": openai_model(fake_openai)}
    key = tmp_path / "audit-key"
    async with _instance(tmp_path / "a", models, redis_store, key) as a, \
            _instance(tmp_path / "b", models, _other_prefix(redis_store), key) as b:
        assert a.link is not None and b.link is not None and a.link.prefix != b.link.prefix
        assert not await call(a, "db_query", SQL, answer="allow_session", client_id="c1")
        grant_id, value = await _entry(a, "c1")
        await b.link.client.hset(b.link.key("grants", "c1"), grant_id, value)  # same session name, other prefix
        await b.link.client.hset(b.link.key("grant-owners"), grant_id, "c1")
        with caplog.at_level("WARNING", logger="agent_mcp.grants"):
            assert not await call(b, "db_query", SQL, client_id="c1")
        (forged,) = await _forged(b)
        assert forged["session"] == "c1" and "does not hold for this store" in forged["detail"]
        assert await call(a, "db_query", SQL, client_id="c1")  # where it was made it still holds


# ── SQLite (audit.sqlite3, sessions in the process) ────────────────────────────────────────────────


@contextlib.contextmanager
def _db(rt_or_path: Any) -> Any:
    path = rt_or_path if isinstance(rt_or_path, Path) else rt_or_path.config.data_dir() / grants.AUDIT_FILE
    with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as db:
        yield db


@contextlib.asynccontextmanager
async def _restarted(config_dir: Path) -> AsyncIterator[state.Runtime]:
    """The same config dir started again (grants loaded from audit.sqlite3), sessions c1 and c4."""
    rt = await build.build_runtime(load_config(config_dir))
    try:
        _tools(rt)
        for session in ("c1", "c4"):
            await rt.sessions.get_or_create(session, "fake")
        yield rt
    finally:
        await build.close_runtime(rt)


async def _granted(path: Path, models: dict[str, Any], key: Path) -> tuple[Path, tuple[str, str, str, str]]:
    """A config dir whose c1 holds one real allow_session grant; (its config dir, its grants row)."""
    async with _instance(path, models, None, key) as rt:
        assert not await call(rt, "db_query", SQL, answer="allow_session", client_id="c1")
        assert rt.gate.grants is not None
        await rt.gate.grants.flush()
        config_dir = rt.config.config_dir
    with _db(path / "data" / grants.AUDIT_FILE) as db:
        (row,) = db.execute("SELECT id, session, record, mac FROM grants").fetchall()
    return config_dir, row


async def test_sqlite_a_grant_copied_into_another_session_stays_gated(tmp_path, fake_openai, caplog) -> None:
    config_dir, (grant_id, _, record, mac) = await _granted(tmp_path / "a", {"fake": openai_model(fake_openai)},
                                                            tmp_path / "audit-key")
    with _db(tmp_path / "a" / "data" / grants.AUDIT_FILE) as db:
        # Kept under another id for c4 (the id is the table's key), and the record rewritten for c4 too.
        db.execute("INSERT INTO grants (id, session, record, mac) VALUES (?, ?, ?, ?)", ("gcopy", "c4", record, mac))
        moved = json.dumps({**json.loads(record), "id": "gmoved", "session": "c4"}, sort_keys=True)
        db.execute("INSERT INTO grants (id, session, record, mac) VALUES (?, ?, ?, ?)", ("gmoved", "c4", moved, mac))
    with caplog.at_level("WARNING", logger="agent_mcp.grants"):
        async with _restarted(config_dir) as rt:
            assert not await call(rt, "db_query", SQL, client_id="c4")
            assert await call(rt, "db_query", SQL, client_id="c1")  # the real one, where it was made
            forged = await _forged(rt)
    assert sorted((f["grant_id"], f["session"]) for f in forged) == [("gcopy", "c4"), ("gmoved", "c4")]
    assert "holds the record of grant" in next(f["detail"] for f in forged if f["grant_id"] == "gcopy")
    assert "its MAC does not hold" in next(f["detail"] for f in forged if f["grant_id"] == "gmoved")
    assert len(_warnings(caplog)) == 2
    _no_secrets(_warnings(caplog), mac, (tmp_path / "audit-key").read_text().strip())
    assert grant_id not in {f["grant_id"] for f in forged}


async def test_sqlite_a_grant_moved_to_another_session_or_edited_is_ignored(tmp_path, fake_openai, caplog) -> None:
    config_dir, (grant_id, *_) = await _granted(tmp_path / "a", {"fake": openai_model(fake_openai)},
                                                tmp_path / "audit-key")
    with _db(tmp_path / "a" / "data" / grants.AUDIT_FILE) as db:
        db.execute("UPDATE grants SET session = 'c4' WHERE id = ?", (grant_id,))
    with caplog.at_level("WARNING", logger="agent_mcp.grants"):
        async with _restarted(config_dir) as rt:
            assert not await call(rt, "db_query", SQL, client_id="c4")
            assert not await call(rt, "db_query", SQL, client_id="c1")  # the row is gone from c1 as well
            (forged,) = await _forged(rt)
    assert forged["session"] == "c4" and "copied into another session" in forged["detail"]
    # An edited field: the record widened to another table, its MAC kept.
    config_dir, (grant_id, _, record, _) = await _granted(tmp_path / "b", {"fake": openai_model(fake_openai)},
                                                            tmp_path / "audit-key")
    wider = json.dumps({**json.loads(record), "keys": ["salaries", "users"]}, sort_keys=True)
    with _db(tmp_path / "b" / "data" / grants.AUDIT_FILE) as db:
        db.execute("UPDATE grants SET record = ? WHERE id = ?", (wider, grant_id))
    async with _restarted(config_dir) as rt:
        assert not await call(rt, "db_query", SQL, client_id="c1")
        (forged,) = await _forged(rt)
    assert forged["grant_id"] == grant_id and "its MAC does not hold" in forged["detail"]


async def test_sqlite_a_grant_put_back_after_its_revoke_stays_gated(tmp_path, fake_openai) -> None:
    config_dir, row = await _granted(tmp_path / "a", {"fake": openai_model(fake_openai)}, tmp_path / "audit-key")
    async with _restarted(config_dir) as rt:
        out, _ = await turn(rt, f"!grants revoke {row[0]}", client_id="c1")
        assert out.startswith(f"Revoked {row[0]}")
    with _db(tmp_path / "a" / "data" / grants.AUDIT_FILE) as db:
        assert db.execute("SELECT COUNT(*) FROM grants").fetchone() == (0,)
        db.execute("INSERT INTO grants (id, session, record, mac) VALUES (?, ?, ?, ?)", row)  # the saved row
    async with _restarted(config_dir) as rt:
        assert not await call(rt, "db_query", SQL, client_id="c1")
        (forged,) = await _forged(rt)
    assert forged["grant_id"] == row[0] and "put back after its revocation" in forged["detail"]


async def test_sqlite_a_grant_copied_from_another_data_dir_with_the_same_key_is_ignored(tmp_path,
                                                                                        fake_openai) -> None:
    """Another log (another store) made with the same audit key: its grant row is not a grant of this one."""
    models, key = {"fake": openai_model(fake_openai)}, tmp_path / "audit-key"
    _, row = await _granted(tmp_path / "a", models, key)
    config_b, _ = await _granted(tmp_path / "b", models, key)
    with _db(tmp_path / "b" / "data" / grants.AUDIT_FILE) as db:
        db.execute("DELETE FROM grants")
        db.execute("INSERT INTO grants (id, session, record, mac) VALUES (?, ?, ?, ?)", row)
    async with _restarted(config_b) as rt:
        assert not await call(rt, "db_query", SQL, client_id="c1")
        (forged,) = await _forged(rt)
    assert forged["grant_id"] == row[0] and "does not hold for this store" in forged["detail"]


def test_a_row_written_before_grants_were_bound_still_counts_where_its_chain_backs_it(tmp_path) -> None:
    """An upgrade keeps honest grants: the old MAC (record only) counts while the chain backs the row."""
    from audit_chain import AuditRecord

    path = tmp_path / grants.AUDIT_FILE

    async def run(change: Any = None) -> list[str]:
        store = grants.GrantStore(path)
        await store.open()
        try:
            if change is not None:
                change(store)
            return [g.id for g in store.active("c1")]
        finally:
            await store.close()

    def give(store: grants.GrantStore) -> None:
        grant = grants.new_grant("c1", grants.Decision("allow_session", "shell"), "db_query", "db", ["u"], "write")
        grant.audit_seq = store.audit(AuditRecord.call("c1", "db_query", "write", ["u"]).grant("shell", "", grant.id))
        store.add(grant)

    asyncio.run(run(give))
    key = audit_chain.load_key(tmp_path / audit_chain.KEY_FILE, create=False)
    with _db(path) as db:
        (grant_id, record) = db.execute("SELECT id, record FROM grants").fetchone()
        db.execute("UPDATE grants SET mac = ?", (audit_chain.legacy_grant_mac(key, record),))
    assert asyncio.run(run()) == [grant_id]
    with _db(path) as db:  # taken over: written again with the bound MAC
        (mac,) = db.execute("SELECT mac FROM grants").fetchone()
        (log_id,) = db.execute("SELECT value FROM audit_meta WHERE key = 'log_id'").fetchone()
    assert mac == audit_chain.grant_mac(key, f"sqlite:{log_id}", "c1", record)


@pytest.mark.parametrize("value", ["not json", json.dumps({"record": "{}", "mac": ""}), json.dumps([1])])
def test_a_redis_value_that_is_not_a_grant_entry_is_refused_with_a_reason(value) -> None:
    grant, why = grants.shared_grant(b"k" * 32, "redis:p:", "c1", "g1", value, False)
    assert grant is None and why
