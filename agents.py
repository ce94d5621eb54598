"""The LLM turn: build chat models, stream answers, run tool calls, keep history consistent.

`dispatch_llm()` runs one turn of a session: the system prompt plus the session history go to the
model with its tools bound; text streams to the session's subscribers as it arrives; tool calls go
through `execute_tool()` (the runtime's checks, then the executor) and their results back to the
model, up to `MAX_TOOL_ITERATIONS` rounds. Every failure becomes an `error` event that says why.
"""

from __future__ import annotations

import ast
import asyncio
import functools
import json
import logging
import re
import ssl
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
from config import MAX_TOOL_ITERATIONS, ModelConfig, field_problems, resolve_api_key
from state import trim_history

logger = logging.getLogger("agent_mcp.agents")


class LLMError(Exception):
    """A model call failed; the message names the model, the cause and what to do."""


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
    if cfg.type == "OPENAI":
        from langchain_openai import ChatOpenAI

        llm = ChatOpenAI(
            model=cfg.model_id,
            base_url=cfg.host,
            api_key=api_key,
            streaming=True,
            timeout=cfg.llm_call_timeout,
            max_retries=0,  # _stream_once retries, and never after a timeout (see there)
            # Its own pool, closed with the runtime (close_models), not langchain's process-wide one.
            http_async_client=openai.DefaultAsyncHttpxClient(verify=_tls_context()),
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

    async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as http:
        dry = ChatOpenAI(model=cfg.model_id, base_url="http://dry.invalid/v1", api_key="dry", streaming=True,
                         max_retries=0, http_async_client=http)
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


# ── Text tool calls ─────────────────────────────────────────────────────────────────────────
#
# Local models often write their tool calls as text instead of using the tool-calling API. Only
# explicit call syntax is recognised (tags, fenced blocks, a reply that is nothing but JSON), only
# names of tools bound for this turn run, and prose is never taken for SQL.

_OPENERS = ("<tool_call>", "<tool_code>", "<function=", "<|python_tag|>", "```json", "```tool")
_OPENER_STARTS = frozenset(o[:i] for o in _OPENERS for i in range(1, len(o)))
_LONGEST_OPENER = max(map(len, _OPENERS))
_BLOCKS = re.compile(
    r"<tool_call>(?P<tool_call>.*?)(?:</tool_call>|\Z)"
    r"|<tool_code>(?P<tool_code>.*?)(?:</tool_code>|\Z)"
    r"|(?P<function><function=[^>\s]+>.*?(?:</function>|\Z))"
    r"|```(?P<lang>[\w-]*)[ \t]*\n(?P<fenced>.*?)```",
    re.DOTALL,
)
_FUNCTION = re.compile(r"<function=([^>\s]+)>(.*?)(?:</function>|\Z)", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\s]+)>\n?(.*?)\n?</parameter>", re.DOTALL)
_ARG_KEYS = ("arguments", "parameters", "input", "args")
_PY_CALL_LANGS = ("tool_code", "tool_call", "tool")
PYTHON_TAG = "<|python_tag|>"


def _json_values(body: str) -> list[Any] | None:
    """Every JSON value in `body` (one after another, whitespace between), or None if anything else is there.

    Retried with `{{`/`}}` collapsed, an artefact of some chat templates.
    """
    for candidate in (body, body.replace("{{", "{").replace("}}", "}")):
        decoder, values, pos, text = json.JSONDecoder(), [], 0, candidate.strip()
        try:
            while pos < len(text):
                value, pos = decoder.raw_decode(text, pos)
                values.append(value)
                while pos < len(text) and text[pos] in " \t\r\n,;":
                    pos += 1
        except ValueError:
            continue
        if values:
            return values
    return None


