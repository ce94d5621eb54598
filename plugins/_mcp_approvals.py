"""The MCP server's record of approvals: gates opened and decided, kept in SQLite for the history resources."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import plugin_api

HISTORY_LIMIT = 500
KEPT_APPROVALS = 10_000
#: Decided approvals in a shared store are kept at most this long (and at most `kept` of them).
SHARED_SECONDS = 30 * 86400
#: An open approval whose gate's wait ended this long ago is dropped from a shared store (its instance died).
ABANDONED_AFTER = 60


class ApprovalStore(plugin_api.SqliteFile):
    """Every gate seen while the MCP server runs: pending ones in memory, all of them in SQLite."""

    SCHEMA = (
        "CREATE TABLE IF NOT EXISTS approvals ("
        " gate_id TEXT PRIMARY KEY, session TEXT NOT NULL, tool_name TEXT NOT NULL, request TEXT NOT NULL,"
        " opened_at REAL NOT NULL, decision TEXT, decided_by TEXT, decided_at REAL)",
        "CREATE INDEX IF NOT EXISTS approvals_session ON approvals (session, opened_at)",
    )

    def __init__(self, path: Path, kept: int = KEPT_APPROVALS):
        super().__init__(path)
        self.pending: dict[str, dict[str, Any]] = {}
        #: Decided approvals kept in the file; older ones are deleted as new decisions come.
        self.kept = kept

    async def open(self) -> None:
        await super().open()
        # Gates left open by a previous run: their calls are gone, so they were never decided.
        db = self._conn()
        await db.execute("UPDATE approvals SET decision = 'abandoned', decided_by = 'server restart', "
                         "decided_at = ? WHERE decision IS NULL", (time.time(),))
        await self._prune()
        await db.commit()

    async def _prune(self) -> None:
        """Delete the decided approvals beyond the newest `kept` (open ones are always kept)."""
        await self._conn().execute(
            "DELETE FROM approvals WHERE decision IS NOT NULL AND gate_id NOT IN (SELECT gate_id FROM approvals"
            " WHERE decision IS NOT NULL ORDER BY decided_at DESC LIMIT ?)", (self.kept,))

    async def open_rows(self) -> list[dict[str, Any]]:
        """The gates waiting for a decision."""
        return list(self.pending.values())

    async def record_open(self, row: dict[str, Any]) -> None:
        db = self._conn()
        await db.execute(
            "INSERT OR REPLACE INTO approvals (gate_id, session, tool_name, request, opened_at) VALUES (?, ?, ?, ?, ?)",
            (row["gate_id"], row["session"], row["tool_name"], json.dumps(row["request"]), row["opened_at"]),
        )
        await db.commit()

    async def record_decision(self, gate_id: str, decision: str, decided_by: str, decided_at: float) -> None:
        db = self._conn()
        await db.execute("UPDATE approvals SET decision = ?, decided_by = ?, decided_at = ? WHERE gate_id = ?",
                         (decision, decided_by, decided_at, gate_id))
        await self._prune()
        await db.commit()

    async def history(self, session: str | None = None, limit: int = HISTORY_LIMIT) -> list[dict[str, Any]]:
        """Decided gates, newest first (of one session, or all)."""
        db = self._conn()
        sql = ("SELECT gate_id, session, tool_name, request, opened_at, decision, decided_by, decided_at "
               "FROM approvals WHERE decision IS NOT NULL")
        args: tuple[Any, ...] = ()
        if session is not None:
            sql += " AND session = ?"
            args = (session,)
        sql += " ORDER BY decided_at DESC LIMIT ?"
        rows = []
        async with db.execute(sql, (*args, limit)) as cur:
            async for gid, sess, tool, request, opened, decision, by, at in cur:
                rows.append({"gate_id": gid, "session": sess, "tool_name": tool, "request": json.loads(request),
                             "opened_at": opened, "decision": decision, "decided_by": by, "decided_at": at})
        return rows


class SharedApprovals(ApprovalStore):
    """The same record in Redis, for several instances on one store (`state.Runtime.link`): each instance
    records the gates of its own turns, and every instance lists and reads all of them."""

    def __init__(self, link: plugin_api.Link, kept: int = KEPT_APPROVALS):
        self.pending = {}
        self.kept = kept
        self.link = link
        self.r = link.client

    async def open(self) -> None:
        """Nothing to open: the connection is the session store's."""

    async def close(self) -> None:
        """Nothing to close: the connection is the session store's."""

    def _key(self, *parts: str) -> str:
        return self.link.key("approvals", *parts)

    async def open_rows(self) -> list[dict[str, Any]]:
        with self.link.calling():
            raw = await self.r.hgetall(self._key("pending"))
        rows, now, abandoned = [], time.time(), []
        for gate_id, text in raw.items():
            row = json.loads(text)
            wait = float(row.get("request", {}).get("timeout_seconds") or 0)
            if now > row["opened_at"] + wait + ABANDONED_AFTER:
                abandoned.append(gate_id)
            else:
                rows.append(row)
        if abandoned:
            with self.link.calling():
                await self.r.hdel(self._key("pending"), *abandoned)
        return rows

    async def record_open(self, row: dict[str, Any]) -> None:
        with self.link.calling():
            await self.r.hset(self._key("pending"), row["gate_id"], json.dumps(row))

    async def record_decision(self, gate_id: str, decision: str, decided_by: str, decided_at: float) -> None:
        with self.link.calling():
            raw = await self.r.hget(self._key("pending"), gate_id)
            if raw is None:
                return
            row = {**json.loads(raw), "decision": decision, "decided_by": decided_by, "decided_at": decided_at}
            pipe = self.r.pipeline(transaction=True)
            pipe.hdel(self._key("pending"), gate_id)
            pipe.set(self._key("row", gate_id), json.dumps(row), ex=SHARED_SECONDS)
            for key in (self._key("history"), self._key("history", row["session"])):
                pipe.zadd(key, {gate_id: decided_at})
                pipe.zremrangebyrank(key, 0, -(self.kept + 1))
                pipe.expire(key, SHARED_SECONDS)
            await pipe.execute()

    async def history(self, session: str | None = None, limit: int = HISTORY_LIMIT) -> list[dict[str, Any]]:
        key = self._key("history", session) if session is not None else self._key("history")
        with self.link.calling():
            ids: list[str] = await self.r.zrevrange(key, 0, limit - 1)  # type: ignore[assignment]  # decoded: str (Link.client)
            rows = await self.r.mget([self._key("row", i) for i in ids]) if ids else []
        return [json.loads(r) for r in rows if r]
