"""The LLM turn: build chat models, stream answers, run tool calls, keep history consistent.

`dispatch_llm()` runs one turn of a session: the system prompt plus the session history go to the
model with its tools bound; text streams to the session's subscribers as it arrives; tool calls go
through `execute_tool()` (the runtime's checks, then the executor) and their results back to the
model, up to `MAX_TOOL_ITERATIONS` rounds. Every failure becomes an `error` event that says why.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import re
import ssl
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx
import httpx2
import openai
from langchain_core.exceptions import ModelConnectionError, ModelError, ModelRateLimitError
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.tools import StructuredTool
from langchain_core.utils.function_calling import convert_to_openai_tool
from pydantic import ValidationError
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, stop_after_attempt, wait_exponential

import budget
import failures
import gate
import state
import tracing
from config import MAX_TOOL_ITERATIONS, ModelConfig, field_problems, resolve_api_key
from state import trim_history
from text_calls import (  # noqa: F401  (try_force_tool_calls: tools.py reads text calls through agents)
    TextCallFilter,
    TextCalls,
    call_signature,
    correction,
    described_tool,
    find_text_calls,
    likely_call,
    tool_manifest,
    try_force_tool_calls,
)

logger = logging.getLogger("agent_mcp.agents")


class LLMError(Exception):
    """A model call failed; the message names the model, the cause and what to do."""


class ContextFull(LLMError):
    """The next request does not fit the model's context window, even with the history trimmed."""


#: HTTP statuses of a backend that may answer a second attempt (overloaded, restarting, rate-limited).
_RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
#: Seconds before retry n (1, 2, …) of a model call that failed before any output: 0.5, 1, 2, … at most 8.
_RETRY_BACKOFF = 0.5


# ── Models ──────────────────────────────────────────────────────────────────────────────────


def chat_model(rt: state.Runtime, key: str) -> BaseChatModel:
    """The chat model of a registry entry, built once per server and reused (one HTTP pool each)."""
    llm = rt.llms.get(key)
    if llm is not None:
        return llm
    cfg = rt.config.models.get(key)
    if cfg is None:
        raise LLMError(f"unknown model '{key}'; choose one of: {', '.join(rt.config.models)} (!model)")
    api_key = resolve_api_key(cfg, rt.config.env)
    if api_key is None:
        raise LLMError(
            f"model '{key}' needs an API key: set {cfg.env_key} in .env (or the environment) and restart, "
            "or switch model with !model"
        )
    sampling = {"temperature": cfg.temperature} if cfg.temperature is not None else {}
    if cfg.type == "OPENAI":
        from langchain_openai import ChatOpenAI

        llm = ChatOpenAI(
            model=cfg.model_id,
            base_url=cfg.host,
            api_key=api_key,
            streaming=True,
            timeout=cfg.llm_call_timeout,
            # LangChain's own clock between streamed chunks (120 s by default) would cut a slow local
            # model's prompt processing short of llm_call_timeout; _stream_once keeps the same clock.
            stream_chunk_timeout=cfg.llm_call_timeout,
            max_retries=0,  # _stream_once retries, and never after a timeout (see there)
            # Token counts in the stream (stream_options.include_usage) only when metrics or traces want them.
            **({"stream_usage": True} if rt.metrics.on or rt.tracing.on else {}),
            # Its own pool, closed with the runtime (close_models), not langchain's process-wide one.
            http_async_client=openai.DefaultAsyncHttpxClient(verify=_tls_context()),
            # Never used (every call streams async), but built anyway: on the same certificate store, not
            # one LangChain would load and keep for the process (about 1 MiB each).
            http_client=openai.DefaultHttpxClient(verify=_tls_context()),
            **sampling,
        )
    else:
        from langchain_google_genai import ChatGoogleGenerativeAI

        extra = {"base_url": cfg.host} if cfg.host else {}
        llm = ChatGoogleGenerativeAI(
            model=cfg.model_id,
            google_api_key=api_key,
            timeout=cfg.llm_call_timeout,
            max_retries=0,  # one attempt: _stream_once owns the retry policy
            **extra,
            **sampling,
        )
    rt.llms[key] = llm
    return llm


@functools.cache
def _tls_context() -> ssl.SSLContext:
    """The certificate store, loaded once per process (about 60 ms each time otherwise), the way httpx
    loads it (certifi, or SSL_CERT_FILE / SSL_CERT_DIR when set)."""
    return httpx2.create_ssl_context()


async def close_models(rt: state.Runtime, keys: list[str] | None = None) -> None:
    """Close the HTTP pools of the runtime's chat models (of `keys`, default all) and forget them."""
    for key in list(rt.llms) if keys is None else keys:
        llm = rt.llms.pop(key, None)
        pool = getattr(llm, "http_async_client", None)
        if pool is not None:
            await pool.aclose()
            if getattr(llm, "http_client", None) is not None:
                llm.http_client.close()  # type: ignore[union-attr]
        elif hasattr(llm, "aclose"):  # ChatGoogleGenerativeAI's own client
            await llm.aclose()


