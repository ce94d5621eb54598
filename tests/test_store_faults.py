"""A session store that refuses writes loses nothing and says why (issue 40).

Each test runs agent-mcp as a subprocess on its SQLite store and talks to it through shell.py's own client.
The lock is a real one: another process opens the sessions database and holds `BEGIN EXCLUSIVE` until the
test tells it (over its stdin) to let go. A write that fails midway is real too: the server's file size
limit (RLIMIT_FSIZE, set from outside with prlimit) drops to one byte between two chunks of an answer, so
SQLite's next write fails as it does on a full disk.
"""

from __future__ import annotations

import asyncio
import json
import resource
import sqlite3
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

import build
import sessions
import stores
from config import ConfigError
from shell_client import ShellClient, ShellEvent
from tests.conftest import AgentServer, ConfigDir, openai_model
from tests.fakes.backend import text
from tests.fakes.openai_backend import FakeOpenAI
from tests.runtime import runtime, turn
from tests.waiting import until

TOKEN = "shell-token-store-faults-01"

#: Another process holding the sessions database's write lock until a line arrives on its stdin.
LOCKER = """
import sqlite3, sys
db = sqlite3.connect(sys.argv[1], isolation_level=None, timeout=60)
db.execute("BEGIN EXCLUSIVE")
print("locked", flush=True)
sys.stdin.readline()
db.execute("COMMIT")
db.close()
print("released", flush=True)
"""


