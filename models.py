"""The chat models: built once per server from the registry at their first use (in a worker thread,
with one dry streamed call), probed for reachability and context window, and called (streamed,
retried, measured) by the loop in agents.py.

What a failure means is `llm_errors.py`; the history is fitted into the window by `budget.py`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import re
import ssl
import threading
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import httpx
import httpx2
from langchain_core.language_models import BaseChatModel
from langchain_core.language_models._utils import _normalize_messages
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.messages.ai import add_ai_message_chunks
from langchain_core.runnables import RunnableBinding
from langchain_core.tools import StructuredTool
from langchain_core.tracers.context import _tracing_v2_is_enabled
from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, wait_exponential

import budget
import chat_openai
import tracing
from config import AppConfig, ModelConfig, resolve_api_key
from llm_errors import LLMError, StreamCut, broke_off, describe_llm_error, failure_kind, llm_error_kind, retryable
from text_calls import TextCallFilter

if TYPE_CHECKING:
    from metrics import Metrics

logger = logging.getLogger("agent_mcp.models")

#: Seconds before retry n (1, 2, …) of a model call that failed before any output: 0.5, 1, 2, … at most 8.
_RETRY_BACKOFF = 0.5
#: How often (seconds) a model call moves its clock on: each piece is then waited for between `llm_call_timeout`
#: and `llm_call_timeout` + this. Moving it at every chunk was 4% of a proxied stream's CPU (issue 31).
_CLOCK_SLACK = 0.5
#: One model built at a time (`built_model`'s worker threads): two first turns at once build it once.
_BUILDING = threading.Lock()


async def built_model(llms: dict[str, Any], config: AppConfig, key: str, usage: bool = False,
                      tools: Sequence[StructuredTool] = ()) -> BaseChatModel:
    """The chat model of a registry entry (`chat_model`), built at its first use in a worker thread:
    its LangChain package and SDK imported (`langchain_openai` with `openai`: about 21 MiB that a server
    not using them yet does not hold, and 0.4 s of imports the event loop does not wait for), then for
    OpenAI-type models one dry streamed call with `tools` bound (`_dry_stream`), so the first real call
    finds the request building, chunk parsing and merging warm. LLMError when it cannot be built."""
    llm: BaseChatModel | None = llms.get(key)
    if llm is None:
        llm = await asyncio.to_thread(_build, llms, config, key, usage, tools)
    return llm


def _build(llms: dict[str, Any], config: AppConfig, key: str, usage: bool,
           tools: Sequence[StructuredTool]) -> BaseChatModel:
    with _BUILDING:
        built = key in llms
        llm = chat_model(llms, config, key, usage)
        cfg = config.models[key]
        if not built and cfg.type == "OPENAI":
            try:
                asyncio.run(_dry_stream(cfg, list(tools) if cfg.tool_mode == "native" else []))
            except Exception:  # only the caches stay cold: the real call reports what is wrong
                logger.warning("model %s: the dry streamed call failed", key, exc_info=True)
    return llm


def chat_model(llms: dict[str, Any], config: AppConfig, key: str, usage: bool = False) -> BaseChatModel:
    """The chat model of a registry entry, built once per server and kept in `llms` (one HTTP pool each).
    `usage`: ask for token counts in the stream (when metrics or traces want them)."""
    built: BaseChatModel | None = llms.get(key)
    if built is not None:
        return built
    cfg = config.models.get(key)
    if cfg is None:
        raise LLMError(f"unknown model '{key}'; choose one of: {', '.join(config.models)} (!model)")
    api_key = resolve_api_key(cfg, config.env)
    if api_key is None:
        raise LLMError(
            f"model '{key}' needs an API key: set {cfg.env_key} in .env (or the environment) and restart, "
            "or switch model with !model"
        )
    sampling = {"temperature": cfg.temperature} if cfg.temperature is not None else {}
    llm: BaseChatModel
    if cfg.type == "OPENAI":
        import openai

        # Streamed through the SDK's raw path: no pydantic object per chunk, no request transform, each
        # message converted into the body once (chat_openai).
        llm = chat_openai.openai_chat_model(
            model=cfg.model_id,
            base_url=cfg.host,
            api_key=api_key,
            streaming=True,
            timeout=cfg.llm_call_timeout,
            # No LangChain clock between streamed chunks: its default of 120 s would cut a slow local model's
            # prompt processing short of llm_call_timeout, and any value wraps every chunk in a task of its
            # own (asyncio.wait_for). stream_once keeps that clock, llm_call_timeout per chunk.
            stream_chunk_timeout=None,
            max_retries=0,  # stream_once retries, and never after a timeout (see there)
            # Token counts in the stream (stream_options.include_usage) only when metrics or traces want them.
            **({"stream_usage": True} if usage else {}),
            # Its own pool, closed with the runtime (close_models), not langchain's process-wide one, on the SDK's
            # aiohttp transport: its C HTTP parser reads a stream for about a third less CPU than httpcore and h11
            # (issue 31: 2.18 → 1.48 ms per 32-token stream, 1.33 → 0.94 ms for one token; docs/benchmarks.md).
            # aiohttp refuses a URL with credentials beside the SDK's Authorization header: such a host keeps httpx.
            http_async_client=(openai.DefaultAsyncHttpxClient if cfg.host and httpx.URL(cfg.host).userinfo
                               else openai.DefaultAioHttpClient)(verify=_tls_context()),
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
            max_retries=0,  # one attempt: stream_once owns the retry policy
            **extra,
            **sampling,
        )
    llms[key] = llm
    return llm


@functools.cache
def _tls_context() -> ssl.SSLContext:
    """The certificate store, loaded once per process (about 60 ms each time otherwise), the way httpx
    loads it (certifi, or SSL_CERT_FILE / SSL_CERT_DIR when set)."""
    return httpx2.create_ssl_context()


async def close_models(llms: dict[str, Any], keys: list[str] | None = None) -> None:
    """Close the HTTP pools of the chat models in `llms` (of `keys`, default all) and forget them."""
    for key in list(llms) if keys is None else keys:
        llm = llms.pop(key, None)
        pool = getattr(llm, "http_async_client", None)
        if pool is not None:
            await pool.aclose()
            if getattr(llm, "http_client", None) is not None:
                llm.http_client.close()
        elif hasattr(llm, "aclose"):  # ChatGoogleGenerativeAI's own client
            await llm.aclose()


_DRY_ANSWER = (b'data: {"id":"dry","object":"chat.completion.chunk","created":0,"model":"dry","choices":'
               b'[{"index":0,"delta":{"role":"assistant","content":"ok"},"finish_reason":null}]}\n\n'
               b'data: {"id":"dry","object":"chat.completion.chunk","created":0,"model":"dry","choices":'
               b'[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n')


async def _dry_stream(cfg: ModelConfig, tools: list[StructuredTool]) -> None:
    """One streamed call through a copy of the model's client whose transport answers in memory:
    the request body, the SDK's chunk parsing and LangChain's chunk merging all run once (their
    first run builds caches), and nothing leaves the process."""
    import openai

    messages = [SystemMessage("dry run"), HumanMessage("dry run")]

    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=_DRY_ANSWER, headers={"content-type": "text/event-stream"})

    with openai.DefaultHttpxClient(verify=_tls_context()) as unused:  # see chat_model's http_client
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as http:
            dry = chat_openai.openai_chat_model(
                model=cfg.model_id, base_url="http://dry.invalid/v1", api_key="dry", streaming=True, max_retries=0,
                stream_chunk_timeout=None, http_async_client=http, http_client=unused)
            async for _ in (dry.bind_tools(tools) if tools else dry).astream(messages):
                pass


async def unreachable(cfg: ModelConfig, env: dict[str, str]) -> str | None:
    """Why model `cfg` cannot answer right now, as far as can be told without calling it: a missing
    API key, or nothing listening at a local server's address (hosted APIs are not probed). None: fine."""
    if resolve_api_key(cfg, env) is None:
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