def _call_from_json(obj: Any) -> tuple[str, dict[str, Any]] | None:
    """(name, args) of one JSON call in any of the usual shapes, or None if it is not one."""
    if not isinstance(obj, dict):
        return None
    if isinstance(obj.get("function"), dict):  # {"type": "function", "function": {"name", "arguments"}}
        obj = obj["function"]
    name = obj.get("name", obj.get("tool_name"))
    args: Any = next((obj[k] for k in _ARG_KEYS if k in obj), {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            return None
    if not isinstance(name, str) or not isinstance(args, dict):
        return None
    return name, args


def _python_calls(body: str) -> list[tuple[str, dict[str, Any]]] | None:
    """Gemma-style `name(key=value)` calls (literal keyword arguments only), or None if not exactly that."""
    try:
        tree = ast.parse(body.strip())
    except SyntaxError:
        return None
    calls = []
    for stmt in tree.body:
        if not isinstance(stmt, ast.Expr):
            return None
        items = stmt.value.elts if isinstance(stmt.value, ast.List | ast.Tuple) else [stmt.value]
        for item in items:
            if isinstance(item, ast.Call) and isinstance(item.func, ast.Name) and item.func.id == "print" \
                    and len(item.args) == 1:
                item = item.args[0]
            if not isinstance(item, ast.Call) or item.args or any(k.arg is None for k in item.keywords):
                return None
            func = item.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
            if name is None:
                return None
            try:
                calls.append((name, {str(k.arg): ast.literal_eval(k.value) for k in item.keywords}))
            except (ValueError, SyntaxError):
                return None
    return calls or None


def _function_calls(body: str) -> list[tuple[str, dict[str, Any], bool]]:
    """`<function=name>` calls: XML `<parameter=…>` values (strings, typed later) or a JSON body."""
    calls = []
    for name, inner in _FUNCTION.findall(body):
        params = _PARAMETER.findall(inner)
        if params:
            calls.append((name, dict(params), True))
        elif not inner.strip():
            calls.append((name, {}, False))
        else:
            values = _json_values(inner)
            if values and len(values) == 1 and isinstance(values[0], dict):
                calls.append((name, values[0], False))
    return calls


def _typed_xml_args(tool: StructuredTool, args: dict[str, str]) -> dict[str, Any]:
    """XML parameter values are text: decode JSON for the parameters whose schema is not a string."""
    props = tool.args_schema.model_json_schema().get("properties", {}) if tool.args_schema else {}
    typed: dict[str, Any] = {}
    for key, value in args.items():
        kinds = {props.get(key, {}).get("type")} | {a.get("type") for a in props.get(key, {}).get("anyOf", [])}
        if "string" in kinds or not kinds - {None}:
            typed[key] = value
            continue
        try:
            typed[key] = json.loads(value)
        except ValueError:
            typed[key] = value
    return typed


def _block_calls(match: re.Match[str]) -> list[tuple[str, dict[str, Any], bool]]:
    body = next(
        g for g in (match["tool_call"], match["tool_code"], match["function"], match["fenced"]) if g is not None
    )
    if "<function=" in body:
        return _function_calls(body)
    values = _json_values(body.strip().removeprefix(PYTHON_TAG))
    if values is not None:
        flat = [v for value in values for v in (value if isinstance(value, list) else [value])]
        found = [_call_from_json(v) for v in flat]
        return [(c[0], c[1], False) for c in found if c is not None] if all(found) else []
    if match["tool_code"] is not None or (match["lang"] or "").lower() in _PY_CALL_LANGS:
        return [(n, a, False) for n, a in _python_calls(body) or []]
    return []


def try_force_tool_calls(
    text: str, tools: dict[str, StructuredTool]
) -> tuple[list[dict[str, Any]], list[tuple[int, int]]]:
    """Tool calls written as text, validated against `tools`: (calls, spans of the text they came from).

    Recognised: `<tool_call>{json}</tool_call>` (Qwen, Hermes), `<tool_code>{"tool_name",
    "arguments"}</tool_code>` (seed 004) or Gemma's `name(key=value)`, `<function=name>` with
    `<parameter=…>` XML or a JSON body, fenced ```json / ```tool_code blocks, and a reply that is
    only JSON (Llama's `{"name", "parameters"}`, optionally after `<|python_tag|>`). Calls of
    unknown tools, with non-object arguments or positional arguments are dropped, and so are
    duplicates.
    """
    found: list[tuple[str, dict[str, Any], bool]] = []
    spans: list[tuple[int, int]] = []
    for match in _BLOCKS.finditer(text):
        calls = _block_calls(match)
        if any(name in tools for name, _, _ in calls):
            found += calls
            spans.append(match.span())
    if not found:
        body = text.strip().removeprefix(PYTHON_TAG).strip()
        values = _json_values(body) if body.startswith(("{", "[")) else None
        if values is not None:
            flat = [v for value in values for v in (value if isinstance(value, list) else [value])]
            calls = [_call_from_json(v) for v in flat]
            if all(calls) and any(c[0] in tools for c in calls if c):
                found = [(c[0], c[1], False) for c in calls if c]
                spans = [(0, len(text))]
    result, seen = [], set()
    for name, args, xml in found:
        tool = tools.get(name)
        if tool is None:
            continue
        if xml:
            args = _typed_xml_args(tool, args)
        signature = call_signature(name, args)
        if signature in seen:
            continue
        seen.add(signature)
        result.append({"id": f"text-{uuid.uuid4().hex[:8]}", "name": name, "args": args})
    return result, spans


def call_signature(name: str, args: dict[str, Any]) -> str:
    """Identity of a call: the same tool with the same arguments gives the same signature."""
    return name + json.dumps(args, sort_keys=True, ensure_ascii=False, default=str)


class TextCallFilter:
    """Holds streamed text back from the first sign of a text tool call until the reply is complete.

    Text before a call streams as usual; call syntax is never shown; if the held text turns out
    not to be a call, it is sent whole at the end.
    """

    def __init__(self) -> None:
        self.chunks: list[str] = []
        self.pending = ""  # received, not shown yet (a possible opener, or leading whitespace)
        self.sent = 0  # characters shown so far
        self.holding = False

    def feed(self, chunk: str) -> str:
        """Add streamed text; return what can be shown now."""
        self.chunks.append(chunk)
        if self.holding:
            return ""
        body = self.pending + chunk
        if self.sent == 0:
            lead = body.lstrip()
            if not lead or lead[0] in "{[":  # whitespace so far, or a reply that may be all JSON
                self.pending, self.holding = body, bool(lead)
                return ""
        hits = [i for i in (body.find(o) for o in _OPENERS) if i >= 0]
        if hits:
            self.holding = True
            cut = min(hits)
        else:  # keep back a tail that may be the start of an opener split across chunks
            tail = body[-_LONGEST_OPENER:]
            keep = 0 if "<" not in tail and "`" not in tail else next(
                (k for k in range(min(len(body), _LONGEST_OPENER), 0, -1) if body[-k:] in _OPENER_STARTS), 0)
            cut = len(body) - keep
        self.sent += cut
        self.pending = body[cut:]
        return body[:cut]

    def finish(self, spans: list[tuple[int, int]]) -> str:
        """The rest of the reply to show, without the spans that were tool calls."""
        text = "".join(self.chunks)
        out, pos = [], self.sent
        for start, end in sorted(spans):
            if end <= pos:
                continue
            out.append(text[pos:max(pos, start)])
            pos = max(pos, end)
        out.append(text[pos:])
        self.sent, self.pending = len(text), ""
        rest = "".join(out)
        return rest.strip() if spans else rest


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


TEXT_TOOLS_PROMPT = """\
## Tools
You can call these tools. To call one, reply with exactly one block and nothing after it:
<tool_code>{{"tool_name": "<name>", "arguments": {{<arguments as JSON>}}}}</tool_code>
The result comes back in the next message; then answer the user, or call another tool.
Answer without a block when no tool is needed.

{manifest}"""


def tool_manifest(tools: list[StructuredTool]) -> str:
    """The system-prompt part that describes tools to a model in `text` tool mode (seed 004)."""
    entries = []
    for tool in tools:
        params = convert_to_openai_tool(tool)["function"].get("parameters", {})
        entries.append(f"- {tool.name}: {tool.description}\n  arguments: {json.dumps(params, ensure_ascii=False)}")
    return TEXT_TOOLS_PROMPT.format(manifest="\n".join(entries))


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
        full: AIMessageChunk | None = None
        # Our own clock besides the SDK's read timeout: a backend that trickles keepalives
        # without ever producing a token is cut off too.
        async with asyncio.timeout(cfg.llm_call_timeout) as limit:
            async for chunk in llm.astream(context):
                limit.reschedule(loop.time() + cfg.llm_call_timeout)
                streamed = True
                text = content_text(chunk.content)
                if text:
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
    return await retrying(attempt)


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
            raise LLMError(f"the request does not fit the model's context window: {exc}") from None

    async def send(self, rt: state.Runtime, llm: Any, session: state.Session, hold: TextCallFilter | None
                   ) -> AIMessageChunk:
        """One model call with the fitted history; when the backend still says the context was exceeded,
        once more with a tighter budget."""
        tighter = 1.0
        while True:
            fitted = self.fit(session.history, tighter)
            note = fitted.note()
            if note and note not in self.notes:  # each new shortening once per turn
                self.notes.add(note)
                rt.hub.status(session.client_id, note)
            context = [SystemMessage(self.system), *to_lc_messages(fitted.history)]
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


@dataclass
class _Loop:
    """What every round of one LLM turn shares: the model with its tools, and the calls made so far."""

    rt: state.Runtime
    turn: state.Turn
    session: state.Session
    key: str
    bound: Any
    by_name: dict[str, StructuredTool]
    request: Request
    #: Signature of each tool call made in this turn → its result (an identical call is not run again).
    done: dict[str, str] = field(default_factory=dict)

    async def call(self, name: str, args: dict[str, Any]) -> str:
        """execute_tool, except that a call identical to an earlier one of this turn is not run again."""
        signature = call_signature(name, args)
        if signature in self.done:
            self.rt.hub.status(
                self.turn.client_id, f"[{name} ↺] identical call already made in this turn; not run again"
            )
            return (f"NOTE: you already called {name} with exactly these arguments in this turn; its result is "
                    "above. Use that result instead of calling again.")
        self.done[signature] = text = (await execute_tool(self.rt, self.turn, name, args)).text
        return text


async def _prepare(rt: state.Runtime, turn: state.Turn, session: state.Session, key: str) -> _Loop:
    """The model of a turn with the tools it may call bound (none when its router says no)."""
    cfg = rt.config.models[key]
    llm = chat_model(rt, key)
    tools = rt.tools.for_model(cfg)
    if tools and cfg.router and not await router_wants_tools(llm, cfg, _last_user_text(session.history), tools):
        tools = []
    bound = llm.bind_tools(tools) if tools and cfg.tool_mode == "native" else llm
    return _Loop(rt, turn, session, key, bound, {t.name: t for t in tools}, await Request.build(rt, key, tools))


def _new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:12]}"