def warm_up(rt: state.Runtime) -> list[str]:
    """Build what a first turn would build, so no request waits for it: each usable model's chat
    client (importing its LangChain package), the system prompt, and for OpenAI-type models one
    dry streamed call with the tools bound (`_dry_stream`, answered in memory). Blocking (imports,
    schema generation, its own event loop): run it in a thread before serving.
    Returns the models that could not be prepared (no API key yet, …): they build at their first use."""
    skipped = []
    for key, cfg in rt.config.models.items():
        try:
            chat_model(rt, key)
            tools = rt.tools.for_model(cfg)
            messages = [SystemMessage(rt.prompt.assemble(t.name for t in tools)),
                        *to_lc_messages([{"role": "user", "content": "warm-up"}])]
            if cfg.type == "OPENAI":
                asyncio.run(_dry_stream(cfg, tools if cfg.tool_mode == "native" else [], messages))
        except LLMError:
            skipped.append(key)
        except Exception:  # the first turn on this model reports it to its user
            logger.warning("model %s could not be prepared before start", key, exc_info=True)
            skipped.append(key)
    return skipped


_DRY_ANSWER = (b'data: {"id":"dry","object":"chat.completion.chunk","created":0,"model":"dry","choices":'
               b'[{"index":0,"delta":{"role":"assistant","content":"ok"},"finish_reason":null}]}\n\n'
               b'data: {"id":"dry","object":"chat.completion.chunk","created":0,"model":"dry","choices":'
               b'[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n')


async def _dry_stream(cfg: ModelConfig, tools: list[StructuredTool], messages: list[BaseMessage]) -> None:
    """One streamed call through a copy of the model's client whose transport answers in memory:
    the request body, the SDK's chunk parsing and LangChain's chunk merging all run once (their
    first run builds caches), and nothing leaves the process."""
    from langchain_openai import ChatOpenAI

    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=_DRY_ANSWER, headers={"content-type": "text/event-stream"})

    with openai.DefaultHttpxClient(verify=_tls_context()) as unused:  # see chat_model's http_client
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as http:
            dry = ChatOpenAI(model=cfg.model_id, base_url="http://dry.invalid/v1", api_key="dry", streaming=True,
                             max_retries=0, http_async_client=http, http_client=unused)
            async for _ in (dry.bind_tools(tools) if tools else dry).astream(messages):
                pass


async def unreachable(rt: state.Runtime, key: str) -> str | None:
    """Why model `key` cannot answer right now, as far as can be told without calling it: a missing
    API key, or nothing listening at a local server's address (hosted APIs are not probed). None: fine."""
    cfg = rt.config.models[key]
    if resolve_api_key(cfg, rt.config.env) is None:
        return f"it needs an API key: set {cfg.env_key} in .env"
    if not cfg.host or not budget.is_local(cfg.host):
        return None
    url = httpx.URL(cfg.host)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(url.host, port), 2)
    except (OSError, TimeoutError):
        hint = ("start Ollama: ollama serve; ollama pull " + cfg.model_id if port == 11434 else
                "start llama.cpp's server: llama-server --jinja -m <model.gguf> --port 8080" if port == 8080 else
                "start its server")
        return (f"nothing answers at {url.host}:{port} ({hint}; or, to try everything without a model, run the "
                f"fake backend there: .venv/bin/python -m tests.fakes.openai_backend --port {port})")
    writer.close()
    return None


def content_text(content: Any) -> str:
    """Plain text of a message content: a string, or the text blocks of a content list (Gemini)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for block in content:
            if isinstance(block, str):
                parts.append(block)
            elif isinstance(block, dict) and block.get("type") == "text":
                parts.append(str(block.get("text", "")))
        return "".join(parts)
    return "" if content is None else str(content)


def llm_error_kind(exc: BaseException) -> Literal["timeout", "backend"]:
    """"timeout" when the model did not answer within llm_call_timeout, else "backend" (any other failure)."""
    return "timeout" if failures.failure(exc).kind == "timeout" else "backend"


def _retryable(exc: BaseException) -> bool:
    """Whether a model call that failed this way, before any output, may be tried again: a refused
    connection or a 429/5xx answer, never a timeout (a hanging backend would be waited on again)."""
    if llm_error_kind(exc) == "timeout":
        return False
    connection = (openai.APIConnectionError, httpx.ConnectError, ConnectionError, ModelConnectionError,
                  ModelRateLimitError)
    return any(isinstance(e, connection) or failures.status_of(e) in _RETRY_STATUSES for e in failures.chain(exc))


def _from_backend(exc: BaseException) -> bool:
    """Whether `exc` reports a failure of the model backend (as opposed to a bug on this side)."""
    reported = (LLMError, openai.APIError, httpx.HTTPError, TimeoutError, ConnectionError, ModelError,
                json.JSONDecodeError)
    return any(isinstance(e, reported) or failures.status_of(e) is not None for e in failures.chain(exc))


def describe_llm_error(exc: BaseException, key: str, cfg: ModelConfig | None) -> str:
    """One line for the user: which model failed, why, and what to do."""
    if isinstance(exc, LLMError):
        return str(exc)
    where = f"model '{key}'" + (f" at {cfg.host}" if cfg and cfg.host else "")
    if llm_error_kind(exc) == "timeout":
        timeout = f"{cfg.llm_call_timeout:g}" if cfg else "?"
        return (f"{where}: no answer within {timeout} s (llm_call_timeout), not retried. Check that the model "
                f"server runs and is not overloaded, or raise the limit with !llm_timeout {key} <seconds>")
    found = failures.failure(exc)
    if found.kind == "unreachable":
        cause = found.error.__cause__ or found.error
        return f"{where}: cannot connect ({cause}); is the server running and the host right?"
    if found.status == 401:
        if cfg is not None and not cfg.env_key:  # a keyless model (a local server) sent no key at all
            return (f"{where}: the backend wants an API key (HTTP 401) and this model sends none: put the key in "
                    f".env and name its variable as env_key of '{key}' in llm-models.json")
        variable = cfg.env_key if cfg else "the model's API key variable"
        return f"{where}: the backend refused the API key (HTTP 401); check {variable} in .env (or the environment)"
    if found.kind == "status":
        return f"{where}: the backend answered HTTP {found.status}: {_words(found.message)}"
    if isinstance(exc, openai.APIError):
        return f"{where}: the backend reported an error: {_words(exc.message)}"
    if isinstance(exc, json.JSONDecodeError | ValueError | httpx.HTTPError):
        return f"{where}: malformed response from the backend ({type(exc).__name__}: {_words(str(exc))})"
    return f"{where}: {type(exc).__name__}: {_words(str(exc))}"


def _short(text: str, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _words(text: str) -> str:
    """A backend's words as a user may read them: first line, no credentials, short (failures.summary)."""
    return failures.summary(text)


