"""The per-caller rate limiter: sliding windows per (identity, tool type), the first tool check.

Installed in the tool pipeline's checks (`tool_calls.ToolPipeline.checks`) before the human gate
(`RateLimiter.check`); a tool's rate-limit type is its gate type (`gate.gate_type`). With a shared
store the windows live in Redis (`shared_values.SharedLimits`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import events
import turns
from config import RateLimit
from gate import Refusal, gate_type

if TYPE_CHECKING:
    import shared_values
    from registry import RegisteredTool

logger = logging.getLogger("agent_mcp.rate_limits")

SWEEP_EVERY = 256


def whom(turn: turns.Turn) -> str:
    """Who a rate limit counts for, as the model and the user are told."""
    return "this caller (all its sessions)" if turn.identity else "this session"


class RateLimiter:
    """Sliding windows per (identity, tool type) from `plugins-enabled.json` `rate_limits`.

    The key is a turn's `rate_key`: the proven identity within its client class (one shell token,
    API key, proxy user, MCP token, Slack user), so a caller that makes new session ids still
    shares one window; a session id only when the client plugin proved nothing. A call over the
    limit is refused (and not counted). With `auto_disable` the whole tool type is then disabled
    for that key until `!ratelimit enable <type>`. Deleting a session leaves an identity's windows
    alone. Empty windows are dropped every `SWEEP_EVERY` checks, so memory stays bounded by the
    recently active callers.
    """

    def __init__(self, limits: dict[str, RateLimit], hub: events.EventHub,
                 clock: Callable[[], float] = time.monotonic):
        self.limits = limits
        #: Where a refused call's session is told.
        self.hub = hub
        self.clock = clock
        self.windows: dict[tuple[str, str], deque[float]] = {}
        self.disabled: dict[str, set[str]] = {}
        self._checks = 0
        #: With a shared store: the windows and disabled types live in Redis for every instance.
        self.shared: shared_values.SharedLimits | None = None

    def hit(self, client_id: str, tool_type: str) -> str | None:
        """Count one call; None if allowed, else why not ("limit" or "disabled") as a short reason."""
        if tool_type in self.disabled.get(client_id, ()):
            return "disabled"
        limit = self.limits.get(tool_type)
        if limit is None or limit.calls == 0 or limit.window_seconds == 0:
            return None
        now = self.clock()
        self._checks += 1
        if self._checks % SWEEP_EVERY == 0:
            self.sweep(now)
        window = self.windows.setdefault((client_id, tool_type), deque())
        while window and window[0] <= now - limit.window_seconds:
            window.popleft()
        if len(window) >= limit.calls:
            if limit.auto_disable:
                self.disabled.setdefault(client_id, set()).add(tool_type)
            return "limit"
        window.append(now)
        return None

    def sweep(self, now: float | None = None) -> None:
        """Drop windows whose calls have all expired."""
        now = self.clock() if now is None else now
        for key in list(self.windows):
            limit = self.limits.get(key[1])
            window = self.windows[key]
            if limit is None or not window or window[-1] <= now - limit.window_seconds:
                del self.windows[key]

    async def count(self, client_id: str, tool_type: str) -> str | None:
        """`hit`, in Redis when the store is shared."""
        if self.shared is None:
            return self.hit(client_id, tool_type)
        return await self.shared.hit(client_id, tool_type, self.limits.get(tool_type))

    async def reenable(self, client_id: str, tool_type: str) -> bool:
        """`enable`, in Redis when the store is shared."""
        return await self.shared.enable(client_id, tool_type) if self.shared else self.enable(client_id, tool_type)

    def enable(self, client_id: str, tool_type: str) -> bool:
        """Re-enable a tool type for a session; False if it was not disabled."""
        types = self.disabled.get(client_id, set())
        if tool_type not in types:
            return False
        types.discard(tool_type)
        if not types:
            self.disabled.pop(client_id, None)
        return True

    def forget(self, client_id: str) -> None:
        """Drop everything kept for a deleted session."""
        if self.shared is not None:
            asyncio.get_running_loop().create_task(self.shared.forget(client_id))
        self.disabled.pop(client_id, None)
        for key in [k for k in self.windows if k[0] == client_id]:
            del self.windows[key]

    async def check(self, turn: turns.Turn, entry: RegisteredTool, args: dict[str, Any]) -> Refusal | None:
        """The rate-limit check of one tool call: None to go on, or the refusal the model receives."""
        client_id, tool_name, tool_type = turn.client_id, entry.tool.name, gate_type(entry)
        why = await self.count(turn.rate_key, tool_type)
        if why is None:
            return None
        again = f"the operator can re-enable them with !ratelimit enable {tool_type}"
        if why == "disabled":
            self.hub.status(client_id, f"[RATE LIMITED] {tool_name}: {tool_type} tools are disabled for {whom(turn)}")
            return Refusal("rate_limited", f"TOOL DISABLED: {tool_type} tools were disabled for {whom(turn)} after "
                                           f"the rate limit was exceeded; {again}. Do not call them again.")
        logger.info("rate limit: %s (%s) refused for %s (%s)", tool_name, tool_type, turn.rate_key, why)
        limit = self.limits[tool_type]
        rule = f"limit is {limit.calls} calls in {limit.window_seconds:g} s for {whom(turn)}"
        self.hub.status(client_id, f"[RATE LIMITED] {tool_name} ({tool_type}): {rule}")
        message = f"RATE LIMIT EXCEEDED: {tool_name} ({tool_type}) — {rule}."
        if limit.auto_disable:
            return Refusal("rate_limited", f"{message} All {tool_type} tools are now disabled for {whom(turn)}; "
                                           f"{again}.")
        return Refusal("rate_limited", f"{message} Wait before calling it again.")

    async def describe(self, client_id: str, types: Iterable[str]) -> str:
        """The limits and this session's state, one line per tool type."""
        rows = []
        windows = {k: v.window_seconds for k, v in self.limits.items()}
        if self.shared is not None:
            used_by, off_types = await self.shared.usage(client_id, windows)
        else:
            now = self.clock()
            used_by = {k: sum(1 for t in self.windows.get((client_id, k), ()) if t > now - seconds)
                       for k, seconds in windows.items()}
            off_types = self.disabled.get(client_id, set())
        for tool_type in sorted(set(types) | set(self.limits)):
            limit = self.limits.get(tool_type)
            rule = (
                f"{limit.calls} calls / {limit.window_seconds:g} s" + (", auto_disable" if limit.auto_disable else "")
                if limit and limit.calls and limit.window_seconds
                else "unlimited"
            )
            used = used_by.get(tool_type, 0)
            off = " — DISABLED for this session" if tool_type in off_types else ""
            rows.append(f"  {tool_type:<12} {rule}" + (f" (used {used})" if used else "") + off)
        return "\n".join(rows)