def to_lc_messages(history: list[dict[str, Any]]) -> list[BaseMessage]:
    """OpenAI-style history dicts as LangChain messages (a message of another role has none)."""
    return [lc for lc in map(_to_lc, history) if lc is not None]


def _to_lc(msg: dict[str, Any]) -> BaseMessage | None:
    role, content = msg.get("role"), msg.get("content") or ""
    if role == "user":
        return HumanMessage(content)
    if role == "assistant":
        calls = [
            {"name": c["name"], "args": c.get("args", {}), "id": c["id"], "type": "tool_call"}
            for c in msg.get("tool_calls", [])
        ]
        return AIMessage(content, tool_calls=calls)
    if role == "tool":
        return ToolMessage(content, tool_call_id=msg["tool_call_id"], name=msg.get("name"))
    if role == "system":
        return SystemMessage(content)
    return None


class _Derived:
    """What one stored message becomes: its LangChain message, and its tokens by one counter."""

    __slots__ = ("calls", "content", "counter", "lc", "msg", "tokens")

    def __init__(self, msg: dict[str, Any]):
        self.msg, self.content, self.calls = msg, msg.get("content"), msg.get("tool_calls")
        self.lc = _to_lc(msg)
        self.counter: Callable[[str], int] | None = None
        self.tokens = 0