# ── History ─────────────────────────────────────────────────────────────────────────────────


def to_lc_messages(history: list[dict[str, Any]]) -> list[BaseMessage]:
    """OpenAI-style history dicts as LangChain messages."""
    out: list[BaseMessage] = []
    for msg in history:
        role, content = msg.get("role"), msg.get("content") or ""
        if role == "user":
            out.append(HumanMessage(content))
        elif role == "assistant":
            calls = [
                {"name": c["name"], "args": c.get("args", {}), "id": c["id"], "type": "tool_call"}
                for c in msg.get("tool_calls", [])
            ]
            out.append(AIMessage(content, tool_calls=calls))
        elif role == "tool":
            out.append(ToolMessage(content, tool_call_id=msg["tool_call_id"], name=msg.get("name")))
        elif role == "system":
            out.append(SystemMessage(content))
    return out


# ── Tools ───────────────────────────────────────────────────────────────────────────────────


def _preview(text: str, limit: int) -> str:
    if limit <= 0 or len(text) <= limit:
        return text
    return text[:limit] + "\n…(truncated)"


@dataclass(frozen=True)
class ToolOutcome:
    """One tool call's result as a value: `text` is what the model reads; `status` is ok, error (the
    tool failed), refused (a check stopped it: see `refusal`) or invalid (unknown tool, bad arguments)."""

    text: str
    status: Literal["ok", "error", "refused", "invalid"]
    refusal: gate.Refusal | None = None
    #: For `invalid`: what is wrong, without the instructions to the model.
    problem: str = ""


async def execute_tool(rt: state.Runtime, turn: state.Turn, name: str, args: dict[str, Any]) -> ToolOutcome:
    """Run one tool call of `turn`: validate the arguments → the runtime's checks (rate limit, gate)
    → the executor. The one pipeline of the agent loop and the MCP server alike.

    Every failure is an outcome the model can read; only cancellation escapes.
    """
    entry = rt.tools.entry(name)
    label = name if entry is not None else "other"  # a name a model made up is no metric label or span name
    with rt.tracing.span(f"execute_tool {label}", {"gen_ai.operation.name": "execute_tool",
                                                    "gen_ai.tool.name": label}) as span:
        rt.tracing.text(span, "gen_ai.tool.call.arguments", json.dumps(args, ensure_ascii=False, default=str))
        started = time.perf_counter()
        outcome = await _checked_tool(rt, turn, name, args)
        ran = None if outcome.status in ("refused", "invalid") else time.perf_counter() - started
        refusal = outcome.refusal.kind if outcome.refusal else None
        rt.metrics.tool_call(label, outcome.status, refusal, ran, gate.gate_type(entry) if refusal else "")
        rt.tracing.note(span, agent_mcp__tool__outcome=outcome.status, error__type=refusal)
        rt.tracing.text(span, "gen_ai.tool.call.result", outcome.text)
        return outcome


async def _checked_tool(rt: state.Runtime, turn: state.Turn, name: str, args: dict[str, Any]) -> ToolOutcome:
    entry = rt.tools.entry(name)
    if entry is None:
        problem = f"unknown tool '{name}'"
        return ToolOutcome(f"ERROR: {problem}. Available tools: {', '.join(rt.tools.names()) or 'none'}",
                           "invalid", problem=problem)
    try:
        parsed = entry.tool.args_schema.model_validate(args or {})
    except ValidationError as exc:
        problem = f"invalid arguments for {name}: {field_problems(exc, 'arguments')}"
        return ToolOutcome(f"ERROR: {problem}. Fix them and call again.", "invalid", problem=problem)
    args = parsed.model_dump()
    with state.running(turn):
        turn.db_access = None  # what the gate decides for this call, and nothing an earlier call left
        for check in rt.tool_checks:
            refused = await check(rt, turn, entry, args)
            if refused is not None:
                return ToolOutcome(refused.text, "refused", refused)
        return await _run_tool(rt, turn, entry.tool, args)


