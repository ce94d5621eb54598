#!/usr/bin/env python3
"""A real local model through the whole agent: does every turn end with an answer that uses the tools?

agent-mcp runs as a subprocess with three llm-models.json entries that all point at one
OpenAI-compatible server (`--base-url`, default the shared local model of
`../shared/local-model/`, served on 127.0.0.1:8081): `qwen-native` (native tool calling, which
small models answer with JSON text), `qwen-router` (`router: true`, seed 004's yes/no step) and
`qwen-text` (`tool_mode: "text"`, the seed 004 `<tool_code>` protocol). All three have
`tool_call_available: false` (no delegation to them). Between agent-mcp and the model sits a
recording pass-through: it counts the model calls of each task and reads their prompt sizes from the
server's `usage`. The tasks go through shell.py's endpoint (/submit, the SSE /stream, /gate_response);
the bench answers the one gate itself.

Per task: answered (a `done` with text, no `error`), used the tool's result (facts of the tool's actual
output, read from the turn's `[tool ◀]` status lines, appear in the answer), rounds (model calls of
the tool loop), model calls (with the router step and the final call without tools), prompt tokens
(summed over the calls, as the server counts them) and seconds. One run per invocation; a real model
is slow and not deterministic, so the numbers are one sample.

    python bench/local_model.py [--base-url http://127.0.0.1:8081/v1] [--label 0.5B] [--only time,greeting]
                                [--temperature 0.2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from shell_client import ShellClient  # noqa: E402
from tests.conftest import AgentServer, ConfigDir, one_tool_plugin  # noqa: E402
from tests.fakes.server import ThreadedServer  # noqa: E402

DEFAULT_BASE_URL = "http://127.0.0.1:8081/v1"  # ../shared/local-model/setup.sh prints `serve.py ... --port 8081`
ORDER = "Order 4711: 3 boxes of green tea, shipped on 2026-11-20 by DHL, tracking number JD014600."
BACKUPS = "The nightly backup runs from 02:30 to 03:15 UTC and keeps 14 copies."
FILLER_LINE = "2026-11-26 09:{m:02d}:{s:02d} INFO worker-{w} processed batch {b} in {ms} ms (queue depth {q})\n"


# ── The recording pass-through ─────────────────────────────────────────────────────────────


@dataclass
class Call:
    """One model call agent-mcp made: what kind, and the prompt size the server reported."""

    kind: str  # router | round | final
    prompt_tokens: int = 0
    reply: str = ""  # the text and tool calls the model sent (for --verbose)


def _kind(body: dict[str, Any]) -> str:
    messages = body.get("messages") or []
    first = str(messages[0].get("content", "")) if messages else ""
    last = str(messages[-1].get("content", "")) if messages else ""
    if first.startswith("You are a router."):
        return "router"
    return "final" if "No more tools can be called now." in last else "round"


class Recorder(ThreadedServer):
    """Forwards every request to `upstream` unchanged (streams too) and records the chat calls."""

    def __init__(self, upstream: str) -> None:
        super().__init__()
        self.upstream = upstream.rstrip("/")
        self.root = re.sub(r"/v1$", "", self.upstream)
        self.calls: list[Call] = []
        self.lock = threading.Lock()

    def app(self) -> Starlette:
        return Starlette(routes=[Route("/v1/chat/completions", self._chat, methods=["POST"]),
                                 Route("/{path:path}", self._other, methods=["GET"])])

    async def _other(self, request: Request) -> Response:
        async with httpx.AsyncClient(timeout=30) as http:
            answer = await http.get(f"{self.root}/{request.path_params['path']}")
        return Response(answer.content, answer.status_code, media_type=answer.headers.get("content-type"))

    async def _chat(self, request: Request) -> Response:
        body = json.loads(await request.body())
        call = Call(_kind(body))
        with self.lock:
            self.calls.append(call)
        if body.get("stream"):
            body["stream_options"] = {"include_usage": True}
        http = httpx.AsyncClient(timeout=httpx.Timeout(30, read=None))
        upstream = await http.send(http.build_request("POST", f"{self.upstream}/chat/completions", json=body),
                                   stream=True)
        if not body.get("stream") or upstream.status_code != 200:
            content = await upstream.aread()
            await upstream.aclose()
            await http.aclose()
            if upstream.status_code == 200:
                call.prompt_tokens = int(json.loads(content).get("usage", {}).get("prompt_tokens", 0))
            return Response(content, upstream.status_code, media_type=upstream.headers.get("content-type"))

        async def relay():
            try:
                async for line in upstream.aiter_lines():
                    if line.startswith("data: {"):
                        chunk = json.loads(line[6:])
                        usage = chunk.get("usage") or {}
                        call.prompt_tokens = int(usage.get("prompt_tokens") or call.prompt_tokens)
                        for choice in chunk.get("choices") or []:
                            delta = choice.get("delta") or {}
                            call.reply += (delta.get("content") or "") + "".join(
                                json.dumps(t.get("function", {})) for t in delta.get("tool_calls") or [])
                    yield line + "\n"
            finally:
                await upstream.aclose()
                await http.aclose()

        return StreamingResponse(relay(), media_type="text/event-stream")


# ── Tasks ──────────────────────────────────────────────────────────────────────────────────


def _time_facts(outputs: dict[str, str]) -> list[str]:
    found = re.search(r"Local time: \S+ (\d\d):(\d\d)", outputs.get("get_system_info", ""))
    return [f"{found[1]}:{found[2]}"] if found else []


def _host_facts(outputs: dict[str, str]) -> list[str]:
    found = re.search(r"Host: (\S+)", outputs.get("get_system_info", ""))
    return [found[1]] if found else []


def _model_facts(outputs: dict[str, str]) -> list[str]:
    return re.findall(r"^- (qwen-\w+)", outputs.get("llm_list", ""), re.MULTILINE)


def _uses(facts: Callable[[dict[str, str]], list[str]], need: int = 1) -> Callable[[dict[str, str], str], bool]:
    """A check: at least `need` facts of the tool's actual output appear in the answer (case-insensitive)."""
    def check(outputs: dict[str, str], answer: str) -> bool:
        found = facts(outputs)
        return len(found) >= need and sum(f.lower() in answer.lower() for f in set(found)) >= need
    return check


