"""Running a fake from its command line: SIGINT or SIGTERM stops it at any moment (starting, idle, serving a
stream), even when it was started with them ignored.

Why not Python's defaults: a process started as a background job of a non-interactive shell inherits SIGINT
*ignored*, and Python then never turns it into KeyboardInterrupt (the fake backend ignored `.ci/run`'s SIGINT
that way); SIGTERM kills without stopping the server; and a stdio server's thread blocked reading its
input keeps the interpreter from exiting after a KeyboardInterrupt. Here the signals get a handler of
their own, and the C-level handler writes to a pipe the main thread reads (`signal.set_wakeup_fd`): no
Python code runs in a signal handler, so one that comes mid-start is kept until `wait()`, not lost or raised
inside whatever start-up was doing.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import Self

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
#: What `wait()` returns when the server ended by itself (`ended()`), not by a signal.
ENDED = 0


def _noted(signum: int, frame: FrameType | None) -> None:
    """The Python-level handler: nothing; the signal's number is already in the wakeup pipe."""


class StopSignals:
    """From `__enter__` on, SIGINT and SIGTERM are noted, not acted on; `wait()` returns the first one."""

    def __init__(self) -> None:
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)  # set_wakeup_fd needs it
        self._previous: dict[int, object] = {}
        self._previous_fd = -1

    def __enter__(self) -> Self:
        self._previous_fd = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        for signum in STOP_SIGNALS:
            self._previous[signum] = signal.signal(signum, _noted)
        return self

    def __exit__(self, *exc_info: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]  # whatever signal.signal returned before
        signal.set_wakeup_fd(self._previous_fd)
        os.close(self._read)
        os.close(self._write)

    def wait(self) -> int:
        """Block until a stop signal (its number) or `ended()` (`ENDED`); one that came earlier returns at once."""
        return os.read(self._read, 1)[0]

    def ended(self) -> None:
        """Thread-safe: the server stopped by itself (its input ended, it could not start): `wait()` returns."""
        os.write(self._write, bytes([ENDED]))


def serve_in_thread(serve: Callable[[], None], name: str) -> int:
    """Run the blocking `serve()` in a daemon thread until it returns (exit status 0) or a stop signal comes;
    then end the process at once, without waiting for threads `serve` left blocked (a stdio server's reader)."""
    with StopSignals() as stop:
        def run() -> None:
            try:
                serve()
            finally:
                stop.ended()

        threading.Thread(target=run, name=name, daemon=True).start()
        why = stop.wait()
    if why == ENDED:
        return 0
    with contextlib.suppress(OSError, ValueError):  # the client may have closed the pipe
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(0)  # a stdio server has nothing to finish: its client is gone or is stopping it
