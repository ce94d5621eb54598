#!/usr/bin/env python3
"""What fitting a request into the context window costs per turn, and how many tokens a request holds.

A runtime with the core tools (no network: the fake OpenAI backend says its window, 8,192 tokens),
its real system prompt, and a 50-message history (user questions, answers, tool calls with their
results). Times `Request.fit` (what every model call runs) against `to_lc_messages` on the same
history (the conversion every call ran before), in the same run:

  warm: the steady state, every message already counted once (the session's models.HistoryCache;
        a turn adds one or two messages);
  cold: the first fit after start, every message counted.

    python bench/budget_cost.py [--repeat 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import agents  # noqa: E402
import budget  # noqa: E402
import models  # noqa: E402
from tests.conftest import openai_model  # noqa: E402
from tests.fakes.openai_backend import FakeOpenAI  # noqa: E402
from tests.runtime import runtime  # noqa: E402


def history(messages: int) -> list[dict]:
    out: list[dict] = []
    i = 0
    while len(out) < messages:
        out.append({"role": "user", "content": f"Question {i}: how many orders did customer {i * 37} place in "
                                               "October, and which of them were refunded?"})
        if i % 3 == 0:
            out.append({"role": "assistant", "content": "", "tool_calls": [
                {"id": f"c{i}", "name": "get_system_info", "args": {}}]})
            out.append({"role": "tool", "tool_call_id": f"c{i}", "name": "get_system_info",
                        "content": "\n".join(f"{k} | {k * 3.5:.2f} | 2026-10-{k % 28 + 1:02d}" for k in range(40))})
        out.append({"role": "assistant", "content": f"Customer {i * 37} placed 4 orders in October; one "
                                                    "was refunded on the 12th. " * 3})
        i += 1
    return out[:messages]


def timed(fn, repeat: int) -> float:
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


async def run(repeat: int) -> None:
    with FakeOpenAI(context_limit=8192) as backend, tempfile.TemporaryDirectory() as tmp:
        async with runtime(Path(tmp), {"local": {**openai_model(backend), "model_id": "qwen2.5:7b"},
                                       "gpt": {**openai_model(backend), "model_id": "gpt-4o"}}) as rt:
            print("| model | counter | window | system prompt + tool schemas (tokens) | 50-message history fitted "
                  "(tokens) | turns left out | fit, cold (ms) | fit, warm (ms) | to_lc_messages (ms) |")
            print("|---|---|---|---|---|---|---|---|---|")
            for key in ("local", "gpt"):
                cfg = rt.config.models[key]
                window, _ = await models.model_window(rt.windows, key, cfg)
                request = agents.Request.build(cfg, rt.prompt, rt.tools.for_model(cfg), window)
                past, cache = history(50), models.HistoryCache()
                start = time.perf_counter()
                fitted = request.fit(past, cache)  # first count of every message
                cold = time.perf_counter() - start
                warm = timed(lambda r=request, h=past, c=cache: r.fit(h, c), repeat)
                convert = timed(lambda h=past: models.to_lc_messages(h), repeat)
                print(f"| {key} ({cfg.model_id}) | {budget.counter_for(cfg)[1]} | {request.window:,} "
                      f"| {request.fixed_tokens:,} | {fitted.prompt_tokens - request.fixed_tokens:,} "
                      f"| {fitted.dropped_turns} | {cold * 1e3:.2f} | {warm * 1e3:.3f} | {convert * 1e3:.3f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=2000)
    asyncio.run(run(p.parse_args().repeat))


if __name__ == "__main__":
    main()
