#!/usr/bin/env python3
"""The floor under a turn: the same shell turn or proxied stream built from the libraries alone, against agent-mcp's.

A shell turn costs the server the libraries it is built from (uvicorn and Starlette for `POST /submit`,
sse_starlette for the event stream, the model call through LangChain and the OpenAI SDK, two aiosqlite
saves of the session) plus agent-mcp's own work around them (the guard, sessions and their lease, the
event hub, prompt, context fit, history cache, text-call filter, metrics, tracing). This starts, beside
agent-mcp, a server of a few dozen lines (`--serve`) that does only the first part: the same routes and
event stream, the same model object and call (`chat_openai.openai_chat_model`, `models._chunks`: the
fastest path agent-mcp has), two saves of a record of the same shape. With `--path proxy` it is a proxied
stream instead: `POST /v1/chat/completions` answered with Starlette's streaming response, against
agent-mcp's proxy plugin (sessions in memory, as `make bench-proxy` runs it). Both run on the same instant fake
OpenAI backend and are driven by the same client, in alternating blocks, pinned to the same core; it
prints each one's server CPU per turn and per token, and agent-mcp's own share:

    python bench/floor.py [--path shell|proxy] [--blocks 10] [--per-block 200] [--tokens 32]

What the floor does not do, agent-mcp cannot do for less: it is what a goal per turn is measured against.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import subprocess
import sys
import tempfile
import time
import timeit
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.turn_overhead import ServerPath, cpu_seconds  # noqa: E402


def serve(port: int, backend: str, db_path: str) -> None:
    """The floor server: POST /submit starts a turn, GET /stream sends its `tok` … `done` events."""
    import aiosqlite
    import openai
    import orjson
    import uvicorn
    from langchain_core.messages import HumanMessage, SystemMessage
    from sse_starlette import EventSourceResponse
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    from chat_openai import openai_chat_model
    from config import DEFAULTS_DIR
    from models import _chunks
    from prompt import PromptTree

    llm = openai_chat_model(model="fake-gpt", base_url=backend, api_key="k", streaming=True, max_retries=0,
                            stream_chunk_timeout=None, http_async_client=openai.DefaultAioHttpClient())
    system = SystemMessage(PromptTree(DEFAULTS_DIR / ".system_prompt").load().assemble())
    queues: dict[str, asyncio.Queue[tuple[str, bytes]]] = {}
    history: dict[str, list[dict[str, Any]]] = {}
    state: dict[str, Any] = {}

    async def save(client_id: str) -> None:
        record = orjson.dumps({"model": "fake", "history": history[client_id][-32:]})
        await state["db"].execute("INSERT OR REPLACE INTO sessions (client_id, record) VALUES (?, ?)",
                                  (client_id, record))

    async def turn(client_id: str, text: str) -> None:
        out = queues[client_id]
        history.setdefault(client_id, []).append({"role": "user", "content": text})
        await save(client_id)
        answer = []
        async for chunk in _chunks(llm, [system, HumanMessage(text)]):
            if chunk.content:
                answer.append(chunk.content)
                out.put_nowait(("tok", orjson.dumps({"text": chunk.content})))
        history[client_id].append({"role": "assistant", "content": "".join(answer)})
        await save(client_id)
        out.put_nowait(("done", b"{}"))

    async def submit(request: Request) -> JSONResponse:
        body = await request.json()
        task = asyncio.create_task(turn(body["client_id"], body["text"]))
        state.setdefault("tasks", set()).add(task)
        task.add_done_callback(state["tasks"].discard)
        return JSONResponse({"ok": True})

    async def stream(request: Request) -> EventSourceResponse:
        out = queues.setdefault(request.query_params["client_id"], asyncio.Queue())

        async def events() -> Any:
            while True:
                name, data = await out.get()
                yield {"event": name, "data": data.decode()}

        return EventSourceResponse(events(), ping=3600)

    async def completions(request: Request) -> StreamingResponse:
        body = await request.json()
        messages = [HumanMessage(m["content"]) for m in body["messages"]]

        async def chunks() -> Any:
            async for chunk in _chunks(llm, [system, *messages]):
                if chunk.content:
                    delta = {"index": 0, "delta": {"content": chunk.content}, "finish_reason": None}
                    yield b"data: " + orjson.dumps({"id": "c", "object": "chat.completion.chunk", "created": 0,
                                                    "model": body["model"], "choices": [delta]}) + b"\n\n"
            yield b"data: [DONE]\n\n"

        return StreamingResponse(chunks(), media_type="text/event-stream")

    async def main() -> None:
        state["db"] = await aiosqlite.connect(db_path, isolation_level=None)
        await state["db"].execute("PRAGMA journal_mode=WAL")
        await state["db"].execute("PRAGMA synchronous=NORMAL")
        await state["db"].execute("CREATE TABLE IF NOT EXISTS sessions (client_id TEXT PRIMARY KEY, record BLOB)")
        app = Starlette(routes=[Route("/submit", submit, methods=["POST"]), Route("/stream", stream),
                                Route("/v1/chat/completions", completions, methods=["POST"])])
        config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", loop="uvloop",
                                http="httptools")
        await uvicorn.Server(config).serve()

    import uvloop
    uvloop.run(main())


class Floor:
    """The floor server as a subprocess, like tests.conftest.AgentServer."""

    def __init__(self, backend: str, tmp: Path):
        from tests.conftest import free_port
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen([sys.executable, __file__, "--serve", str(port), "--backend", backend,
                                      "--db", str(tmp / "floor.sqlite3")], cwd=ROOT)

    def wait_ready(self) -> None:
        import httpx
        for _ in range(200):
            try:
                httpx.post(f"{self.url}/nothing", timeout=1)
                return
            except httpx.TransportError:
                time.sleep(0.05)
        raise RuntimeError("the floor server did not start")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


def pace() -> float:
    """The machine's speed, to compare runs of other hours or machines: seconds a fixed pure-Python loop takes."""
    return min(timeit.repeat("sum(range(100000))", number=10, repeat=20)) / 10