async def _round(loop: _Loop) -> str | None:
    """One model call and the tool calls it asks for; the answer text when it asked for none."""
    rt, history, client_id = loop.rt, loop.session.history, loop.turn.client_id
    hold = TextCallFilter() if loop.by_name else None
    reply = await loop.request.send(rt, loop.bound, loop.session, hold)
    text = content_text(reply.content)
    calls = [{"id": c.get("id") or _new_call_id(), "name": c["name"], "args": c["args"]} for c in reply.tool_calls]
    broken = [{"id": c.get("id") or _new_call_id(), "name": c.get("name") or "unknown", "args": {},
               "error": c.get("error") or "arguments were not valid JSON"} for c in reply.invalid_tool_calls]
    if hold is not None:
        forced, spans = try_force_tool_calls(text, loop.by_name) if not calls and not broken else ([], [])
        rt.hub.tok(client_id, hold.finish(spans if forced else []))
        if forced:
            # Fed back as a user message: every chat template accepts that (Gemma's has no tool role).
            history.append({"role": "assistant", "content": text})
            results = [f"[Tool result for {c['name']}]:\n{await loop.call(c['name'], c['args'])}" for c in forced]
            history.append({"role": "user", "content": "\n\n".join(results), "tool_results": True})
            return None
    if not calls and not broken:
        history.append({"role": "assistant", "content": text})
        return text
    history.append({"role": "assistant", "content": text,
                    "tool_calls": [{k: c[k] for k in ("id", "name", "args")} for c in calls + broken]})
    for call in calls:
        result = await loop.call(call["name"], call["args"])
        history.append({"role": "tool", "tool_call_id": call["id"], "name": call["name"], "content": result})
    for call in broken:
        history.append({"role": "tool", "tool_call_id": call["id"], "name": call["name"],
                        "content": f"ERROR: {call['error']}; send the call again with a JSON object of arguments."})
    return None