class Locker:
    """A subprocess that holds `BEGIN EXCLUSIVE` on `path` from `__enter__` until `release()`."""

    def __init__(self, path: Path):
        self.path = path
        self.proc: subprocess.Popen[str] | None = None

    def __enter__(self) -> Locker:
        self.proc = subprocess.Popen([sys.executable, "-c", LOCKER, str(self.path)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        assert self.proc.stdout.readline().strip() == "locked"
        return self

    def release(self) -> None:
        """Commit and end: the lock is free once this returns."""
        assert self.proc is not None and self.proc.stdin is not None and self.proc.stdout is not None
        if self.proc.poll() is None:
            self.proc.stdin.write("\n")
            self.proc.stdin.flush()
            assert self.proc.stdout.readline().strip() == "released"
        assert self.proc.wait(timeout=30) == 0

    def __exit__(self, *exc_info: object) -> None:
        assert self.proc is not None and self.proc.stdin is not None and self.proc.stdout is not None
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        self.proc.stdin.close()
        self.proc.stdout.close()


@contextmanager
def serving(path: Path, backend: FakeOpenAI, lock_seconds: float) -> Iterator[AgentServer]:
    """agent-mcp on its default SQLite store (`data/sessions.sqlite3`), waiting `lock_seconds` for a lock."""
    cfg = ConfigDir(path)
    cfg.models = {"gpt": openai_model(backend)}
    cfg.env = {"AGENT_SHELL_TOKEN": TOKEN}
    server = AgentServer(cfg.write(), {"SESSION_STORE_LOCK_SECONDS": str(lock_seconds)}).start()
    try:
        yield server
    finally:
        out = server.stop()
        assert "Traceback" not in out and " ERROR " not in out, out[-3000:]


def stored(path: Path, client_id: str) -> list[tuple[str, str]]:
    """(role, content) of the session's history as the file holds it now (read without writing: a reader
    does not wait for a writer's lock in WAL mode)."""
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        row = db.execute("SELECT record FROM sessions WHERE client_id = ?", (client_id,)).fetchone()
        if row is None:
            return []
        record = json.loads(row[0])
        first, count = record["rows"]
        rows = db.execute("SELECT body FROM messages WHERE client_id = ? AND seq >= ? AND seq < ? ORDER BY seq",
                          (client_id, first, first + count)).fetchall()
    finally:
        db.close()
    return [(m["role"], m["content"]) for m in [*(json.loads(body) for (body,) in rows), *record["tail"]]]


async def until_event(client: ShellClient, seen: list[ShellEvent], wanted: str) -> ShellEvent:
    """Read the client's events into `seen` up to the first whose text holds `wanted`."""
    async for ev in client.events():
        seen.append(ev)
        if wanted in ev.text:
            return ev
    raise AssertionError(f"the stream ended before an event saying {wanted!r}")


async def history_length(client: ShellClient) -> int:
    """What the server holds of the session now (in memory, whatever the file has)."""
    (row,) = await client.sessions(client.client_id)
    return int(row["history_length"])


def answer(events: list[ShellEvent]) -> str:
    return "".join(e.text for e in events if e.name == "tok")


@pytest.mark.slow
async def test_a_lock_that_clears_within_the_bound_lets_the_turn_go_on(tmp_path: Path) -> None:
    with FakeOpenAI() as backend, serving(tmp_path, backend, lock_seconds=60) as server:
        path = server.data_dir / "sessions.sqlite3"
        async with ShellClient(server.url, "locked-a", token=TOKEN) as client:
            await client.connect(max_wait=10)
            seen: list[ShellEvent] = []
            with Locker(path) as lock:
                await client.submit("hello through a lock")
                waiting = await until_event(client, seen, "locked")
                assert waiting.name == "status"
                assert waiting.text == (f"the session store is locked by another process: {path}; retrying "
                                        "(for up to 60 s)")
                assert stored(path, "locked-a") == []  # nothing written yet: the question waits in memory
                lock.release()
            async for ev in client.events():
                seen.append(ev)
                if ev.name == "done":
                    break
        assert not [e for e in seen if e.name == "error"], seen
        assert answer(seen) == "echo: hello through a lock"
        assert stored(path, "locked-a") == [("user", "hello through a lock"),
                                            ("assistant", "echo: hello through a lock")]
        assert not any("free disk space" in e.text for e in seen)
    log = server.output
    assert f"WARNING agent_mcp.state: the session store is locked by another process: {path}" in log, log[-3000:]
    assert "the session store is writable again: session locked-a waited" in log, log[-3000:]


@pytest.mark.slow
async def test_a_lock_past_the_bound_says_where_and_what_to_do_and_keeps_the_message(tmp_path: Path) -> None:
    with FakeOpenAI() as backend, serving(tmp_path, backend, lock_seconds=1) as server:
        path = server.data_dir / "sessions.sqlite3"
        async with ShellClient(server.url, "locked-b", token=TOKEN) as client:
            await client.connect(max_wait=10)
            seen: list[ShellEvent] = []
            with Locker(path) as lock:
                await client.submit("a question the lock outlasts")
                error = await until_event(client, seen, "still locked")
                assert error.name == "error" and error.data.get("kind") == "store", error
                assert error.text.startswith(f"the session store is locked by another process: {path}; still locked "
                                             "after 1 s (SESSION_STORE_LOCK_SECONDS): find the process holding it "
                                             f"(`fuser -v {path}`"), error.text
                assert "it is kept in memory and written as soon as the store takes it" in error.text
                assert "free disk space" not in error.text and "internal error" not in error.text
                assert [e.name for e in seen if "retrying" in e.text] == ["status"]  # said while it waited
                assert len(backend.requests) == 0  # no answer to a question not stored
                async for ev in client.events():
                    seen.append(ev)
                    if ev.name == "done":
                        break
                assert await history_length(client) == 1  # kept in memory...
                assert stored(path, "locked-b") == []  # ... and not on disk
                lock.release()
            # Once the lock is gone the kept message is written, and every window of the session is told.
            saved = await until_event(client, seen, "took this session's unsaved changes")
            assert saved.name == "status"
            assert stored(path, "locked-b") == [("user", "a question the lock outlasts")]
            # The next request goes on as usual, after the kept message.
            await client.submit("and now?")
            async for ev in client.events():
                seen.append(ev)
                if ev.name == "done":
                    break
            assert answer(seen) == "echo: and now?"
            assert stored(path, "locked-b") == [("user", "a question the lock outlasts"), ("user", "and now?"),
                                                ("assistant", "echo: and now?")]
    log = server.output
    assert f"WARNING agent_mcp.state: session locked-b: the session store is locked by another process: {path}; " \
           "still locked after 1 s" in log, log[-3000:]
    assert "WARNING agent_mcp.state: session locked-b saved to SQLite" in log, log[-3000:]


@pytest.mark.slow
async def test_a_write_that_fails_midway_keeps_the_answer_and_says_so(tmp_path: Path) -> None:
    hold = threading.Event()
    with FakeOpenAI() as backend, serving(tmp_path, backend, lock_seconds=60) as server:
        path = server.data_dir / "sessions.sqlite3"
        assert server.proc is not None
        pid = server.proc.pid
        soft, hard = resource.prlimit(pid, resource.RLIMIT_FSIZE)
        backend.script(text("first half, ", "second half", hold=hold))
        async with ShellClient(server.url, "full-c", token=TOKEN) as client:
            await client.connect(max_wait=10)
            seen: list[ShellEvent] = []
            await client.submit("a question the disk fills under")
            await until_event(client, seen, "first half")  # the question is stored, the answer under way
            assert stored(path, "full-c") == [("user", "a question the disk fills under")]
            try:
                resource.prlimit(pid, resource.RLIMIT_FSIZE, (1, hard))  # no file of it may grow past 1 byte
                hold.set()
                async for ev in client.events():
                    seen.append(ev)
                    if ev.name == "done":
                        break
                assert answer(seen) == "first half, second half"
                (error,) = [e for e in seen if e.name == "error"]
                assert error.data.get("kind") == "store"
                assert error.text.startswith(f"cannot write {path} ("), error.text
                assert "free disk space there or make it writable; this change was not saved yet: it is kept in " \
                       "memory" in error.text, error.text
                assert "locked" not in error.text
                assert await history_length(client) == 2  # the answer is kept in memory...
                assert stored(path, "full-c") == [("user", "a question the disk fills under")]  # ... not on disk
            finally:
                resource.prlimit(pid, resource.RLIMIT_FSIZE, (soft, hard))
            await until_event(client, seen, "took this session's unsaved changes")
            first_turn = [("user", "a question the disk fills under"), ("assistant", "first half, second half")]
            assert stored(path, "full-c") == first_turn
            # A write that fails at the question itself: the turn stops before the model, the question is kept.
            seen.clear()
            try:
                resource.prlimit(pid, resource.RLIMIT_FSIZE, (1, hard))
                await client.submit("a question the disk is full for")
                async for ev in client.events():
                    seen.append(ev)
                    if ev.name == "done":
                        break
                (error,) = [e for e in seen if e.name in ("error", "tok")]
                assert error.name == "error" and error.data.get("kind") == "store", seen
                assert "free disk space there or make it writable; this change was not saved yet" in error.text
                assert len(backend.requests) == 1
                assert await history_length(client) == 3
                assert stored(path, "full-c") == first_turn
            finally:
                resource.prlimit(pid, resource.RLIMIT_FSIZE, (soft, hard))
            await until_event(client, seen, "took this session's unsaved changes")
            assert stored(path, "full-c") == [*first_turn, ("user", "a question the disk is full for")]
    log = server.output
    assert f"WARNING agent_mcp.state: session full-c: cannot write {path}" in log, log[-3000:]
    assert "WARNING agent_mcp.state: session full-c saved to SQLite" in log, log[-3000:]


@pytest.mark.slow
async def test_a_store_locked_for_good_keeps_the_message_until_it_stops_and_then_says_it_is_lost(tmp_path: Path
                                                                                                ) -> None:
    """The last resort: a server stopped while the lock is still held tries once more and names what it lost."""
    with FakeOpenAI() as backend:
        cfg = ConfigDir(tmp_path)
        cfg.models = {"gpt": openai_model(backend)}
        cfg.env = {"AGENT_SHELL_TOKEN": TOKEN}
        server = AgentServer(cfg.write(), {"SESSION_STORE_LOCK_SECONDS": "0"}).start()
        path = server.data_dir / "sessions.sqlite3"
        try:
            with Locker(path):
                async with ShellClient(server.url, "locked-d", token=TOKEN) as client:
                    await client.connect(max_wait=10)
                    seen: list[ShellEvent] = []
                    await client.submit("never stored")
                    await until_event(client, seen, "still locked")
                    assert await history_length(client) == 1
                out = await asyncio.to_thread(server.stop)  # while the lock is held
        finally:
            out = server.stop()
    assert "WARNING agent_mcp.state: session locked-d: the session store is locked" in out, out[-3000:]
    assert "ERROR agent_mcp.state: the server stops with unsaved changes of 1 session(s), which are lost: " \
           "locked-d" in out, out[-3000:]
    assert "Traceback" not in out


async def test_a_save_cancelled_while_it_waits_for_the_lock_leaves_no_transaction_open(tmp_path: Path) -> None:
    """A save whose tail moves to rows is a transaction; cancelled while SQLite waits for the lock (a newer
    message replaced its request), it is rolled back once SQLite is done, so the next saves are not written
    into a transaction nobody commits."""
    path = tmp_path / "s.db"
    store = stores.SqliteStore(path)
    store.BUSY_SECONDS = 60  # the first try waits in SQLite until the lock goes
    m = sessions.SessionManager(store)
    await m.open()
    try:
        s = await m.get_or_create("c", "m1")
        s.history += [{"role": "user", "content": f"m{i}"} for i in range(stores.TAIL_MESSAGES + 1)]
        with Locker(path) as lock:
            task = asyncio.create_task(m.save(s))
            await until(lambda: store._conn().in_transaction, "the save's transaction to begin")
            task.cancel()
            lock.release()  # (SQLite's wait ends here: only then is the save done with, rolled back)
            with pytest.raises(asyncio.CancelledError):
                await task
        s.history.append({"role": "assistant", "content": "after"})
        await m.save(s)
    finally:
        await m.close()
    again = sessions.SessionManager(stores.SqliteStore(path))
    await again.open()
    try:
        assert again.get("c").history == s.history
    finally:
        await again.close()


async def test_a_client_that_is_not_an_admin_is_told_of_the_lock_without_the_store_s_location(tmp_path: Path
                                                                                           ) -> None:
    path = tmp_path / "data" / "sessions.sqlite3"
    with FakeOpenAI() as backend:
        async with runtime(tmp_path, {"gpt": openai_model(backend)}, env={"SESSION_STORE_LOCK_SECONDS": "2"},
                           store=stores.SqliteStore(path)) as rt:
            with Locker(path):
                _, events = await turn(rt, "hello", client_id="api-x")
            said = [e.data for e in events if e.name in ("status", "error") and "locked" in str(e.data)]
            assert said[0] == {"text": "the session store is locked by another process: <data dir>/sessions.sqlite3; "
                                       "retrying (for up to 2 s)", "store": True}
            assert said[1]["kind"] == "store" and said[1]["message"].startswith(
                "the session store is locked by another process: <data dir>/sessions.sqlite3; still locked after "
                "2 s (SESSION_STORE_LOCK_SECONDS): find the process holding it (`fuser -v <data dir>/sessions"), said
            assert not any(str(tmp_path) in str(e.data) for e in events)
            assert len(rt.sessions.get("api-x").history) == 1
    # The runtime's close wrote the kept message (the lock was gone by then).
    assert stored(path, "api-x") == [("user", "hello")]


@pytest.mark.parametrize("raw", ["soon", "-1", "3601", "nan"])
def test_a_lock_bound_that_is_not_a_number_of_seconds_stops_start_up_saying_what_it_takes(raw: str) -> None:
    with pytest.raises(ConfigError, match=r"SESSION_STORE_LOCK_SECONDS=.*: must be a number of seconds from 0 to 3600 "
                                          r"\(default 30\)"):
        build.store_lock_seconds({"SESSION_STORE_LOCK_SECONDS": raw})
    assert build.store_lock_seconds({}) == 30 and build.store_lock_seconds({"SESSION_STORE_LOCK_SECONDS": "2.5"}) == 2.5
