"""Drive a turn through shell.py's own client code, as a user's terminal would."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from shell_client import ShellClient, ShellEvent

if TYPE_CHECKING:
    from tests.conftest import AgentServer


async def collect_turn(client: ShellClient, text: str) -> list[ShellEvent]:
    """Submit on an already-open stream and gather events up to the turn's `done`."""
    await client.connect(max_wait=10)
    await client.submit(text)
    events: list[ShellEvent] = []
    async for ev in client.events():
        events.append(ev)
        if ev.name == "done":
            return events
    return events


def run_turn(server: AgentServer, client_id: str, text: str) -> list[ShellEvent]:
    """One whole turn from a fresh client of `server`'s shell endpoint (sync, for subprocess servers)."""

    async def _go() -> list[ShellEvent]:
        async with ShellClient(server.url, client_id, token=server.token) as client:
            return await asyncio.wait_for(collect_turn(client, text), 30)

    return asyncio.run(_go())


def answer(events: list[ShellEvent]) -> str:
    return "".join(e.text for e in events if e.name == "tok")