async def agentic_lc(rt: state.Runtime, turn: state.Turn, key: str) -> str:
    """Run the tool-calling loop of `turn` on model `key`; return the final answer text.

    Messages of the turn (assistant tool calls, tool results, the answer) are appended to the
    session's history as they happen; the caller rolls them back if the turn fails. With the
    model's `router` option on, a short yes/no call first decides whether tools are bound.
    """
    assert turn.session is not None
    loop = await _prepare(rt, turn, turn.session, key)
    for _ in range(MAX_TOOL_ITERATIONS):
        answer = await _round(loop)
        if answer is not None:
            return answer
    raise LLMError(
        f"model '{key}' kept calling tools for {MAX_TOOL_ITERATIONS} rounds; stopped. Ask again more narrowly."
    )


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
    try:
        await agentic_lc(rt, turn, key)
    except asyncio.CancelledError:
        # Replaced by a newer message: as if never asked. The server stopping: as if it died (the question stays).
        del session.history[mark + 1 if rt.closing else mark:]
        raise
    except Exception as exc:
        if not _from_backend(exc):  # a backend failure is reported below; anything else is a bug to see
            logger.warning("LLM turn of %s on %s failed", session.client_id, key, exc_info=True)
        del session.history[mark:]
        cfg = rt.config.models.get(key)
        message = describe_llm_error(exc, key, cfg)
        logger.warning("turn of %s failed: %s", session.client_id, message)  # one line, the whole text
        if not gate.may_administer(turn):
            # Proxy, Slack and API users learn what failed, not where the backends live.
            message = gate.without_locations(rt, message)
        rt.hub.error(session.client_id, message, llm_error_kind(exc))
    else:
        session.history[:] = trim_history(session.history, rt.config.models[key].max_context)
