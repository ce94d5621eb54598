"""Every request fits the model's context window, in tokens (budget.py).

Unit tests of the fit on synthetic history, window discovery against fake llama.cpp and Ollama
endpoints, and whole turns through ChatOpenAI against a fake backend that behaves like llama.cpp's
server with a small `n_ctx`: it counts each prompt with a real tokenizer (tiktoken) and answers
HTTP 400 when one is too long.
"""

from __future__ import annotations

import gc
import json
import weakref
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

import agents
import budget
from config import DEFAULTS_DIR, ModelConfig
from models import HistoryCache, to_lc_messages
from tests.conftest import ROOT, free_port, openai_model
from tests.fakes.backend import text, tool_call
from tests.fakes.openai_backend import FakeOpenAI
from tests.fakes.server import ThreadedServer
from tests.runtime import ALL_OPEN, add_plugin_tools, runtime, turn

estimate, _ = budget.counter_for(ModelConfig(model_id="qwen2.5:7b", type="OPENAI"))
exact, exact_name = budget.counter_for(ModelConfig(model_id="gpt-4o", type="OPENAI"))


def conversation(turns: int, words: int = 40, tool_every: int = 0) -> list[dict[str, Any]]:
    """`turns` turns of user + answer; every `tool_every`-th turn calls a tool in between."""
    history: list[dict[str, Any]] = []
    for i in range(turns):
        history.append({"role": "user", "content": f"question {i}: " + "lorem ipsum " * words})
        if tool_every and i % tool_every == 0:
            history.append({"role": "assistant", "content": "", "tool_calls": [{"id": f"c{i}", "name": "t",
                                                                                "args": {"q": i}}]})
            history.append({"role": "tool", "tool_call_id": f"c{i}", "name": "t", "content": f"result {i} " * words})
        history.append({"role": "assistant", "content": f"answer {i}: " + "dolor sit " * words})
    return history


def assert_pairs_whole(messages: list[dict[str, Any]]) -> None:
    """Every tool result follows the assistant message that called it; the first message is a user's."""
    called: set[str] = set()
    for msg in messages:
        for call in msg.get("tool_calls") or ():
            called.add(call.get("id"))
        if msg.get("role") == "tool":
            assert msg["tool_call_id"] in called, msg


# ── The fit ─────────────────────────────────────────────────────────────────────────────────


def test_older_turns_go_whole_and_tool_pairs_stay_together() -> None:
    history = conversation(40, tool_every=3)
    fitted = budget.fit(history, fixed_tokens=1500, window=4096, answer_share=0.25, count=estimate)
    kept = fitted.history
    assert kept == history[len(history) - len(kept):]  # the newest messages, unchanged
    assert kept[0]["role"] == "user" and fitted.dropped_turns > 20
    assert_pairs_whole(kept)
    assert fitted.prompt_tokens <= 4096 * 0.75
    assert fitted.note() == (f"[context] {fitted.dropped_turns} older turns left out to fit the model's 4,096-token "
                             "window (the stored history is unchanged)")
    roomy = budget.fit(history, fixed_tokens=1500, window=200_000, answer_share=0.25, count=estimate)
    assert roomy.history == history and roomy.note() is None


def test_an_over_long_tool_result_is_cut_with_a_marker() -> None:
    history = conversation(2, tool_every=1)
    history[-2] = {**history[-2], "content": "x" * 60_000}  # the newest turn's tool result
    fitted = budget.fit(history, fixed_tokens=1500, window=4096, answer_share=0.25, count=estimate)
    (result,) = [m for m in fitted.history if m["role"] == "tool"][-1:]
    assert result["content"].endswith("characters cut to fit the model's context window]")
    assert "of 60,000 characters cut" in result["content"] and history[-2]["content"] == "x" * 60_000
    assert fitted.prompt_tokens <= 4096 * 0.75 and fitted.cut_results and "1 tool result cut" in fitted.note()
    assert_pairs_whole(fitted.history)


