"""Sessions in Redis for several instances (`SESSION_STORE=redis://…`): the store, turn leases, heartbeats.

Keys are described in shared_link.py; `open_store` picks this store or an embedded one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import sessions
import stores
from shared_link import Link, is_redis_url, stop_task

logger = logging.getLogger("agent_mcp.shared")

#: A turn lease lapses this long after its last renewal (its instance died); renewed every third of it.
LEASE_SECONDS = 5.0
#: How often a waiting request tries a taken lease again.
LEASE_POLL_SECONDS = 0.05
#: Why a removed session went, kept this long for a client that comes back.
GONE_SECONDS = 30 * 86400


#: Save a session (one round trip): its hash, the index by shorthand id, the running set; unless it must
#: exist already (ARGV[6] = 0) and the store no longer holds that session, or it is saved under a turn lease
#: (ARGV[7]) that this instance no longer holds. "That session" is its shorthand id, never handed out twice:
#: a session another instance removed, and one created anew under its client id since, both refuse the save
#: of a copy an instance kept in memory (the deleted history must not come back into the new session).
_SAVE = """if ARGV[6] == '0' and redis.call('HGET', KEYS[1], 'shorthand') ~= ARGV[2] then return 0 end
if ARGV[7] ~= '' and redis.call('GET', KEYS[4]) ~= ARGV[7] then return 0 end
redis.call('HSET', KEYS[1], 'shorthand', ARGV[2], 'updated', ARGV[3], 'record', ARGV[4])
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[1])
if ARGV[5] == '1' then redis.call('SADD', KEYS[3], ARGV[1]) else redis.call('SREM', KEYS[3], ARGV[1]) end
return 1"""
_RELEASE = """if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"""
_RENEW = """if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0"""


class RedisStore(stores.SessionStore):
    """Sessions in Redis, shared by every instance that names the same server and prefix."""

    shared = True

    def __init__(self, link: Link):
        self.link = link
        self.r = link.client
        self._save = self.r.register_script(_SAVE)
        self._beating: asyncio.Task[None] | None = None
        #: The turn leases this instance holds: client id → its token (saves under a lease are fenced by it).
        self._held: dict[str, str] = {}

    def _key(self, kind: str, client_id: str = "") -> str:
        return self.link.key(kind, client_id) if client_id else self.link.key(kind)

    async def open(self) -> None:
        await self.link.open()
        with self.link.calling():  # the first id handed out is FIRST_SHORTHAND
            await self.r.set(self._key("shorthand"), stores.FIRST_SHORTHAND - 1, nx=True)
        await self._beat()
        self._beating = asyncio.create_task(self._beat_forever(), name="instance-heartbeat")

    async def close(self) -> None:
        if self._beating is not None:
            await stop_task(self._beating)
            with contextlib.suppress(*self.link.failed):
                await self.r.zrem(self._key("instances"), self.link.instance)  # a stopped instance leaves at once
        await self.link.close()

    async def _beat(self) -> None:
        """Say this instance is alive for the next LEASE_SECONDS (instances that stop saying so drop out)."""
        now = time.time()
        pipe = self.r.pipeline(transaction=False)
        pipe.zadd(self._key("instances"), {self.link.instance: now + LEASE_SECONDS})
        pipe.zremrangebyscore(self._key("instances"), "-inf", now)
        await pipe.execute()

    async def _beat_forever(self) -> None:
        while True:
            await asyncio.sleep(LEASE_SECONDS / 3)
            try:
                await self._beat()
            except self.link.failed as exc:
                self.link.unavailable(exc)

    async def instances(self) -> int:
        with self.link.calling():
            return int(await self.r.zcount(self._key("instances"), time.time(), "+inf"))

    def describe(self) -> str:
        return f"Redis at {self.link.where}, keys under {self.link.prefix!r} (this instance: {self.link.instance})"

    @staticmethod
    def _session(client_id: str, fields: dict[str, str]) -> stores.Session | None:
        if not fields:
            return None
        try:
            return stores.Session.from_record(client_id, int(fields["shorthand"]), json.loads(fields["record"]),
                                              float(fields["updated"]))
        except (ValueError, KeyError, TypeError) as exc:
            logger.error("session %s in Redis is damaged and was skipped: %s", client_id, exc)
            return None

    async def fetch(self, client_id: str) -> stores.Session | None:
        with self.link.calling():
            fields: dict[str, str] = await self.r.hgetall(self._key("session", client_id))  # type: ignore[assignment]  # decoded: str (Link.client)
            return self._session(client_id, fields)

    async def fetch_all(self) -> list[stores.Session]:
        with self.link.calling():
            ids: list[str] = await self.r.zrange(self._key("sessions"), 0, -1)  # type: ignore[assignment]  # decoded: str (Link.client)
            pipe = self.r.pipeline(transaction=False)
            for client_id in ids:
                pipe.hgetall(self._key("session", client_id))
            rows = await pipe.execute() if ids else []
        found = (self._session(c, f) for c, f in zip(ids, rows, strict=True))
        return [s for s in found if s is not None]

    async def allocate_shorthand(self) -> int:
        with self.link.calling():
            return int(await self.r.incr(self._key("shorthand")))

    async def save(self, session: stores.Session, last_shorthand: int, *, create: bool = True) -> bool:
        keys = [self._key("session", session.client_id), self._key("sessions"), self._key("running"),
                self._key("lease", session.client_id)]
        with self.link.calling():
            return bool(await self._save(keys, [
                session.client_id, session.shorthand, session.updated,
                session.to_json(), int(bool(session.running)), int(create),
                self._held.get(session.client_id, "")]))

    async def delete(self, client_id: str) -> None:
        with self.link.calling():
            pipe = self.r.pipeline(transaction=True)
            pipe.delete(self._key("session", client_id))
            pipe.zrem(self._key("sessions"), client_id)
            pipe.srem(self._key("running"), client_id)
            await pipe.execute()

    async def mark_gone(self, client_id: str, why: str) -> None:
        with self.link.calling():
            await self.r.set(self._key("gone", client_id), why, ex=GONE_SECONDS)

    async def take_gone(self, client_id: str) -> str | None:
        with self.link.calling():
            why: str | None = await self.r.getdel(self._key("gone", client_id))  # type: ignore[assignment]  # decoded: str (Link.client)
            return why

    @contextlib.asynccontextmanager
    async def lease(self, client_id: str, holder: str) -> AsyncIterator[None]:
        """The session's turn lease: taken when free (tried again every LEASE_POLL_SECONDS), renewed while
        held, given back at the end. If its instance dies it lapses after LEASE_SECONDS. An instance that
        finds it lost (paused, or cut from Redis, for longer) cancels the holder with sessions.LEASE_LOST, and
        its saves of the session are refused meanwhile: another instance has ended that turn."""
        key, token, ms = self._key("lease", client_id), f"{self.link.instance}:{holder}", int(LEASE_SECONDS * 1000)
        with self.link.calling():
            while not await self.r.set(key, token, nx=True, px=ms):  # noqa: ASYNC110 (the holder may be elsewhere)
                await asyncio.sleep(LEASE_POLL_SECONDS)
        self._held[client_id] = token
        renewer = asyncio.get_running_loop().create_task(
            self._renew(key, token, ms, asyncio.current_task()), name=f"lease:{client_id}")
        try:
            yield
        finally:
            renewer.cancel()
            if self._held.get(client_id) == token:
                del self._held[client_id]
            with contextlib.suppress(*self.link.failed):  # unreachable: it lapses by itself
                await self.r.eval(_RELEASE, 1, key, token)

    async def _renew(self, key: str, token: str, ms: int, holder: asyncio.Task[Any] | None) -> None:
        while True:
            await asyncio.sleep(LEASE_SECONDS / 3)
            try:
                if not await self.r.eval(_RENEW, 1, key, token, ms):
                    logger.error("lost the turn lease %s (this instance was paused, or cut off from Redis, for over "
                                 "%g s): another instance has ended that turn; it stops here and is not saved",
                                 key, LEASE_SECONDS)
                    if holder is not None:
                        holder.cancel(sessions.LEASE_LOST)
                    return
            except self.link.failed as exc:
                logger.warning("could not renew the turn lease %s: %s", key, exc)

    async def orphans(self) -> list[str]:
        with self.link.calling():
            members: set[str] = await self.r.smembers(self._key("running"))  # type: ignore[assignment]  # decoded: str (Link.client)
            running = sorted(members)
            if not running:
                return []
            pipe = self.r.pipeline(transaction=False)
            for client_id in running:
                pipe.exists(self._key("lease", client_id))
            held = await pipe.execute()
        return [c for c, h in zip(running, held, strict=True) if not h]


def open_store(url: str | None, data_dir: Path) -> stores.SessionStore:
    """A store from a `SESSION_STORE` setting: `redis://…` (several instances), else stores.open_store."""
    if is_redis_url(url):
        return RedisStore(Link(str(url)))
    return stores.open_store(url, data_dir)
