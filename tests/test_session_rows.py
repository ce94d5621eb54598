"""stores.SqliteStore keeps a session's older messages as rows and its newest in the record (issue 31): a save
writes what is new, never the whole history, and whatever a history went through reads back as it was."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sessions
import stores


def msg(i: int, size: int = 20) -> dict:
    return {"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i} " + "x" * size}


def stored(path: Path) -> tuple[dict, int]:
    """The session's record and how many message rows the file holds (leftovers included)."""
    db = sqlite3.connect(path)
    (record,), (rows,) = (db.execute("SELECT record FROM sessions").fetchone(),
                          db.execute("SELECT COUNT(*) FROM messages").fetchone())
    db.close()
    return json.loads(record), rows


async def reopened(path: Path) -> list[dict]:
    m = sessions.SessionManager(stores.SqliteStore(path))
    await m.open()
    try:
        return m.get("c").history
    finally:
        await m.close()


# What a history goes through: new messages at its end (some over the record's tail size), its oldest turns
# dropped, its end cut back (a failed turn), cleared, copied whole (another instance's copy), one message replaced.
OPS = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(1, 40), st.sampled_from([10, 10, 10, 40_000])),
    st.tuples(st.just("trim"), st.integers(1, 30), st.just(0)),
    st.tuples(st.just("cut"), st.integers(1, 30), st.just(0)),
    st.tuples(st.sampled_from(["clear", "copy", "replace"]), st.just(0), st.just(0)),
    st.tuples(st.just("reopen"), st.just(0), st.just(0)),
), min_size=1, max_size=25)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(OPS)
def test_whatever_a_history_goes_through_reads_back_as_it_was(ops) -> None:
    async def run(path: Path) -> None:
        m = sessions.SessionManager(stores.SqliteStore(path))
        await m.open()
        try:
            s = await m.get_or_create("c", "m1")
            n = 0
            for op, k, size in ops:
                if op == "add":
                    s.history += [msg(n + i, size) for i in range(k)]
                    n += k
                elif op == "trim":
                    del s.history[:k]
                elif op == "cut":
                    del s.history[-k:]
                elif op == "clear":
                    s.history.clear()
                elif op == "copy":
                    s.history = [dict(x) for x in s.history]
                elif op == "replace" and s.history:
                    s.history[len(s.history) // 2] = {"role": "user", "content": f"replaced {n}"}
                elif op == "reopen":
                    await m.close()
                    m = sessions.SessionManager(stores.SqliteStore(path))
                    await m.open()
                    s = m.get("c")
                await m.save(s)
                assert await reopened(path) == s.history
            record, rows = stored(path)
            assert "history" not in record and len(record["tail"]) <= stores.TAIL_MESSAGES and rows >= record["rows"][1]
        finally:
            await m.close()

    with tempfile.TemporaryDirectory() as tmp:
        asyncio.run(run(Path(tmp) / "s.db"))


async def test_a_save_writes_what_is_new_and_the_file_keeps_only_the_history(tmp_path) -> None:
    path = tmp_path / "s.db"
    m = sessions.SessionManager(stores.SqliteStore(path), sessions.SessionPolicy(max_history=200))
    await m.open()
    s = await m.get_or_create("c", "m1")
    for i in range(1000):  # a turn at a time: its question, then its answer
        s.history.append(msg(i, 200))
        await m.save(s)
        record, rows = stored(path)
        assert len(json.dumps(record)) < stores.TAIL_BYTES + 1000  # never the whole history
    assert len(s.history) <= 200 and rows <= 200 + stores.TAIL_MESSAGES + 1  # trimmed rows are deleted
    assert await reopened(path) == s.history and s.history[-1] == msg(999, 200)
    await m.close()


async def test_a_session_stored_whole_by_an_earlier_version_reads_back_and_moves_to_rows(tmp_path) -> None:
    path = tmp_path / "s.db"
    history = [msg(i) for i in range(100)] + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "t", "name": "n", "args": {"big": 2**70}}]}]
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE sessions (client_id TEXT PRIMARY KEY, shorthand INTEGER UNIQUE NOT NULL,"
               " record TEXT NOT NULL, updated REAL NOT NULL)")
    db.execute("INSERT INTO sessions VALUES ('c', 101, ?, 1.0)",
               (json.dumps({"model": "m1", "history": history, "settings": {}, "created": 1.0}),))
    db.commit()
    db.close()
    assert await reopened(path) == history
    m = sessions.SessionManager(stores.SqliteStore(path))
    await m.open()
    s = m.get("c")
    s.history.append(msg(100))
    await m.save(s)
    await m.close()
    record, rows = stored(path)
    assert "history" not in record and rows == 102 and record["rows"][1] == 102
    again = await reopened(path)
    assert again == [*history, msg(100)] and type(again[100]["tool_calls"][0]["args"]["big"]) is int


async def test_a_save_cut_short_leaves_the_session_as_it_was(tmp_path) -> None:
    path = tmp_path / "s.db"
    store = stores.SqliteStore(path)
    m = sessions.SessionManager(store)
    await m.open()
    s = await m.get_or_create("c", "m1")
    s.history += [msg(i) for i in range(50)]
    await m.save(s)
    before = [dict(x) for x in s.history]
    execute = store._db.execute

    def failing(sql, *args):
        if sql.startswith("INSERT OR REPLACE INTO sessions"):
            raise sqlite3.OperationalError("disk I/O error")
        return execute(sql, *args)

    store._db.execute = failing  # the rows of the new messages are written; the record that names them is not
    del s.history[:10]
    s.history += [msg(i) for i in range(50, 100)]
    with pytest.raises(stores.SessionError, match="this change was not saved"):
        await m.save(s)
    assert await reopened(path) == before
    store._db.execute = execute
    await m.save(s)
    assert await reopened(path) == s.history
    await m.close()


async def test_saves_of_a_session_at_the_same_time_keep_it_whole(tmp_path) -> None:
    """A save whose tail moves to rows takes several trips to SQLite's thread; a save of the same session (or
    a delete) meanwhile waits for it instead of writing into its transaction with what it read before."""
    path = tmp_path / "s.db"
    m = sessions.SessionManager(stores.SqliteStore(path))
    await m.open()
    s = await m.get_or_create("c", "m1")
    other = await m.get_or_create("d", "m1")

    async def trim_then_save() -> None:
        await asyncio.sleep(0)
        del s.history[:30]
        s.history.append(msg(999))
        await m.save(s)

    for round_ in range(5):
        s.history += [msg(round_ * 100 + i) for i in range(60)]
        other.history += [msg(i) for i in range(40)]
        await asyncio.gather(m.save(s), trim_then_save(), m.save(other), m.save(s))
    assert await reopened(path) == s.history
    await m.close()