def test_what_cannot_fit_is_refused_with_what_to_do() -> None:
    with pytest.raises(budget.DoesNotFit, match="system prompt and tool schemas alone take 5,000 tokens"):
        budget.fit(conversation(1), fixed_tokens=5000, window=4096, answer_share=0.25, count=estimate)
    huge = [{"role": "user", "content": "word " * 20_000}]
    with pytest.raises(budget.DoesNotFit, match="Send a shorter message, or raise context_tokens"):
        budget.fit(huge, fixed_tokens=1500, window=4096, answer_share=0.25, count=estimate)


def test_the_history_cache_follows_edits_and_trims() -> None:
    """Each message is converted and counted once across turns; an edited message again, a dropped one is let go."""
    history = conversation(30, tool_every=3)
    cache = HistoryCache()
    first = cache.messages(history)
    measure = cache.tokens(estimate)
    assert [measure(m) for m in history] == [budget.message_tokens(m, estimate) for m in history]
    assert all(a is b for a, b in zip(cache.messages(history), first, strict=True))  # the same objects again
    assert budget.fit(history, 1500, 4096, 0.25, estimate, measure=measure) == budget.fit(history, 1500, 4096, 0.25,
                                                                                          estimate)
    history[0]["content"] = "short"  # edited in place, the value replaced (as SessionManager's cut of a long text)
    history[1]["tool_calls"] = [{"id": "c0", "name": "t", "args": {"q": 9}}]
    history[3] = {**history[3], "content": "a new answer"}
    edited = cache.messages(history)
    assert edited == to_lc_messages(history) and edited[2] is first[2] and edited[4] is first[4]
    assert (edited[0].content, edited[1].tool_calls[0]["args"], edited[3].content) == ("short", {"q": 9},
                                                                                       "a new answer")
    assert [measure(m) for m in history[:4]] == [budget.message_tokens(m, estimate) for m in history[:4]]
    assert cache.tokens(exact)(history[3]) == budget.message_tokens(history[3], exact)  # another model's counter
    gone = weakref.ref(first[4])
    del first, edited
    history[:] = history[-6:]  # trimmed
    assert cache.messages(history) == to_lc_messages(history)
    gc.collect()
    assert gone() is None  # the cache no longer holds what left the history


async def test_a_turn_converts_only_the_messages_new_since_the_last(tmp_path: Path) -> None:
    with FakeOpenAI() as backend:
        async with runtime(tmp_path, {"small": openai_model(backend)}) as rt:
            await turn(rt, "first question")
            history = rt.sessions.get("c1").history
            kept = rt.agent.histories["c1"].messages(history)
            await turn(rt, "second question")
            again = rt.agent.histories["c1"].messages(history[:len(kept)])
            sent = backend.requests[-1].json["messages"]
    assert all(a is b for a, b in zip(again, kept, strict=True)) and len(kept) == 2
    assert [m["content"] for m in sent[1:]] == ["first question", "echo: first question", "second question"]


def test_only_the_most_recently_active_sessions_keep_their_history_cache() -> None:
    caches: OrderedDict[str, HistoryCache] = OrderedDict()
    first = agents.history_cache(caches, "s0")
    for i in range(1, agents.MAX_HISTORY_CACHES):
        agents.history_cache(caches, f"s{i}")
    assert agents.history_cache(caches, "s0") is first  # used again: the most recent now
    agents.history_cache(caches, "newcomer")
    assert len(caches) == agents.MAX_HISTORY_CACHES and "s1" not in caches and caches["s0"] is first


@pytest.mark.parametrize(("status", "message", "overflow"), [
    (400, "the request exceeds the available context size, try increasing it", True),  # llama.cpp
    (400, "This model's maximum context length is 8192 tokens. However, your messages resulted in 9000 tokens", True),
    (500, "input length 5000 exceeds context length 4096", True),  # Ollama's runner
    (400, "invalid model name", False),
    (429, "context window rate limit", False),
    (None, "context exceeded", False),
])
def test_overflow_errors_are_told_apart(status: int | None, message: str, overflow: bool) -> None:
    assert budget.is_overflow(status, message) is overflow


