"""Base of the local service fakes (Drive, Tavily, DuckDuckGo, xAI, Gemini grounding).

Each fake is a real HTTP(S) server (see `tests.fakes.server`) whose routes record every request in
`calls` and answer with the service's real JSON; `fail_next()` queues the service's real error responses.
"""

from __future__ import annotations

import json
import threading
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute

from tests.fakes.server import ThreadedServer

Handler = Callable[[Request, "Call"], Awaitable[Response]]


@dataclass(frozen=True)
class Call:
    """One request the fake received."""

    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    body: bytes

    @property
    def json(self) -> Any:
        """The body parsed as JSON (None when it is not JSON)."""
        try:
            return json.loads(self.body)
        except ValueError:
            return None


class ServiceFake(ThreadedServer):
    """Recorded calls and queued failures around a service's routes (subclasses define `routes()`)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._lock = threading.Lock()
        self._calls: list[Call] = []
        self._failures: deque[tuple[int, Any]] = deque()

    def routes(self) -> Sequence[BaseRoute]:
        raise NotImplementedError

    def app(self) -> Starlette:
        return Starlette(routes=self.routes())

    @property
    def calls(self) -> list[Call]:
        """A snapshot of the requests received so far, oldest first."""
        with self._lock:
            return list(self._calls)

    def fail_next(self, status: int, body: Any, times: int = 1) -> None:
        """Answer the next `times` requests with HTTP `status` and the JSON `body` (the service's error shape)."""
        with self._lock:
            self._failures.extend([(status, body)] * times)

    def recorded(self, handler: Handler) -> Callable[[Request], Awaitable[Response]]:
        """Wrap a route handler: record the request, then send a queued failure or the handler's answer."""

        async def wrapped(request: Request) -> Response:
            call = Call(request.method, request.url.path, dict(request.query_params), dict(request.headers),
                        await request.body())
            with self._lock:
                self._calls.append(call)
                failure = self._failures.popleft() if self._failures else None
            if failure is not None:
                return JSONResponse(failure[1], status_code=failure[0])
            return await handler(request, call)

        return wrapped
