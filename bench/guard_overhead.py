#!/usr/bin/env python3
"""Time the HTTP guard adds to one request: the same small app called directly and through `guard.Guard`.

Pure ASGI in one process (no sockets, so nothing but the guard differs): a JSON `POST /submit`
with a bearer token and an allowed cross-site `Origin`, the case with the most checks (Host,
Origin, token, Content-Type, CORS headers on the answer). Both paths are interleaved round by
round; it prints the median per-request time of each and the difference.

    python bench/guard_overhead.py [--requests 20000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.types import ASGIApp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import guard

TOKEN = "x" * 43
HEADERS = [(b"host", b"127.0.0.1:8765"), (b"authorization", f"Bearer {TOKEN}".encode()),
           (b"content-type", b"application/json"), (b"content-length", b"2"), (b"origin", b"https://ui.example")]
SCOPE: dict[str, Any] = {
    "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
    "path": "/submit", "raw_path": b"/submit", "query_string": b"", "headers": HEADERS, "root_path": "",
    "server": ("127.0.0.1", 8765), "client": ("127.0.0.1", 50000),
}


async def _ok(request: Request) -> JSONResponse:
    return JSONResponse({"status": "OK"})


async def _receive() -> dict[str, Any]:
    return {"type": "http.request", "body": b"{}", "more_body": False}


async def _send(message: Any) -> None:
    if message["type"] == "http.response.start":
        assert message["status"] == 200, message


async def _per_request(app: ASGIApp, n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        await app(dict(SCOPE), _receive, _send)
    return (time.perf_counter() - start) / n


async def run(args: argparse.Namespace) -> None:
    app = Starlette(routes=[Route("/submit", _ok, methods=["POST"])])
    guarded = guard.Guard(app, plugin="bench", bind="127.0.0.1", port=8765, token=TOKEN,
                          allowed_origins=["https://ui.example"])
    times: dict[str, list[float]] = {"direct": [], "guarded": []}
    for _ in range(args.rounds):
        times["direct"].append(await _per_request(app, args.requests))
        times["guarded"].append(await _per_request(guarded, args.requests))
    direct, through = statistics.median(times["direct"]), statistics.median(times["guarded"])
    print(f"{args.requests} requests × {args.rounds} rounds: direct {direct * 1e6:.1f} µs, "
          f"guarded {through * 1e6:.1f} µs, the guard adds {(through - direct) * 1e6:.1f} µs per request")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=20_000)
    p.add_argument("--rounds", type=int, default=5)
    asyncio.run(run(p.parse_args()))


if __name__ == "__main__":
    main()