def test_the_estimate_is_a_real_tokenizers_count_with_a_margin() -> None:
    samples = {
        "README": (ROOT / "README.md").read_text()[:20_000],
        "code": (ROOT / "agents.py").read_text()[:20_000],
        "JSON": json.dumps(json.loads((DEFAULTS_DIR / "llm-models.json").read_text())),
        "CJK": "人工智能代理服务器可以同时服务多个客户端。" * 50,
        "digits": " ".join(str(i * 7919) for i in range(2000)),
        "emoji": "🙂👍🏽🚀 " * 300,
        "base64": "q83vEjRWeJq8dE5FXk1hY2hpbmUgbGVhcm5pbmcgaXMgZnVuIQ==" * 200,
    }
    for name, sample in samples.items():
        assert estimate(sample) >= exact(sample), name
        assert estimate(sample) <= 1.2 * exact(sample) + len([c for c in sample if c.isdigit()]) + 1, name
    assert exact_name == "tiktoken cl100k_base" and exact("hello world") == 2


# ── The window ──────────────────────────────────────────────────────────────────────────────


class FakeOllama(ThreadedServer):
    """Ollama's `POST /api/show` only, with or without `num_ctx` in the model's parameters."""

    def __init__(self, num_ctx: int | None, context_length: int = 32768) -> None:
        super().__init__()
        self.num_ctx, self.context_length = num_ctx, context_length

    def app(self) -> Starlette:
        async def show(request: Request) -> JSONResponse:
            body = await request.json()
            parameters = f"num_ctx                        {self.num_ctx}\nstop \"<|im_end|>\"" if self.num_ctx else ""
            return JSONResponse({"parameters": parameters, "details": {"family": "qwen2"}, "model_info": {
                "general.architecture": "qwen2", "qwen2.context_length": self.context_length,
                "general.name": body["model"]}})

        return Starlette(routes=[Route("/api/show", show, methods=["POST"])])


async def test_the_window_comes_from_the_setting_the_backend_or_a_default() -> None:
    def model(host: str | None, **extra: Any) -> ModelConfig:
        return ModelConfig(model_id="qwen2.5:7b", type="OPENAI", host=host, **extra)

    with FakeOpenAI(context_limit=5000) as llama, FakeOllama(8192) as tuned, FakeOllama(None, 2048) as small, \
            FakeOllama(None) as big:
        assert await budget.discover_window(model(llama.base_url, context_tokens=9000)) == (9000, "llm-models.json")
        assert await budget.discover_window(model(llama.base_url)) == (5000, "the llama.cpp server (/props)")
        assert await budget.discover_window(model(tuned.url + "/v1")) == (8192, "Ollama (the model's num_ctx)")
        assert (await budget.discover_window(model(small.url + "/v1")))[0] == 2048  # its trained window is smaller
        window, source = await budget.discover_window(model(big.url + "/v1"))
        assert window == 4096 and source.startswith("Ollama's default num_ctx")
    nobody = f"http://127.0.0.1:{free_port()}/v1"
    assert await budget.discover_window(model(nobody)) == (4096, "default for a local server that does not say "
                                                                 "(set context_tokens)")
    # A hosted API is never asked (nothing but model calls goes there).
    assert (await budget.discover_window(model("https://api.openai.com/v1")))[0] == 128_000
    assert (await budget.discover_window(ModelConfig(model_id="gemini-2.5", type="GEMINI")))[0] == 1_048_576


# ── Whole turns against a backend with a small window ──────────────────────────────────────


class _Query(BaseModel):
    q: str


def _requests_ok(backend: FakeOpenAI, limit: int) -> None:
    """Every request the backend got fit its window, started with the system prompt, kept tool pairs."""
    assert backend.prompt_sizes and max(backend.prompt_sizes) <= limit, backend.prompt_sizes
    for request in backend.requests:
        messages = request.json["messages"]
        assert messages[0]["role"] == "system" and messages[0]["content"].startswith("You are agent-mcp")
        assert_pairs_whole(messages[1:])