async def _run_tool(rt: state.Runtime, turn: state.Turn, tool: StructuredTool, args: dict[str, Any]) -> ToolOutcome:
    """Run a tool whose arguments are validated and whose checks passed; a failure becomes an error outcome."""
    name, client_id = tool.name, turn.client_id
    rt.hub.status(client_id, f"[{name} ▶] {_short(json.dumps(args, ensure_ascii=False), 200)}")
    failed = False
    try:
        result = await tool.coroutine(**args)
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        logger.exception("tool %s failed for %s", name, client_id)
        result, failed = f"ERROR: tool {name} failed: {type(exc).__name__}: {exc}", True
    text = result if isinstance(result, str) else json.dumps(result, ensure_ascii=False, default=str)
    if text.startswith("ERROR"):  # a tool reports its own failures as results (STYLE 5)
        failed = True
        # The model (and whoever reads its answers) learns what failed, never where: the log keeps it.
        hidden = gate.without_locations(rt, text)
        if hidden != text:
            logger.warning("tool %s for %s: %s", name, client_id, text)
        text = hidden
    limit = turn.session.tool_preview_length if turn.session else state.DEFAULT_TOOL_PREVIEW
    rt.hub.status(client_id, f"[{name} ◀] {_preview(text, limit)}")
    return ToolOutcome(text, "error" if failed else "ok")


# ── Router step (seed 004) ──────────────────────────────────────────────────────────────────

ROUTER_PROMPT = (
    "You are a router. Decide whether answering the user's message needs one of these tools:\n{tools}\n"
    "Reply with one word only: yes or no."
)


async def router_wants_tools(llm: Any, cfg: ModelConfig, question: str, tools: list[StructuredTool]) -> bool:
    """One short yes/no call: does this message need tools? Anything but a clear "no" (a failure too) is yes."""
    listing = "\n".join(f"- {t.name}: {(t.description or '').splitlines()[0] if t.description else ''}" for t in tools)
    try:
        async with asyncio.timeout(cfg.llm_call_timeout):
            reply = await llm.ainvoke([SystemMessage(ROUTER_PROMPT.format(tools=listing)), HumanMessage(question)])
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        if llm_error_kind(exc) == "timeout":
            raise  # the backend hangs: one llm_call_timeout per turn is enough
        logger.warning("router call failed (%s); tools stay bound", describe_llm_error(exc, cfg.model_id, cfg))
        return True
    answer = re.match(r"\W*(yes|no)\b", content_text(reply.content).strip().lower())
    return not (answer and answer.group(1) == "no")



# ── The loop ────────────────────────────────────────────────────────────────────────────────


async def _stream_once(
    rt: state.Runtime, llm: Any, cfg: ModelConfig, context: list[BaseMessage], client_id: str,
    hold: TextCallFilter | None = None,
) -> AIMessageChunk:
    """One model call, streaming its text to the session as it arrives (through `hold`, if given).

    Each piece is waited for at most `llm_call_timeout` s; a timeout ends the call at once. A call
    that failed before any output with a refused connection or a 429/5xx is tried again, up to
    `max_retries` times (the SDKs' own retries are off: they would wait on a hanging backend again).
    """
    loop = asyncio.get_running_loop()
    streamed = False  # once the backend sent anything, a retry could repeat output or tool calls

    async def attempt() -> AIMessageChunk:
        nonlocal streamed
        streamed_text = False
        full: AIMessageChunk | None = None
        # Our own clock besides the SDK's read timeout: a backend that trickles keepalives
        # without ever producing a token is cut off too.
        async with asyncio.timeout(cfg.llm_call_timeout) as limit:
            async for chunk in llm.astream(context):
                limit.reschedule(loop.time() + cfg.llm_call_timeout)
                streamed = True
                text = content_text(chunk.content)
                if text:
                    if not streamed_text:
                        streamed_text = True
                        rt.metrics.first_answer_token()
                    rt.hub.tok(client_id, hold.feed(text) if hold else text)
                full = chunk if full is None else full + chunk
        if full is None:
            raise LLMError("the backend closed the stream without sending anything")
        return full

    def log_retry(state_: RetryCallState) -> None:
        exc = state_.outcome.exception() if state_.outcome else None
        logger.info("model call of %s failed (%s); attempt %d of %d", client_id, type(exc).__name__,
                    state_.attempt_number + 1, cfg.max_retries + 1)

    retrying = AsyncRetrying(
        retry=retry_if_exception(lambda exc: not streamed and _retryable(exc)),
        stop=stop_after_attempt(cfg.max_retries + 1),
        wait=wait_exponential(multiplier=_RETRY_BACKOFF, max=8),
        before_sleep=log_retry,
        reraise=True,
    )
    attributes = {"gen_ai.operation.name": "chat", "gen_ai.request.model": cfg.model_id,
                  "gen_ai.provider.name": tracing.PROVIDERS.get(cfg.type, cfg.type.lower())}
    with rt.tracing.span(f"chat {cfg.model_id}", attributes, client=True) as span, \
            rt.metrics.model_call(_failure_kind) as call:
        reply = await retrying(attempt)
        usage = reply.usage_metadata or {}
        call.done(usage)
        finish = reply.response_metadata.get("finish_reason")
        rt.tracing.note(span, gen_ai__usage__input_tokens=usage.get("input_tokens"),
                        gen_ai__usage__output_tokens=usage.get("output_tokens"),
                        gen_ai__response__finish_reasons=[str(finish)] if finish else None)
        return reply


