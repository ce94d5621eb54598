"""Small state in Redis for several instances: rate-limit windows and disabled tool types, the core's values and
each plugin's own."""

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
    """Small values the core keeps for every instance (the system prompt the last one started with); a plugin's
    are its own `PluginValues`."""

    def __init__(self, link: Link):
        self.link = link
        self.r = link.client

    async def put(self, name: str, value: str, seconds: float) -> None:
        """Store `value` under `name` for `seconds`."""
        with self.link.calling():
            await self.r.set(self.link.key("core-value", name), value, px=int(seconds * 1000))

    async def get(self, name: str) -> str | None:
        with self.link.calling():
            value: str | None = await self.r.get(self.link.key("core-value", name))  # type: ignore[assignment]  # decoded: str (Link.client)
            return value


# A plugin's values live under `plugin-value:<plugin>:<name>`, the core's under `core-value:<name>`: no name
# reaches another root. Those written before values were kept per plugin, under `value:<name>`, are still read
# (and copied, keeping their time left) until they expire, and an old key still set counts as taken, so instances
# of both versions on one store never both claim one event.
_GET = """local v = redis.call('GET', KEYS[1])
if v then return v end
v = redis.call('GET', KEYS[2])
if not v then return false end
local left = redis.call('PTTL', KEYS[2])
if left > 0 then redis.call('SET', KEYS[1], v, 'PX', left, 'NX')
elseif left == -1 then redis.call('SET', KEYS[1], v, 'NX') end
return v"""
_PUT_NEW = """if redis.call('EXISTS', KEYS[2]) == 1 then return 0 end
if redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2], 'NX') then return 1 end
return 0"""
_TAKE = """local v = redis.call('GETDEL', KEYS[1])
local old = redis.call('GETDEL', KEYS[2])
return v or old"""


class PluginValues:
    """One plugin's small values for every instance (de-duplication keys, fingerprints, turn cursors): its
    names are its own, kept apart from every other plugin's (`ctx.values`)."""

    def __init__(self, link: Link, plugin: str):
        self._link = link
        self._plugin = plugin

    def _keys(self, name: str) -> tuple[str, str]:
        """(the key of `name`, the key an earlier version kept it under)."""
        return self._link.key("plugin-value", self._plugin, name), self._link.key("value", name)

    async def put(self, name: str, value: str, seconds: float, *, only_new: bool = False) -> bool:
        """Store `value` under `name` for `seconds`; with `only_new`, only if `name` is not set (then
        False says another instance set it first)."""
        key, old = self._keys(name)
        ms = max(1, int(seconds * 1000))
        with self._link.calling():
            if only_new:
                return bool(await self._link.client.eval(_PUT_NEW, 2, key, old, value, ms))
            return bool(await self._link.client.set(key, value, px=ms))

    async def get(self, name: str) -> str | None:
        with self._link.calling():
            value: str | None = await self._link.client.eval(_GET, 2, *self._keys(name))  # the value, or nil
            return value

    async def take(self, name: str) -> str | None:
        """The value under `name`, removed (one instance gets it)."""
        with self._link.calling():
            value: str | None = await self._link.client.eval(_TAKE, 2, *self._keys(name))  # the value, or nil
            return value

    async def drop(self, name: str) -> None:
        with self._link.calling():
            await self._link.client.delete(*self._keys(name))