class HistoryCache:
    """The LangChain message and the token count of each message of one session's history, kept across
    turns, so a turn converts and counts only the messages that are new since the last request.

    Keyed by the message dict itself (each entry holds it, so its id is never another's). An entry is used
    only while the dict still holds the same `content` and `tool_calls` objects: code that edits a stored
    message replaces those values (as SessionManager's cut of a long text does), and the message is then
    converted and counted again. Messages no longer in the history are forgotten as it changes. With the
    OpenAI-type model's memo of each LangChain message's body dict (chat_openai), a turn at 1,000 messages
    no longer rebuilds 1,000 messages twice and recounts their tokens (issue 31)."""

    def __init__(self) -> None:
        self._entries: dict[int, _Derived] = {}

    def _entry(self, msg: dict[str, Any]) -> _Derived:
        entry = self._entries.get(id(msg))  # an entry holds its message: no other object has that id meanwhile
        if entry is None or entry.content is not msg.get("content") or entry.calls is not msg.get("tool_calls"):
            entry = self._entries[id(msg)] = _Derived(msg)
        return entry

    def tokens(self, count: Callable[[str], int]) -> Callable[[dict[str, Any]], int]:
        """budget.message_tokens by `count`, remembered per message."""
        def measure(msg: dict[str, Any]) -> int:
            entry = self._entry(msg)
            if entry.counter is not count:
                entry.counter, entry.tokens = count, budget.message_tokens(msg, count)
            return entry.tokens
        return measure

    def messages(self, history: list[dict[str, Any]]) -> list[BaseMessage]:
        """`to_lc_messages(history)`, the same message objects as last time for the messages not changed since.
        Entries of messages not in `history` are dropped once they outnumber it (the history was trimmed,
        the older turns no longer fit, a fresher copy was read from a shared store)."""
        out = [lc for lc in (self._entry(m).lc for m in history) if lc is not None]
        if len(self._entries) > 2 * len(history) + 16:
            self._entries = {id(m): self._entries[id(m)] for m in history}
        return out


# ── Calls ───────────────────────────────────────────────────────────────────────────────────

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


#: Event-loop turns the model call yields after its first answer token (`_let_readers_run`).
FIRST_TOKEN_YIELDS = 8


async def _let_readers_run() -> None:
    """Yield the event loop a few times after the first answer token is published, so that its readers
    (the proxy: the hub subscription, the turn pump, the request handler, the streaming response's tasks:
    one task hop each) reach their client's socket before the call goes on. With the rest of the answer
    already buffered, the call would otherwise read all of it, and end the turn, without an await that
    waits: the first token left after the last (issue 31: the proxy's first token 1.7 ms later at 32
    tokens). Each idle turn of the loop costs a few µs, once per model call; the events' order is unchanged.
    """
    for _ in range(FIRST_TOKEN_YIELDS):
        await asyncio.sleep(0)