def _failure_kind(exc: BaseException) -> str:
    """How a model call failed, for metrics: context_overflow, timeout, unreachable, http_<status> or other."""
    if _overflowed(exc):
        return "context_overflow"
    found = failures.failure(exc)
    if found.kind == "status" and found.status:
        return f"http_{found.status}"
    return found.kind if found.kind in ("timeout", "unreachable") else "other"


def _last_user_text(history: list[dict[str, Any]]) -> str:
    return next((str(m.get("content") or "") for m in reversed(history)
                 if m.get("role") == "user" and not m.get("tool_results")), "")


async def model_window(rt: state.Runtime, key: str) -> tuple[int, str]:
    """(context window in tokens, where that number comes from) of a model, found once per server."""
    found = rt.windows.get(key)
    if found is None:
        found = await budget.discover_window(rt.config.models[key])
        if found[1] != budget.UNSURE:
            rt.windows[key] = found
    return found


def _overflowed(exc: BaseException) -> bool:
    return any(budget.is_overflow(failures.status_of(e), str(e)) for e in failures.chain(exc))


@dataclass
class Request:
    """What every model call of one turn shares: the system prompt and tool schemas, sent whole,
    and the window the history is fitted into (budget.py)."""

    cfg: ModelConfig
    system: str
    fixed_tokens: int  # the system prompt and the tool schemas
    window: int
    count: Callable[[str], int]
    notes: set[str] = field(default_factory=set)

    @classmethod
    async def build(cls, rt: state.Runtime, key: str, tools: list[StructuredTool]) -> Request:
        """The system prompt for these tools (in `text` tool mode with their manifest; in `native` mode
        their schemas travel beside it) and its size."""
        cfg = rt.config.models[key]
        native = cfg.tool_mode == "native"
        system = rt.prompt.assemble(t.name for t in tools) + (
            "\n" + tool_manifest(tools) if tools and not native else ""
        )
        count, _ = budget.counter_for(cfg)
        window, _ = await model_window(rt, key)
        schemas = sum(count(json.dumps(convert_to_openai_tool(t), ensure_ascii=False)) for t in tools) if native else 0
        return cls(cfg, system, budget.MESSAGE_OVERHEAD + count(system) + schemas, window, count)

    def fit(self, history: list[dict[str, Any]], tighter: float = 1.0) -> budget.Fit:
        """The history this call sends (after `max_context` in messages, the window in tokens)."""
        try:
            return budget.fit(trim_history(history, self.cfg.max_context), self.fixed_tokens, self.window,
                              self.cfg.answer_share, self.count, tighter)
        except budget.DoesNotFit as exc:
            raise ContextFull(f"the request does not fit the model's context window: {exc}") from None

    async def send(self, rt: state.Runtime, llm: Any, session: state.Session, hold: TextCallFilter | None,
                   final: _Final | None = None) -> AIMessageChunk:
        """One model call with the fitted history; when the backend still says the context was exceeded,
        once more with a tighter budget. With `final`, the history goes as plain conversation (no tool
        calls, no tool messages) followed by the request for the final answer."""
        tighter = 1.0
        while True:
            # The final request is fitted as sent: its question and results, not the turn's calls it replaces.
            fitted = self.fit(session.history if final is None else final.conversation(session.history), tighter)
            note = fitted.note()
            if note and note not in self.notes:  # each new shortening once per turn
                self.notes.add(note)
                rt.hub.status(session.client_id, note)
            history = fitted.history
            context = [SystemMessage(self.system), *to_lc_messages(history)]
            try:
                return await _stream_once(rt, llm, self.cfg, context, session.client_id, hold)
            except Exception as exc:
                if tighter < 1 or not _overflowed(exc):
                    raise
                tighter = budget.RETRY_SHARE
                rt.hub.status(session.client_id, "[context] the backend said the request exceeds its context window: "
                                                 "sending it again with less history (the stored history is unchanged)")