async def run(args: argparse.Namespace) -> None:
    from bench.proxy_overhead import Target, start_proxy
    from tests.conftest import AgentServer, ConfigDir, openai_model
    from tests.fakes.backend import tokens
    from tests.fakes.openai_backend import FakeOpenAI

    pinned = (os.cpu_count() or 1) >= 2
    if pinned:
        os.sched_setaffinity(0, {0})
    paces = [pace()]
    with FakeOpenAI(default_reply=lambda req: tokens(args.tokens)) as backend, \
            tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as servers:
        floor = Floor(backend.base_url, Path(tmp))
        servers.callback(floor.stop)
        if args.path == "shell":
            (Path(tmp) / "agent").mkdir()
            cfg = ConfigDir(Path(tmp) / "agent")
            cfg.models = {"fake": openai_model(backend, max_context=2)}
            cfg.env = {"SESSION_STORE": "sqlite"}
            agent = AgentServer(cfg.write()).start()
        else:
            agent, url = start_proxy(backend, Path(tmp))
        servers.callback(agent.stop)
        floor.wait_ready()
        pids = [floor.proc.pid, agent.proc.pid]  # type: ignore[union-attr]  # started: proc is set
        async with contextlib.AsyncExitStack() as clients_open:
            if args.path == "shell":
                paths = [ServerPath(floor.url, "x"), ServerPath(agent.url, agent.token)]
                for path in paths:
                    await path.open()
                    clients_open.push_async_callback(path.close)
                clients: list[Callable[[int], Awaitable[Any]]] = [path.turn for path in paths]
            else:
                targets = [Target("floor", f"{floor.url}/v1", "fake"), Target("agent-mcp", url, "agent-mcp:latest")]
                for target in targets:
                    clients_open.push_async_callback(target.client.close)
                clients = [lambda i, t=target: t.stream() for target in targets]  # type: ignore[misc]  # default binds each target
            cpu = [0.0, 0.0]
            for pid, client in zip(pids, clients, strict=True):
                if pinned:
                    os.sched_setaffinity(pid, {1})
                for i in range(args.warmup):
                    await client(i)
            for block in range(args.blocks):
                for i in (0, 1) if block % 2 == 0 else (1, 0):
                    before = cpu_seconds(pids[i])
                    for t in range(args.per_block):
                        await clients[i](block * args.per_block + t)
                    cpu[i] += cpu_seconds(pids[i]) - before
    paces.append(pace())
    n = args.blocks * args.per_block
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    unit = "turn" if args.path == "shell" else "stream"
    print(f"\n{args.path} path: {n} {unit}s per server, {args.blocks} alternating blocks, {args.tokens} tokens per "
          f"answer, {'servers pinned to core 1, client and fake to core 0' if pinned else 'no pinning (1 core)'}; "
          f"load average {load}; sum(range(100000)) took {paces[0] * 1e3:.2f} ms before the run, "
          f"{paces[1] * 1e3:.2f} after\n")
    print(f"| server | CPU per {unit} (ms) | per token averaged (µs) |")
    print("|---|---|---|")
    for name, used in zip(("floor (the libraries alone)", "agent-mcp"), cpu, strict=True):
        print(f"| {name} | {used / n * 1e3:.2f} | {used / n / args.tokens * 1e6:.0f} |")
    own = (cpu[1] - cpu[0]) / n
    print(f"\nagent-mcp's own work: {own * 1e3:.2f} ms per {unit} ({own / (cpu[1] / n) * 100:.0f}% of its CPU); "
          f"agent-mcp / floor: {cpu[1] / cpu[0]:.2f}×")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, default=10)
    p.add_argument("--per-block", type=int, default=200)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--path", choices=("shell", "proxy"), default="shell")
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    p.add_argument("--backend", help=argparse.SUPPRESS)
    p.add_argument("--db", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        serve(args.serve, args.backend, args.db)
    else:
        asyncio.run(run(args))


if __name__ == "__main__":
    main()
