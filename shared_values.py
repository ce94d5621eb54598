"""Small state in Redis for several instances: rate-limit windows and disabled tool types, plugin values."""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

from shared_link import Link

logger = logging.getLogger("agent_mcp.shared")

_WINDOW = """if redis.call('SISMEMBER', KEYS[2], ARGV[5]) == 1 then return 'disabled' end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', tonumber(ARGV[1]) - tonumber(ARGV[2]))
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[3]) then
  if ARGV[4] == '1' then redis.call('SADD', KEYS[2], ARGV[5]) end
  return 'limit'
end
redis.call('ZADD', KEYS[1], ARGV[1], ARGV[6])
redis.call('PEXPIRE', KEYS[1], math.ceil(tonumber(ARGV[2]) * 1000))
return ''"""


class SharedLimits:
    """Rate-limit windows and disabled tool types in Redis (rate_limits.RateLimiter's shared half)."""

    def __init__(self, link: Link):
        self.link = link
        self.r = link.client

    async def hit(self, client_id: str, tool_type: str, limit: Any) -> str | None:
        """rate_limits.RateLimiter.hit for every instance: count one call under `limit` (a config.RateLimit, None:
        unlimited); None if allowed, else "limit" or "disabled"."""
        with self.link.calling():
            if limit is None or not limit.calls or not limit.window_seconds:
                off = await self.r.sismember(self.link.key("disabled", client_id), tool_type)
                return "disabled" if off else None
            why = await self.r.eval(_WINDOW, 2, self.link.key("rate", client_id, tool_type),
                                    self.link.key("disabled", client_id), time.time(), limit.window_seconds,
                                    limit.calls, "1" if limit.auto_disable else "0", tool_type, uuid.uuid4().hex)
        return why or None

    async def usage(self, client_id: str, windows: dict[str, float]) -> tuple[dict[str, int], set[str]]:
        """(calls per tool type within its window, the disabled types) of a session."""
        now = time.time()
        with self.link.calling():
            pipe = self.r.pipeline(transaction=False)
            for tool_type, seconds in windows.items():
                pipe.zcount(self.link.key("rate", client_id, tool_type), now - seconds, "+inf")
            pipe.smembers(self.link.key("disabled", client_id))
            *counts, off = await pipe.execute()
        return dict(zip(windows, (int(c) for c in counts), strict=True)), set(off)

    async def enable(self, client_id: str, tool_type: str) -> bool:
        with self.link.calling():
            return bool(await self.r.srem(self.link.key("disabled", client_id), tool_type))

    async def forget(self, client_id: str) -> None:
        with self.link.calling():
            keys = [k async for k in self.r.scan_iter(match=self.link.key("rate", client_id, "*"))]
            await self.r.delete(self.link.key("disabled", client_id), *keys)


class SharedValues:
    """Small values plugins keep for every instance (de-duplication keys, fingerprints, turn cursors)."""

    def __init__(self, link: Link):
        self.link = link
        self.r = link.client

    async def put(self, name: str, value: str, seconds: float, *, only_new: bool = False) -> bool:
        """Store `value` under `name` for `seconds`; with `only_new`, only if `name` is not set (then
        False says another instance set it first)."""
        with self.link.calling():
            return bool(await self.r.set(self.link.key("value", name), value, px=int(seconds * 1000), nx=only_new))

    async def get(self, name: str) -> str | None:
        with self.link.calling():
            return await self.r.get(self.link.key("value", name))

    async def take(self, name: str) -> str | None:
        """The value under `name`, removed (one instance gets it)."""
        with self.link.calling():
            return await self.r.getdel(self.link.key("value", name))

    async def drop(self, name: str) -> None:
        with self.link.calling():
            await self.r.delete(self.link.key("value", name))