async def context_report(rt: state.Runtime, session: state.Session) -> str:
    """For `!model`: the session model's window, where it comes from, and the size of its next request."""
    key = session.model if session.model in rt.config.models else rt.config.default_model
    cfg = rt.config.models[key]
    window, source = await model_window(rt, key)
    request = await Request.build(rt, key, rt.tools.for_model(cfg))
    line = f"Context of '{key}': {window:,}-token window ({source}), {cfg.answer_share:.0%} kept for the answer"
    try:
        fitted = request.fit(session.history)
    except LLMError as exc:
        return f"{line}.\n{exc}"
    note = fitted.note()
    return (f"{line}; the next request is about {fitted.prompt_tokens:,} tokens (system prompt and tools "
            f"{request.fixed_tokens:,}, history {fitted.prompt_tokens - request.fixed_tokens:,}; counted by "
            f"{budget.counter_for(cfg)[1]})" + (f".\n{note}" if note else "."))


#: A repeated call's result: plain words a small model follows (it tends to call again after a result).
REPEAT_NOTE = ("You already have this result of {name} (you called it with these arguments earlier in this turn):\n"
               "{result}\n"
               "Do not call {name} again: answer the user now, using this result.")
#: Closes the results of text calls (a user message): a small model tends to call again instead of answering.
AFTER_RESULTS = ("If you now have everything my question asks for, answer it in plain words; if it also needs "
                 "another tool, call that tool.")
#: How much of each tool result the final request without tools carries.
FINAL_RESULT_CHARS = 4000
#: Repeats of a call in one turn before the loop stops offering tools and asks for the final answer.
REPEATS_BEFORE_FINAL = 2
#: Closes the final call, which carries no tools: the turn's question with what its tools returned.
FINAL_REQUEST = ("{question}\n\nWhat the tools returned:\n{results}\n\nNo more tools can be called now. Using "
                 "what the tools returned, answer my question above in plain words, without JSON and without a "
                 "tool call.")


@dataclass(frozen=True)
class _Final:
    """The request for a final answer: the turn's question, what its tools returned, and the tools whose
    text-call syntax is taken out of earlier turns."""

    results: list[tuple[str, str]]
    tools: dict[str, StructuredTool]

    def conversation(self, history: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """`history` as plain conversation for a model without tools: the turn's tool traffic becomes one
        user message (the question, the results, the request to answer); earlier turns keep their words
        and results, without tool calls (a small model copies whatever call syntax it sees)."""
        start = next((i for i in range(len(history) - 1, -1, -1)
                      if history[i].get("role") == "user" and not history[i].get("tool_results")), len(history))
        out: list[dict[str, Any]] = []
        for i, msg in enumerate(history[:start]):
            role, content = msg.get("role"), str(msg.get("content") or "")
            if role == "assistant" and i + 1 < len(history) and history[i + 1].get("tool_results"):
                found = find_text_calls(content, self.tools)
                content = _without_spans(content, found.spans + found.bad_spans).strip()
            elif role == "tool":
                role, content = "user", f"[Tool result for {msg.get('name')}]:\n{content}"
            if content.strip():
                _append(out, role, content)
        shown = "\n\n".join(f"[{name}]:\n{result}" for name, result in self.results) or "(nothing)"
        question = str(history[start].get("content") or "") if start < len(history) else ""
        _append(out, "user", FINAL_REQUEST.format(question=question, results=shown))
        return out


def _append(out: list[dict[str, Any]], role: Any, content: str) -> None:
    """Add a message, merged into the last one when it has the same role (roles must alternate)."""
    if out and out[-1]["role"] == role:
        out[-1] = {"role": role, "content": f"{out[-1]['content']}\n\n{content}"}
    else:
        out.append({"role": role, "content": content})


def _without_spans(text: str, spans: list[tuple[int, int]]) -> str:
    out, pos = [], 0
    for start, end in sorted(spans):
        out.append(text[pos:max(pos, start)])
        pos = max(pos, end)
    return "".join(out) + text[pos:]


@dataclass
class _Loop:
    """What every round of one LLM turn shares: the model with its tools, the calls made so far, and
    why the turn must end with a final answer without tools (`finish`), once that is so."""

    rt: state.Runtime
    turn: state.Turn
    session: state.Session
    key: str
    bound: Any
    tools: list[StructuredTool]
    request: Request
    #: Signature of each tool call made in this turn → its result (an identical call is not run again).
    done: dict[str, str] = field(default_factory=dict)
    #: (tool, result) of each call that ran, for the answer of last resort.
    results: list[tuple[str, str]] = field(default_factory=list)
    repeats: int = 0
    corrected: bool = False  # the one corrective message of the turn was sent
    finish: str = ""

    @property
    def by_name(self) -> dict[str, StructuredTool]:
        return {t.name: t for t in self.tools}

    async def call(self, name: str, args: dict[str, Any]) -> tuple[str, bool]:
        """(result, whether the call was usable): execute_tool, except that a call identical to an
        earlier one of this turn is not run again; its result comes back with the order to answer."""
        signature = call_signature(name, args)
        if signature in self.done:
            self.repeats += 1
            self.rt.hub.status(
                self.turn.client_id, f"[{name} ↺] identical call already made in this turn; not run again"
            )
            if self.repeats >= REPEATS_BEFORE_FINAL:
                self.finish = f"the model repeated its call of {name}"
            return REPEAT_NOTE.format(name=name, result=_preview(self.done[signature], 2000)), True
        outcome = await execute_tool(self.rt, self.turn, name, args)
        if outcome.status == "invalid":
            return outcome.text, False
        self.done[signature] = outcome.text
        self.results.append((name, outcome.text))
        return outcome.text, True

    def strike(self, what: str) -> bool:
        """A round whose calls could none be used: True the first time (the model was told how to call);
        the second time the loop gives up on them and asks for the final answer."""
        if self.corrected:
            self.finish = f"{what} again after being told how to call"
            return False
        self.corrected = True
        self.rt.hub.status(self.turn.client_id, f"[tools] {what}; told the model once how to call")
        return True


async def _prepare(rt: state.Runtime, turn: state.Turn, session: state.Session, key: str) -> _Loop:
    """The model of a turn with the tools it may call bound (none when its router says no)."""
    cfg = rt.config.models[key]
    llm = chat_model(rt, key)
    tools = rt.tools.for_model(cfg)
    if tools and cfg.router and not await router_wants_tools(llm, cfg, _last_user_text(session.history), tools):
        tools = []
    bound = llm.bind_tools(tools) if tools and cfg.tool_mode == "native" else llm
    return _Loop(rt, turn, session, key, bound, tools, await Request.build(rt, key, tools))


def _new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:12]}"


