"""Wait for a condition, not for a time: poll it until it holds or a generous deadline passes, then fail
saying what never happened. For tests that need something to be under way (a request at the fake model, a
line in a server's log) where there is no event to await."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

#: Generous: a loaded machine (the whole suite twice at once on two cores) is slow, never this slow.
DEADLINE = 60.0


async def until(condition: Callable[[], bool | Awaitable[bool]], what: str, seconds: float = DEADLINE,
                step: float = 0.02) -> None:
    """Return as soon as `condition()` (sync or async) is true; AssertionError naming `what` after `seconds` s."""
    deadline = time.monotonic() + seconds
    while True:
        held = condition()
        if not isinstance(held, bool):
            held = await held
        if held:
            return
        assert time.monotonic() < deadline, f"timed out after {seconds:g} s waiting for {what}"
        await asyncio.sleep(step)


def until_sync(condition: Callable[[], bool], what: str, timeout: float = DEADLINE, step: float = 0.05) -> None:
    """`until` for a test without an event loop."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout:g} s waiting for {what}"
        time.sleep(step)
