"""AgentClient's stream reconnection, against a small fake of the API endpoint that drops streams."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from tenacity import wait_none

import api_client
from api_client import AgentClient, AgentConnectionError
from shell_client import RequestRejected, ShellClient
from tests.fakes.server import ThreadedServer

TURN = [("tok", {"text": "Hel"}), ("tok", {"text": "lo"}), ("done", {})]


class DroppingApi(ThreadedServer):
    """/api/v1/submit accepts; each /api/v1/stream connection sends at most `per_connection` events of
    TURN after the client's Last-Event-ID, then closes."""

    def __init__(self, per_connection: int, pings: bool = False) -> None:
        super().__init__()
        self.per_connection = per_connection
        self.pings = pings  # a keepalive comment after each event, as the server sends every 15 s
        self.last_event_ids: list[str | None] = []

    def app(self) -> Starlette:
        async def submit(request: Request) -> JSONResponse:
            body = await request.json()
            return JSONResponse({"status": "OK", "client_id": body["client_id"], "turn_id": 1, "after": 0})

        async def stream(request: Request) -> Response:
            last = request.headers.get("last-event-id")
            self.last_event_ids.append(last)
            start = int(last or 0)
            events = list(enumerate(TURN, 1))[start:start + self.per_connection]
            ping = ": ping\n\n" if self.pings else ""
            body = "".join(f"id: {i}\nevent: {name}\ndata: {json.dumps(data)}\n\n{ping}" for i, (name, data) in events)
            return Response(body, media_type="text/event-stream")

        return Starlette(routes=[Route("/api/v1/submit", submit, methods=["POST"]),
                                 Route("/api/v1/stream/{client_id}", stream),
                                 Route("/submit", submit, methods=["POST"]),  # shell.py's endpoints: the same
                                 Route("/stream", stream)])


@pytest.fixture(autouse=True)
def no_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(api_client, "RECONNECT_WAIT", wait_none())


@pytest.fixture
def one_event_per_connection() -> Iterator[DroppingApi]:
    with DroppingApi(per_connection=1) as server:
        yield server


async def test_a_stream_that_keeps_dropping_after_new_events_is_followed_to_the_end(one_event_per_connection):
    api = one_event_per_connection
    assert await AgentClient(api.url, client_id="c1").send("hi") == "Hello"
    # every reconnection resumes after the last event it received
    assert api.last_event_ids == ["0", "1", "2"]


async def test_a_stream_that_never_brings_an_event_is_given_up_with_a_clear_error():
    with DroppingApi(per_connection=0) as api:
        with pytest.raises(AgentConnectionError, match="keeps breaking: the stream ended before the turn did"):
            await AgentClient(api.url, client_id="c1").send("hi")
    assert len(api.last_event_ids) == api_client.RECONNECTS + 1


async def test_keepalive_comments_are_not_events():
    # httpx-sse yields an empty message after a comment once an id was seen; the SSE spec dispatches nothing.
    with DroppingApi(per_connection=3, pings=True) as api:
        events = [ev async for ev in AgentClient(api.url, client_id="c1").events("hi")]
        async with ShellClient(api.url, "c1", retry_initial=0.05) as shell:  # shell.py's reader too
            seen = []
            async for ev in shell.events():
                seen.append(ev)
                if ev.name == "done":
                    break
    assert [(e.name, e.data) for e in events] == TURN
    assert [(e.name, e.data) for e in seen] == TURN


class Restarting(DroppingApi):
    """A load balancer in front of a restarting server: the first `bad` submits get nginx's 502 page."""

    def __init__(self, bad: int) -> None:
        super().__init__(per_connection=3)
        self.bad = bad
        self.submits = 0

    def app(self) -> Starlette:
        inner = super().app()

        async def gateway(scope, receive, send):
            if scope["type"] == "http" and scope["path"] in ("/api/v1/submit", "/submit"):
                self.submits += 1
                if self.submits <= self.bad:
                    page = Response("<html><body><h1>502 Bad Gateway</h1></body></html>", status_code=502,
                                    media_type="text/html", headers={"server": "nginx/1.22.1"})
                    await page(scope, receive, send)
                    return
            await inner(scope, receive, send)

        return gateway  # type: ignore[return-value]


async def test_a_request_no_instance_took_is_sent_again(monkeypatch):
    monkeypatch.setattr(api_client, "RETRY_SECONDS", 5.0)
    with Restarting(bad=2) as api:
        assert await AgentClient(api.url, client_id="c1").send("hi") == "Hello"
        assert api.submits == 3
    with Restarting(bad=2) as api:
        async with ShellClient(api.url, "c1") as shell:
            await shell.submit("hi")
        assert api.submits == 3


async def test_a_gateway_that_keeps_failing_is_named_not_pasted(monkeypatch):
    monkeypatch.setattr(api_client, "RETRY_SECONDS", 0.5)
    with Restarting(bad=1000) as api:
        with pytest.raises(api_client.AgentRequestError) as failed:
            await AgentClient(api.url, client_id="c1").send("hi")
        async with ShellClient(api.url, "c1") as shell:
            with pytest.raises(RequestRejected) as rejected:
                await shell.submit("hi")
    for error in (failed.value, rejected.value):
        assert "HTTP 502: Bad Gateway from " in str(error) and "nginx/1.22.1 in front of the server" in str(error)
        assert "<html>" not in str(error)
    assert api.submits > 2  # sent again while the time lasted