def _own_stream(llm: Any) -> tuple[BaseChatModel, Mapping[str, Any]] | None:
    """The chat model under `llm` (itself, or the model a `bind_tools` binding wraps) and the arguments to call its
    own stream with, when nothing listens to what `BaseChatModel.astream` adds around it; None otherwise."""
    model: Any = llm
    kwargs: Mapping[str, Any] = {}
    if isinstance(llm, RunnableBinding):
        if llm.config or llm.config_factories:
            return None
        model, kwargs = llm.bound, llm.kwargs
    if (not isinstance(model, BaseChatModel) or model.callbacks or model.rate_limiter or model.output_version == "v1"
            or type(model)._astream is BaseChatModel._astream or _tracing_v2_is_enabled()):
        return None
    return model, kwargs


async def _chunks(llm: Any, context: list[BaseMessage]) -> AsyncIterator[AIMessageChunk]:
    """The message chunks of one streamed call of `llm`, as `llm.astream(context)` yields them.

    Read from the model's own stream (`_astream`: what each LangChain chat model implements, and `astream` wraps)
    when nobody listens to the wrapper: no callbacks on the model, no LangSmith tracing, no rate limiter (agent-mcp
    traces with its own spans). The wrapper's per-call set-up (callback and run managers, invocation parameters
    twice, every chunk merged once more for `on_llm_end`) and its awaited callback per chunk were a tenth of a
    proxied stream's server CPU (issue 31: 1.48 → 1.22 ms per 32-token call). The chunks are the same: their
    generation info (finish reason, model name) in `response_metadata`, and a last empty chunk marked `last`.
    """
    own = _own_stream(llm)
    if own is None:
        async for chunk in llm.astream(context):
            yield chunk
        return
    model, kwargs = own
    # What astream does to content lists (images, files) first; text-only messages need none of it.
    if any(type(m.content) is not str for m in context):
        context = _normalize_messages(context)
    async for generation in model._astream(context, **kwargs):
        message = generation.message
        if generation.generation_info:
            message.response_metadata = {**generation.generation_info, **message.response_metadata}
        yield message  # type: ignore[misc]  # a chat model streams AIMessageChunks; LangChain types them as the base class
    yield AIMessageChunk(content="", chunk_position="last")


