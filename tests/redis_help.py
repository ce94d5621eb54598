"""A redis-server of a test's own on a free port, to stop and start under a running instance (the
machine's Redis, with a key prefix per test, is the `redis_store` fixture of conftest.py)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import redis

from tests import needs
from tests.conftest import free_port
from tests.waiting import succeeds, within_sync


class OwnRedis:
    """A redis-server of the test's own on a free port, persisting to its directory (stop and start keep data)."""

    def __init__(self, path: Path):
        self.path = path
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> OwnRedis:
        binary = needs.program("redis-server", "redis", "redis-server")
        self.proc = subprocess.Popen([binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.path),
                                      "--appendonly", "yes", "--save", "", "--daemonize", "no"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, socket_connect_timeout=1)
        if not within_sync(lambda: succeeds(client.ping, redis.exceptions.ConnectionError), 10):
            client.ping()  # still refused: raise its error
        client.close()
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()  # SIGTERM: redis-server writes its append-only file and exits
            self.proc.wait(10)
        self.proc = None