def _native_calls(reply: AIMessageChunk) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(calls, broken calls) of a streamed reply. LangChain repairs truncated argument JSON while it
    streams (`{"city": "Par` becomes {"city": "Par"}): a call whose arguments as sent do not parse is
    broken, not run with guessed arguments."""
    sent = {c.get("id"): c.get("args") for c in reply.tool_call_chunks if c.get("id")}
    calls, broken = [], []
    for c in reply.tool_calls:
        raw = sent.get(c.get("id"))
        call = {"id": c.get("id") or _new_call_id(), "name": c["name"], "args": c["args"]}
        if isinstance(raw, str) and raw.strip() and not _is_json(raw):
            broken.append({**call, "args": {}, "error": f"the arguments of {c['name']} were not valid JSON"})
        else:
            calls.append(call)
    broken += [{"id": c.get("id") or _new_call_id(), "name": c.get("name") or "unknown", "args": {},
                "error": c.get("error") or "arguments were not valid JSON"} for c in reply.invalid_tool_calls]
    return calls, broken


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


async def _round(loop: _Loop) -> str | None:
    """One model call and the tool calls it asks for; the answer text when it asked for none."""
    rt, history, client_id = loop.rt, loop.session.history, loop.turn.client_id
    by_name = loop.by_name
    hold = TextCallFilter() if by_name else None
    reply = await loop.request.send(rt, loop.bound, loop.session, hold)
    text = content_text(reply.content)
    calls, broken = _native_calls(reply)
    if hold is not None:
        found = find_text_calls(text, by_name) if not calls and not broken else TextCalls()
        rt.hub.tok(client_id, hold.finish(found.spans + found.bad_spans if found.calls or found.problems else []))
        if found.calls or found.problems:
            return await _text_round(loop, text, found)
    if not calls and not broken:
        if not text.strip() and loop.results:
            loop.finish = "the model's answer after the tool results was empty"
            return None
        named = described_tool(text, by_name) if by_name and not loop.done and not loop.corrected else None
        if named and loop.strike(f"the model named {named} instead of calling it"):
            rt.hub.tok(client_id, "\n\n")  # what it said stays on screen; the answer follows apart
            history.append({"role": "assistant", "content": text})
            history.append({"role": "user", "tool_results": True, "content": correction(
                [f"you named {named} but did not call it"], loop.tools, loop.request.cfg.tool_mode == "text",
                (named, None), insist=True)})
            return None
        history.append({"role": "assistant", "content": text})
        return text
    history.append({"role": "assistant", "content": text,
                    "tool_calls": [{k: c[k] for k in ("id", "name", "args")} for c in calls + broken]})
    usable = False
    for call in calls:
        result, ok = await loop.call(call["name"], call["args"])
        usable |= ok
        history.append({"role": "tool", "tool_call_id": call["id"], "name": call["name"], "content": result})
    for call in broken:
        history.append({"role": "tool", "tool_call_id": call["id"], "name": call["name"],
                        "content": f"ERROR: {call['error']}; send the call again with a JSON object of arguments."})
    if not usable:
        loop.strike("the model's tool calls could not be run")
    return None


async def _text_round(loop: _Loop, text: str, found: TextCalls) -> None:
    """Run the calls a model wrote as text; results go back as one user message (every chat template
    accepts that; Gemma's has no tool role). Unusable calls get one corrective message per turn."""
    results, usable = [], False
    for call in found.calls:
        result, ok = await loop.call(call["name"], call["args"])
        usable |= ok
        results.append(f"[Tool result for {call['name']}]:\n{result}")
    if not usable and not loop.strike("the model's tool call could not be run"):
        return  # the loop gives up on this reply: it is left out, and the final answer follows
    if found.problems:
        results.append(correction(found.problems, loop.tools, loop.request.cfg.tool_mode == "text",
                                  likely_call(text, loop.by_name)))
    if results:
        if usable and not found.problems:
            results.append(AFTER_RESULTS)
        loop.session.history.append({"role": "assistant", "content": text})
        loop.session.history.append({"role": "user", "content": "\n\n".join(results), "tool_results": True})


def _last_resort(loop: _Loop) -> str:
    """The answer when the model, asked without tools, still wrote none: what the tools returned."""
    if not loop.results:
        return "The model gave no answer. Please ask again, perhaps more simply or with another model (!model)."
    shown = "\n".join(f"- {name}: {_preview(result, 1500)}" for name, result in loop.results[-3:])
    return f"The model gave no answer; here is what the tools returned:\n{shown}"


async def _final_answer(loop: _Loop) -> str:
    """One more model call, without tools and without the text-call instructions, for the final answer
    from what the tools returned; it becomes the turn's assistant message."""
    rt, client_id = loop.rt, loop.turn.client_id
    rt.hub.status(client_id, f"[final answer] {loop.finish}: asked it once more, without tools, "
                             "for the answer from the tool results")
    request = await Request.build(rt, loop.key, [])
    request.notes = loop.request.notes
    hold = TextCallFilter()
    final = _Final([(name, _preview(result, FINAL_RESULT_CHARS)) for name, result in loop.results], loop.by_name)
    why = "the model wrote no answer"
    try:
        reply = await request.send(rt, chat_model(rt, loop.key), loop.session, hold, final)
    except ContextFull:
        reply, why = AIMessageChunk(content=""), "even the question and the tool results do not fit the window"
    text = content_text(reply.content)
    found = find_text_calls(text, loop.by_name) if loop.by_name else TextCalls()
    spans = found.spans + found.bad_spans if found.calls or found.problems else []
    rt.hub.tok(client_id, hold.finish(spans))
    answer = _without_spans(text, spans).strip()
    if not answer:
        rt.hub.status(client_id, f"[final answer] {why}; showing what the tools returned")
        answer = _last_resort(loop)
        rt.hub.tok(client_id, answer)
    loop.session.history.append({"role": "assistant", "content": answer})
    return answer


async def agentic_lc(rt: state.Runtime, turn: state.Turn, key: str) -> str:
    """Run the tool-calling loop of `turn` on model `key`; return the final answer text.

    Messages of the turn (assistant tool calls, tool results, the answer) are appended to the
    session's history as they happen; the caller rolls them back if the turn fails. With the
    model's `router` option on, a short yes/no call first decides whether tools are bound. A model
    that repeats a call, cannot write a usable call after being told how, or still calls tools after
    `MAX_TOOL_ITERATIONS` rounds is asked once more without tools: every turn ends with an answer
    unless the model fails outright.
    """
    assert turn.session is not None
    loop = await _prepare(rt, turn, turn.session, key)
    for _ in range(MAX_TOOL_ITERATIONS):
        try:
            answer = await _round(loop)
        except ContextFull:
            if not loop.results:
                raise
            # This turn's own calls and results filled the window (a runaway reply, a huge result): the final
            # request carries only the question and what the tools returned.
            loop.finish = "this turn's tool calls no longer fit the model's context window"
            break
        if answer is not None:
            return answer
        if loop.finish:
            break
    else:
        loop.finish = f"the model was still calling tools after {MAX_TOOL_ITERATIONS} rounds"
    return await _final_answer(loop)


async def dispatch_llm(rt: state.Runtime, turn: state.Turn, text: str) -> None:
    """Run one LLM turn of `text` on the turn's model (default: the session's).

    On failure the history is rolled back to how it was before the turn (the user message
    included) and the client gets an `error` event; cancellation rolls back too and propagates.
    """
    session = turn.session
    assert session is not None
    key = turn.model or session.model
    mark = len(session.history)
    session.history.append({"role": "user", "content": text})
    await rt.sessions.save(session)  # kept if this server dies before answering (see SessionManager.hold)
    cfg = rt.config.models.get(key)
    attributes = {"gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "agent-mcp",
                  "gen_ai.request.model": cfg.model_id if cfg else key, "agent_mcp.client_class": turn.kind}
    try:
        with rt.metrics.turn(turn.kind, key), rt.tracing.span("invoke_agent agent-mcp", attributes) as span:
            rt.tracing.text(span, "gen_ai.input.messages", text)
            rt.tracing.text(span, "gen_ai.output.messages", await agentic_lc(rt, turn, key))
    except asyncio.CancelledError:
        # Replaced by a newer message: as if never asked. The server stopping: as if it died (the question stays).
        del session.history[mark + 1 if rt.closing else mark:]
        raise
    except Exception as exc:
        if not _from_backend(exc):  # a backend failure is reported below; anything else is a bug to see
            logger.warning("LLM turn of %s on %s failed", session.client_id, key, exc_info=True)
        del session.history[mark:]
        message = describe_llm_error(exc, key, cfg)
        logger.warning("turn of %s failed: %s", session.client_id, message)  # one line, the whole text
        if not gate.may_administer(turn):
            # Proxy, Slack and API users learn what failed, not where the backends live.
            message = gate.without_locations(rt, message)
        rt.hub.error(session.client_id, message, llm_error_kind(exc))
    else:
        session.history[:] = trim_history(session.history, rt.config.models[key].max_context)
