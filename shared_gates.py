"""Gates in Redis for several instances: pending gates answered on any instance, and routed gates (approvals.py)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from shared_link import BLOCK_MS, Link

logger = logging.getLogger("agent_mcp.shared")

_ANSWER = """if redis.call('EXISTS', KEYS[1]) == 0 or redis.call('HSETNX', KEYS[1], 'answered', '1') == 0 then
  return 0
end
redis.call('RPUSH', KEYS[2], ARGV[1]) redis.call('PEXPIRE', KEYS[2], ARGV[2]) return 1"""


class GateRelay:
    """Pending gates in Redis: a gate raised by a turn on one instance is listed and answered on any."""

    def __init__(self, link: Link):
        self.link = link
        self.r = link.client

    @contextlib.asynccontextmanager
    async def listening(self, gate_id: str, client_id: str, seconds: float, future: asyncio.Future[Any],
                        decision: Callable[[str, str, int, Any], Any]) -> AsyncIterator[None]:
        """While inside: the gate of `client_id` is listed for every instance, and an answer given on any
        sets `future` to `decision(word, by, minutes, content)`."""
        await self._raised(gate_id, client_id, seconds)
        delivering = asyncio.ensure_future(self._deliver(gate_id, future, decision))
        try:
            yield
        finally:
            delivering.cancel()
            await self._closed(gate_id)

    async def _raised(self, gate_id: str, client_id: str, seconds: float) -> None:
        key = self.link.key("gate", gate_id)
        with self.link.calling():
            pipe = self.r.pipeline(transaction=True)
            pipe.hset(key, mapping={"owner": client_id})
            pipe.pexpire(key, int((seconds + 60) * 1000))
            await pipe.execute()

    async def owner(self, gate_id: str) -> str | None:
        with self.link.calling():
            fields: dict[str, str] = await self.r.hgetall(self.link.key("gate", gate_id))  # type: ignore[assignment]  # decoded: str (Link.client)
        return None if not fields or fields.get("answered") else fields.get("owner")

    async def answer(self, gate_id: str, answer: dict[str, Any]) -> bool:
        """Deliver an answer to the gate's turn, wherever it runs; False if unknown or already answered."""
        key = self.link.key("gate", gate_id)
        with self.link.calling():
            return bool(await self.r.eval(_ANSWER, 2, key, self.link.key("answer", gate_id), json.dumps(answer),
                                          60_000))

    async def _deliver(self, gate_id: str, future: asyncio.Future[Any], decision: Callable[[str, str, int, Any], Any]
                       ) -> None:
        answer = await self._wait(gate_id)
        if not future.done():
            future.set_result(decision(answer["word"], answer.get("by", ""), int(answer["minutes"]),
                                       answer.get("content")))

    async def _wait(self, gate_id: str) -> dict[str, Any]:
        """The answer given on any instance (waits until one comes; the caller bounds the time)."""
        key = self.link.key("answer", gate_id)
        while True:
            try:
                popped = await self.r.blpop([key], timeout=BLOCK_MS / 1000)
            except self.link.lost as exc:
                self.link.unavailable(exc)
                await asyncio.sleep(0.5)
                continue
            if popped:
                return dict(json.loads(popped[1]))

    async def _closed(self, gate_id: str) -> None:
        with contextlib.suppress(*self.link.failed):
            await self.r.delete(self.link.key("gate", gate_id), self.link.key("answer", gate_id))


_CLAIM = """if redis.call('EXISTS', KEYS[1]) == 0 then return {0, false} end
if redis.call('HSETNX', KEYS[1], 'closing', ARGV[1]) == 1 then return {1, false} end
return {0, redis.call('HGET', KEYS[1], 'closing')}"""


class SharedApprovals:
    """Routed gates (approvals.py) for every instance: their descriptions, the first answer, the approver windows.

    `approval:<id>` (a hash: `gate` its description, `closing` the first answer or the timeout, claimed once with
    HSETNX) lives until a while after its deadline, so a late answerer learns who answered; `approvals` (a sorted
    set by deadline) lists the open ones; `approver:<window>` marks a shell window that opted in.
    """

    #: How long a closed gate's record stays for late answerers.
    KEPT_SECONDS = 600

    def __init__(self, link: Link):
        self.link = link
        self.r = link.client

    async def add(self, gate_id: str, record: str, deadline: float) -> None:
        key = self.link.key("approval", gate_id)
        with self.link.calling():
            pipe = self.r.pipeline(transaction=True)
            pipe.hset(key, mapping={"gate": record})
            pipe.expireat(key, int(deadline + self.KEPT_SECONDS))
            pipe.zadd(self.link.key("approvals"), {gate_id: deadline})
            pipe.zremrangebyscore(self.link.key("approvals"), "-inf", time.time() - self.KEPT_SECONDS)
            await pipe.execute()

    async def get(self, gate_id: str) -> tuple[str | None, str | None]:
        """(description, closing) of a routed gate, None for what is not there."""
        with self.link.calling():
            found: list[str | None] = await self.r.hmget(self.link.key("approval", gate_id), ["gate", "closing"])  # type: ignore[assignment]  # decoded: str (Link.client)
        return found[0], found[1]

    async def claim(self, gate_id: str, closing: str) -> tuple[bool, str | None]:
        """(True, None) when `closing` is the first answer; else (False, the first one) — (False, None): unknown."""
        with self.link.calling():
            won, first = await self.r.eval(_CLAIM, 1, self.link.key("approval", gate_id), closing)
        return bool(won), first or None

    async def closed(self, gate_id: str) -> None:
        with contextlib.suppress(*self.link.failed):
            await self.r.zrem(self.link.key("approvals"), gate_id)

    async def open_ones(self) -> list[str]:
        """Descriptions of the routed gates still open (deadline not passed), soonest deadline first."""
        with self.link.calling():
            ids: list[str] = await self.r.zrangebyscore(self.link.key("approvals"), time.time(), "+inf")  # type: ignore[assignment]  # decoded: str (Link.client)
            if not ids:
                return []
            pipe = self.r.pipeline(transaction=False)
            for gate_id in ids:
                pipe.hmget(self.link.key("approval", gate_id), ["gate", "closing"])
            rows = await pipe.execute()
        return [g for g, c in rows if g and not c]

    async def set_window(self, window: str, on: bool, seconds: float) -> None:
        with self.link.calling():
            if on:
                await self.r.set(self.link.key("approver", window), "1", px=int(seconds * 1000))
            else:
                await self.r.delete(self.link.key("approver", window))

    async def window(self, window: str) -> bool:
        with self.link.calling():
            return bool(await self.r.exists(self.link.key("approver", window)))
