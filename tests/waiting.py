"""Wait for a condition, not for a time: poll it until it holds or a generous deadline passes, then fail
saying what never happened. For tests that need something to be under way (a request at the fake model, a
line in a server's log) where there is no event to await. The one place in tests/ that polls against a
deadline (tests/test_suite_rules.py keeps it so)."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

#: Generous: a loaded machine (the whole suite twice at once on two cores) is slow, never this slow.
DEADLINE = 60.0


async def until(condition: Callable[[], T | Awaitable[T]], what: str, seconds: float = DEADLINE,
                step: float = 0.02) -> T:
    """The first truthy value of `condition()` (sync or async), as soon as it has one; AssertionError naming
    `what` after `seconds` s. An exception `condition` raises (an assertion that the wait is still worth it)
    ends the wait at once."""
    deadline = time.monotonic() + seconds
    while True:
        held = condition()
        if inspect.isawaitable(held):
            held = await held
        if held:
            return held  # type: ignore[return-value]  # an awaitable's result, which is a T
        assert time.monotonic() < deadline, f"timed out after {seconds:g} s waiting for {what}"
        await asyncio.sleep(step)


def until_sync(condition: Callable[[], T], what: str, timeout: float = DEADLINE, step: float = 0.05) -> T:
    """`until` for a test without an event loop."""
    held = within_sync(condition, timeout, step)
    assert held, f"timed out after {timeout:g} s waiting for {what}"
    return held


def within_sync(condition: Callable[[], T], timeout: float = DEADLINE, step: float = 0.05) -> T | None:
    """The first truthy value of `condition()` within `timeout` s, else None: for a helper whose caller says
    what went wrong (a window's screen, a server's log) or that raises its own error."""
    deadline = time.monotonic() + timeout
    while not (held := condition()):
        if time.monotonic() >= deadline:
            return None
        time.sleep(step)
    return held


def succeeds(probe: Callable[[], object], *errors: type[BaseException]) -> bool:
    """Whether `probe()` runs without raising one of `errors` (a server that is not listening yet): for
    `until_sync(lambda: succeeds(client.ping, ConnectionError), …)`."""
    try:
        probe()
    except errors:
        return False
    return True