def _both(outputs: dict[str, str], answer: str) -> bool:
    return _uses(_time_facts)(outputs, answer) and _uses(_model_facts)(outputs, answer)


def _order(outputs: dict[str, str], answer: str) -> bool:
    return "lookup_order" in outputs and ("dhl" in answer.lower() or "jd014600" in answer.lower())


def _backups(outputs: dict[str, str], answer: str) -> bool:
    return BACKUPS in outputs.get("read_system_prompt", "") and "02:30" in answer


@dataclass
class Task:
    """One question on one model entry; `check` is None when no tool is needed (then `expect` is the answer)."""

    name: str
    model: str
    question: str
    check: Callable[[dict[str, str], str], bool] | None
    expect: str = ""
    before: list[str] = field(default_factory=list)  # earlier turns of the same session


def _filler(tokens: int) -> str:
    """A log excerpt of about `tokens` tokens (about 30 tokens a line)."""
    lines = [FILLER_LINE.format(m=i // 60 % 60, s=i % 60, w=i % 7, b=1000 + i, ms=40 + i % 90, q=i % 13)
             for i in range(tokens // 30)]
    return "".join(lines)


def tasks(window: int) -> list[Task]:
    """The fixed task set: 12 that need a tool, 2 that do not."""
    time_q = "What time is it on the server? Call the get_system_info tool."
    long_history = [f"Here is a log excerpt:\n{_filler(int(window * 0.45))}\nHow many workers appear in it? "
                    "Answer in one short sentence."]
    return [
        Task("time", "qwen-native", time_q, _uses(_time_facts)),
        Task("host", "qwen-native", "What is the host name of the machine you are running on?", _uses(_host_facts)),
        Task("prompt-section", "qwen-native",
             "What does the 'backups' section of your system prompt say? Read it with read_system_prompt.", _backups),
        Task("models-call", "qwen-native", "Call llm_list and tell me which models are configured.",
             _uses(_model_facts, 2)),
        Task("models-no-call-word", "qwen-native", "Which language models can I switch to on this server?",
             _uses(_model_facts, 2)),
        Task("two-tools", "qwen-native", "First call get_system_info, then call llm_list. Then tell me the "
                                         "server's time and the names of the configured models.", _both),
        Task("gated-tool", "qwen-native", "Look up order 4711 with the lookup_order tool: how was it shipped?",
             _order),
        Task("arithmetic", "qwen-native", "What is 17 times 23? Answer with the number.", None, expect="391"),
        Task("router-time", "qwen-router", time_q, _uses(_time_facts)),
        Task("router-models", "qwen-router", "Which language models are configured here? Use llm_list.",
             _uses(_model_facts, 2)),
        Task("text-mode-time", "qwen-text", time_q, _uses(_time_facts)),
        Task("text-mode-models", "qwen-text", "Call llm_list and tell me which models are configured.",
             _uses(_model_facts, 2)),
        Task("greeting", "qwen-router", "Hello! How are you today?", None),
        # Last: its long prompt takes the longest.
        Task("long-history", "qwen-native", time_q, _uses(_time_facts), before=long_history),
    ]


# ── Running ────────────────────────────────────────────────────────────────────────────────


@dataclass
class Result:
    task: Task
    answered: bool
    used: bool | None  # None: no tool needed
    tools_called: list[str]
    rounds: int
    model_calls: int
    prompt_tokens: int
    seconds: float
    answer: str
    notes: list[str]
    calls: list[Call]


async def one_turn(shell: ShellClient, text: str, model: str, limit: float
                   ) -> tuple[str, str, dict[str, str], list[str], list[str]]:
    """(answer, error, tool outputs by tool, tools called, status lines) of one turn; gates are allowed."""
    await shell.submit(text, default_model=model)
    answer, error, outputs, called, statuses = [], "", {}, [], []
    async with asyncio.timeout(limit):
        async for ev in shell.events():
            if ev.name == "tok":
                answer.append(ev.data.get("text", ""))
            elif ev.name == "status":
                line = ev.data.get("text", "")
                statuses.append(line)
                done = re.match(r"\[(\w+) ◀\] (.*)", line, re.DOTALL)
                if done:
                    outputs[done[1]] = outputs.get(done[1], "") + done[2]
                    called.append(done[1])
            elif ev.name == "gate":
                await shell.gate_response(ev.data["gate_id"], "allow")
            elif ev.name == "error":
                error = ev.data.get("message", "error")
            elif ev.name == "done":
                break
    return "".join(answer).strip(), error, outputs, called, statuses


async def run_task(server: AgentServer, recorder: Recorder, task: Task, limit: float) -> Result:
    async with ShellClient(server.url, f"bench-{task.name}-{uuid.uuid4().hex[:6]}", token=server.token,
                           read_timeout=limit) as shell:
        await shell.connect()
        for text in task.before:
            await one_turn(shell, text, task.model, limit)
        first = len(recorder.calls)
        start = time.perf_counter()
        answer, error, outputs, called, statuses = await one_turn(shell, task.question, task.model, limit)
        seconds = time.perf_counter() - start
    calls = recorder.calls[first:]
    answered = bool(answer) and not error
    if task.check is None:
        used = None
    else:
        used = answered and task.check(outputs, answer)
    notes = [s for s in statuses if s.startswith(("[final answer]", "[tools]", "[context]"))]
    notes += [f"error: {error}"] if error else []
    return Result(task, answered, used, called, sum(c.kind == "round" for c in calls), len(calls),
                  sum(c.prompt_tokens for c in calls), seconds, answer, notes, calls)


def configure(cfg: ConfigDir, host: str, model_id: str, timeout: float, temperature: float | None = None) -> None:
    """Three model entries on one server, a short system prompt with a `backups` section, one gated tool."""
    base = {"model_id": model_id, "type": "OPENAI", "host": host, "env_key": None, "max_retries": 0,
            "llm_call_timeout": timeout, "tool_call_available": False, "max_context": 50,
            **({"temperature": temperature} if temperature is not None else {}),
            "llm_tools": ["get_system_info", "read_system_prompt", "llm_list", "lookup_order"]}
    cfg.models = {
        "qwen-native": {**base, "description": "native tool calling"},
        "qwen-router": {**base, "router": True, "description": "router step first (seed 004)"},
        "qwen-text": {**base, "tool_mode": "text", "description": "tools described in the prompt (seed 004)"},
    }
    cfg.add_plugin("plugin_bench_orders", one_tool_plugin(
        "plugin_bench_orders", "lookup_order", "order_id", repr(ORDER), {"type": "orders", "operation": "read"},
        "Look up an order by its number: contents, shipping date, carrier and tracking number."))
    prompt = cfg.path / ".system_prompt"
    prompt.mkdir()
    (prompt / ".system_prompt").write_text(
        "You are agent-mcp, a helpful assistant on a server. Use a tool when the question needs one; "
        "answer briefly.\n[SECTIONS]\nbackups: when and how the server is backed up\n")
    (prompt / ".system_prompt_backups").write_text(BACKUPS + "\n")


def _row(r: Result) -> str:
    used = "-" if r.used is None else ("yes" if r.used else "no")
    return (f"| {r.task.name} | {r.task.model} | {'yes' if r.answered else 'no'} | {used} | "
            f"{', '.join(dict.fromkeys(r.tools_called)) or '-'} | {r.rounds} | {r.model_calls} | "
            f"{r.prompt_tokens:,} | {r.seconds:.0f} |")


async def run(args: argparse.Namespace) -> int:
    try:
        async with httpx.AsyncClient(timeout=3) as http:
            listed = (await http.get(f"{args.base_url.rstrip('/')}/models")).json()
            root = re.sub(r"/v1/?$", "", args.base_url.rstrip("/"))
            props = await http.get(f"{root}/props")
    except (httpx.HTTPError, ValueError) as exc:
        print(f"bench-local skipped: nothing answers at {args.base_url} ({type(exc).__name__}). Start a model "
              "first, e.g. ../shared/local-model/setup.sh 0.5b and the serve.py command it prints, or pass "
              "--base-url of any OpenAI-compatible server.")
        return 0
    model_id = args.model_id or (listed.get("data") or [{}])[0].get("id", "local")
    window = 4096
    if props.status_code == 200:
        window = int(props.json().get("default_generation_settings", {}).get("n_ctx") or window)
    chosen = [t for t in tasks(window) if not args.only or t.name in args.only.split(",")]
    print(f"bench-local: {len(chosen)} tasks on {model_id} at {args.base_url} (context window {window:,} tokens)"
          f"{' [' + args.label + ']' if args.label else ''}; temperature "
          f"{args.temperature if args.temperature is not None else 'the server default'}; one run\n", flush=True)
    results = []
    with Recorder(args.base_url) as recorder, tempfile.TemporaryDirectory() as tmp:
        cfg = ConfigDir(Path(tmp))
        configure(cfg, recorder.url + "/v1", model_id, args.call_timeout, args.temperature)
        server = AgentServer(cfg.write(), {"SESSION_STORE": "memory"}).start(wait=False)
        try:
            server.wait_ready(timeout=300)  # a loaded machine starts slowly
            for task in chosen:
                result = await run_task(server, recorder, task, args.call_timeout * 6)
                results.append(result)
                print(_row(result), flush=True)
                if args.verbose:
                    print(f"    answer: {result.answer[:300]!r}\n    notes: {result.notes}", flush=True)
                    for call in result.calls:
                        print(f"    {call.kind}: {call.reply[:300]!r}", flush=True)
        finally:
            server.stop()
    print("\n| task | model entry | answered | used the tool's result | tools run | rounds | model calls | "
          "prompt tokens | seconds |\n|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(_row(r))
    tool_tasks = [r for r in results if r.used is not None]
    plain = [r for r in results if r.used is None]
    print(f"\nanswered: {sum(r.answered for r in results)} of {len(results)}; tool results used: "
          f"{sum(bool(r.used) for r in tool_tasks)} of {len(tool_tasks)}; no-tool tasks answered without a tool: "
          f"{sum(r.answered and not r.tools_called for r in plain)} of {len(plain)}"
          + "".join(f"; {r.task.name} correct: {'yes' if r.task.expect in r.answer else 'no'}"
                    for r in plain if r.task.expect)
          + f"; final calls without tools: {sum(any(n.startswith('[final answer]') for n in r.notes) for r in results)}"
          + f"; total {sum(r.seconds for r in results):.0f} s")
    for r in results:
        for note in r.notes:
            print(f"  {r.task.name}: {note}")
    return 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default=DEFAULT_BASE_URL, help=f"OpenAI-compatible base URL ({DEFAULT_BASE_URL})")
    p.add_argument("--model-id", default="", help="model name to request (default: the server's first model)")
    p.add_argument("--label", default="", help="a name for this run in the output (e.g. 0.5B)")
    p.add_argument("--only", default="", help="comma-separated task names")
    p.add_argument("--call-timeout", type=float, default=300, help="llm_call_timeout of the entries (s)")
    p.add_argument("--temperature", type=float, default=None,
                   help="the entries' temperature (default: none sent, the server's default)")
    p.add_argument("--verbose", action="store_true", help="print each answer and the loop's notes")
    raise SystemExit(asyncio.run(run(p.parse_args())))


if __name__ == "__main__":
    main()