async def stream_once(
    llm: Any, cfg: ModelConfig, context: list[BaseMessage], client_id: str, tok: Callable[[str, str], None],
    metrics: Metrics, tracer: tracing.Tracing, hold: TextCallFilter | None = None,
) -> AIMessageChunk:
    """One model call, streaming its text to the session `client_id` as it arrives (`tok`, through
    `hold` if given), measured by `metrics` and traced by `tracer`.

    Each piece is waited for at most `llm_call_timeout` s (+ `_CLOCK_SLACK`); a timeout ends the call at once. A call
    that failed before any output with a refused connection or a 429/5xx is tried again, up to
    `max_retries` times (the SDKs' own retries are off: they would wait on a hanging backend again).
    """
    loop = asyncio.get_running_loop()
    streamed = False  # once the backend sent anything, a retry could repeat output or tool calls

    async def attempt() -> AIMessageChunk:
        nonlocal streamed
        streamed_text = False
        moved = loop.time()  # when the clock was last moved on
        chunks: list[AIMessageChunk] = []
        # Our own clock besides the SDK's read timeout: a backend that trickles keepalives
        # without ever producing a token is cut off too.
        try:
            async with asyncio.timeout(cfg.llm_call_timeout + _CLOCK_SLACK) as limit:
                async for chunk in _chunks(llm, context):
                    now = loop.time()
                    if now - moved > _CLOCK_SLACK:  # a timer cancelled and made anew costs more than the chunk's work
                        moved = now
                        limit.reschedule(now + cfg.llm_call_timeout + _CLOCK_SLACK)
                    streamed = True
                    text = content_text(chunk.content)
                    if text:
                        first = not streamed_text
                        if first:
                            streamed_text = True
                            metrics.first_answer_token()
                        tok(client_id, hold.feed(text) if hold else text)
                        if first:
                            await _let_readers_run()
                    chunks.append(chunk)
        except Exception as exc:
            how = broke_off(exc, bool(chunks))
            if how is None:
                raise
            if not any(c.response_metadata.get("finish_reason") for c in chunks):
                raise cut(chunks, f"the connection to the backend broke before the answer's end ({how})") from exc
            # Only what follows the finish reason was lost (usage, the end marker): the answer is whole.
            logger.info("the model stream of %s broke after its finish reason (%s)", client_id, how)
        if not chunks:
            raise LLMError("the backend closed the stream without sending anything")
        # One merge at the end (LangChain's own n-way merge), not a new merged message per chunk.
        reply = add_ai_message_chunks(chunks[0], *chunks[1:]) if len(chunks) > 1 else chunks[0]
        if not reply.response_metadata.get("finish_reason"):
            raise cut(chunks, "the backend's stream ended without the model's finish reason")
        return reply

    def cut(chunks: list[AIMessageChunk], how: str) -> StreamCut:
        """The stream of `chunks` broke off: its text so far (what `hold` kept back is shown now), a cut counted."""
        if hold is not None:
            tok(client_id, hold.finish([]))
        metrics.stream_cut()
        return StreamCut(how, "".join(content_text(c.content) for c in chunks))

    def log_retry(failed: int, exc: BaseException | None) -> None:
        logger.info("model call of %s failed (%s); attempt %d of %d", client_id, type(exc).__name__, failed + 1,
                    cfg.max_retries + 1)

    async def attempts() -> AIMessageChunk:
        """The first attempt; tenacity's retrying only once it failed in a way worth trying again (its machinery
        on every call was 3% of a proxied stream's server CPU, issue 31). The waits are the same: 0.5, 1, 2, … 8 s."""
        try:
            return await attempt()
        except Exception as exc:
            if streamed or not retryable(exc) or cfg.max_retries < 1:
                raise
            log_retry(1, exc)
        await asyncio.sleep(_RETRY_BACKOFF)
        return await AsyncRetrying(  # attempts 2, 3, …: its attempt n is the call's n + 1
            retry=retry_if_exception(lambda exc: not streamed and retryable(exc)),  # type: ignore[redundant-expr]  # attempt() sets `streamed` later
            stop=stop_after_attempt(cfg.max_retries),
            wait=wait_exponential(multiplier=2 * _RETRY_BACKOFF, max=8),
            before_sleep=lambda state: log_retry(state.attempt_number + 1,
                                                 state.outcome.exception() if state.outcome else None),
            reraise=True,
        )(attempt)
    attributes = {"gen_ai.operation.name": "chat", "gen_ai.request.model": cfg.model_id,
                  "gen_ai.provider.name": tracing.PROVIDERS.get(cfg.type, cfg.type.lower())}
    with tracer.span(f"chat {cfg.model_id}", attributes, client=True) as span, \
            metrics.model_call(failure_kind) as call:
        reply = await attempts()
        usage: Mapping[str, Any] = reply.usage_metadata or {}
        call.done(usage)
        finish = reply.response_metadata.get("finish_reason")
        tracer.note(span, gen_ai__usage__input_tokens=usage.get("input_tokens"),
                    gen_ai__usage__output_tokens=usage.get("output_tokens"),
                    gen_ai__response__finish_reasons=[str(finish)] if finish else None)
        return reply


async def model_window(windows: dict[str, tuple[int, str]], key: str, cfg: ModelConfig) -> tuple[int, str]:
    """(context window in tokens, where that number comes from) of model `key`, found once per server
    (kept in `windows` unless unsure)."""
    found = windows.get(key)
    if found is None:
        found = await budget.discover_window(cfg)
        if found[1] != budget.UNSURE:
            windows[key] = found
    return found
