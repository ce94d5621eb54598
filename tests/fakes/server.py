"""A real HTTP(S) server for fakes: an ASGI app served by uvicorn on 127.0.0.1 in a background thread.

Blocking client libraries (httplib2, primp) can call it from the test's own thread, and async ones from the
test's event loop, because the server runs its own loop in its own thread. With `tls=` it speaks HTTPS with
a certificate from `tests.fakes.tls`.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from typing import TYPE_CHECKING, Self

import uvicorn
from starlette.types import ASGIApp

if TYPE_CHECKING:
    from tests.fakes.tls import TLSFiles


class _Server(uvicorn.Server):
    """A uvicorn server that reports readiness and stops on an event instead of polling a flag."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.ready = threading.Event()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.stopping: asyncio.Event | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        self.stopping = asyncio.Event()
        await super().startup(sockets)
        self.ready.set()

    async def main_loop(self) -> None:
        assert self.stopping is not None
        await self.on_tick(0)  # sets the Date header once
        await self.stopping.wait()

    def request_stop(self) -> None:
        """Thread-safe: make `main_loop` return, which starts uvicorn's graceful shutdown."""
        if self.loop is not None and self.stopping is not None:
            with contextlib.suppress(RuntimeError):  # loop already closed
                self.loop.call_soon_threadsafe(self.stopping.set)


class ThreadedServer:
    """Serves `app()` on 127.0.0.1 (any free port by default) from `start()` until `stop()`."""

    #: uvicorn's WebSocket implementation ("none" unless the fake serves WebSockets).
    ws = "none"

    def __init__(self, port: int = 0, *, tls: TLSFiles | None = None) -> None:
        self._requested_port = port
        self.tls = tls
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._socket: socket.socket | None = None
        self._port: int | None = None

    def app(self) -> ASGIApp:
        """The ASGI application to serve (subclasses)."""
        raise NotImplementedError

    @property
    def port(self) -> int:
        """The TCP port the server listens on (only while started)."""
        if self._port is None:
            raise RuntimeError(f"{type(self).__name__} not started")
        return self._port

    @property
    def url(self) -> str:
        """The server root, e.g. `http://127.0.0.1:40123` (`https://` with TLS)."""
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    def start(self) -> Self:
        """Start serving in a background thread; returns once the port accepts connections."""
        if self._thread is not None:
            raise RuntimeError(f"{type(self).__name__} already started")
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # TCP_NODELAY, see agent-mcp.py
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", self._requested_port))
        except OSError:
            sock.close()
            raise
        tls = {"ssl_certfile": str(self.tls.cert), "ssl_keyfile": str(self.tls.key)} if self.tls else {}
        config = uvicorn.Config(
            self.app(),
            loop="asyncio",
            http="h11",
            ws=self.ws,
            lifespan="off",
            log_config=None,
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=2,
            **tls,
        )
        server = _Server(config)

        def run() -> None:
            try:
                server.run(sockets=[sock])
            finally:
                server.ready.set()  # never leave start() waiting, even if startup failed

        self._socket, self._server, self._port = sock, server, sock.getsockname()[1]
        self._thread = threading.Thread(target=run, name=f"{type(self).__name__}-server", daemon=True)
        self._thread.start()
        server.ready.wait()
        if not server.started:
            self.stop()
            raise RuntimeError(f"{type(self).__name__} failed to start")
        return self

    def stop(self) -> None:
        """Stop the server (ending held or hanging responses) and wait for its thread to finish."""
        if self._server is not None:
            self._server.request_stop()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self._socket is not None:
            self._socket.close()
        self._server = self._thread = self._socket = self._port = None

    def _stopping(self) -> asyncio.Event:
        """Set (on the server's loop) when the server starts shutting down."""
        assert self._server is not None and self._server.stopping is not None
        return self._server.stopping

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