async def test_a_long_conversation_with_tool_rounds_always_fits(tmp_path: Path) -> None:
    with FakeOpenAI(context_limit=4096) as backend:
        async with runtime(tmp_path, {"small": openai_model(backend)}, gates=ALL_OPEN) as rt:
            add_plugin_tools(rt, "plugin_test", [_long_result_tool()], {"lookup": {"type": "search"}})
            notes = []
            for i in range(12):
                if i % 3 == 0:
                    backend.script(tool_call("lookup", {"q": str(i)}), text(f"answer {i}"))
                answer, events = await turn(rt, f"question {i}: " + "please consider this carefully " * 40)
                notes += [e.data["text"] for e in events if e.name == "status" and "[context]" in e.data["text"]]
                assert "answer" in answer or "echo" in answer
            assert len(rt.sessions.get("c1").history) == 12 * 2 + 4 * 2  # nothing lost
    _requests_ok(backend, 4096)
    assert all(size < 4096 for size in backend.prompt_sizes) and len(backend.prompt_sizes) == 16
    assert any("older turns left out" in n for n in notes) and any("tool result" in n for n in notes)
    assert any("characters cut to fit" in json.dumps(r.json) for r in backend.requests)


def _long_result_tool() -> Any:
    from langchain_core.tools import StructuredTool

    async def lookup(q: str) -> str:
        return f"row {q}: " + "a long result line with many words in it\n" * 2000

    return StructuredTool.from_function(coroutine=lookup, name="lookup", description="Look things up.",
                                        args_schema=_Query)


async def test_a_backend_that_still_says_too_long_gets_one_shorter_retry(tmp_path: Path) -> None:
    # The setting claims 8,192 tokens; the server really has 4,096: the first request is refused.
    with FakeOpenAI(context_limit=4096) as backend:
        async with runtime(tmp_path, {"small": openai_model(backend, context_tokens=8192)}) as rt:
            for i in range(14):
                await turn(rt, f"question {i}: " + "tell me more about this " * 40)
            before = len(backend.requests)
            answer, events = await turn(rt, "and now?")
            session_history = rt.sessions.get("c1").history
    assert answer == "echo: and now?"
    statuses = [e.data["text"] for e in events if e.name == "status"]
    assert any("exceeds its context window: sending it again with less history" in s for s in statuses)
    assert backend.prompt_sizes[-2] > 4096 >= backend.prompt_sizes[-1] and len(backend.requests) == before + 2
    assert len(session_history) == 30  # the stored history is unchanged by the retry


async def test_model_shows_the_window_and_the_next_request_size(tmp_path: Path) -> None:
    with FakeOpenAI(context_limit=6000) as backend:
        async with runtime(tmp_path, {"small": openai_model(backend)}) as rt:
            await turn(rt, "hello")
            shown, _ = await turn(rt, "!model")
            listed = await rt.tools.get("llm_list").coroutine()
    assert "Context of 'small': 6,000-token window (the llama.cpp server (/props)), 25% kept for the answer" in shown
    assert "the next request is about" in shown and "counted by estimate (cl100k_base × 1.2 + 0.7 per digit)" in shown
    assert "window 6,000 tokens (the llama.cpp server (/props))" in listed


async def test_the_tokenizer_loads_off_the_event_loop_once(monkeypatch) -> None:
    """Building cl100k_base takes ~0.2 s: the first turn loads it in a worker thread, later turns do not hop."""
    import functools
    import threading

    threads: list[int] = []

    @functools.cache
    def loader() -> object:
        threads.append(threading.get_ident())
        return object()

    monkeypatch.setattr(budget, "_cl100k", loader)
    await budget.load_tokenizer()
    await budget.load_tokenizer()
    assert len(threads) == 1 and threads[0] != threading.get_ident()
