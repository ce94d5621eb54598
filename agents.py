"""The LLM turn: build chat models, stream answers, run tool calls, keep history consistent.

`dispatch_llm()` runs one turn of a session: the system prompt plus the session history go to the
model with its tools bound; text streams to the session's subscribers as it arrives; tool calls go
through `execute_tool()` (the runtime's checks, then the executor) and their results back to the
model, up to `MAX_TOOL_ITERATIONS` rounds. Every failure becomes an `error` event that says why.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from typing import Any

import httpx
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from pydantic import ValidationError

import state
from config import MAX_TOOL_ITERATIONS, ModelConfig, resolve_api_key

logger = logging.getLogger("agent_mcp.agents")


class LLMError(Exception):
    """A model call failed; the message names the model, the cause and what to do."""


# ── Models ──────────────────────────────────────────────────────────────────────────────────


def _build_lc_llm(rt: state.Runtime, key: str) -> BaseChatModel:
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
            max_retries=cfg.max_retries,
        )
    else:
        from langchain_google_genai import ChatGoogleGenerativeAI

        extra = {"base_url": cfg.host} if cfg.host else {}
        llm = ChatGoogleGenerativeAI(
            model=cfg.model_id,
            google_api_key=api_key,
            timeout=cfg.llm_call_timeout,
            max_retries=cfg.max_retries,
            **extra,
        )
    rt.llms[key] = llm
    return llm


def _content_to_str(content: Any) -> str:
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


def describe_llm_error(exc: BaseException, key: str, cfg: ModelConfig | None) -> str:
    """One line for the user: which model failed, why, and what to do."""
    if isinstance(exc, LLMError):
        return str(exc)
    where = f"model '{key}'" + (f" at {cfg.host}" if cfg and cfg.host else "")
    timeout = cfg.llm_call_timeout if cfg else "?"
    try:
        import openai

        if isinstance(exc, openai.APITimeoutError):
            return f"{where}: no answer within {timeout} s (llm_call_timeout); is the backend overloaded?"
        if isinstance(exc, openai.APIConnectionError):
            return f"{where}: cannot connect ({exc.__cause__ or exc}); is the server running and the host right?"
        if isinstance(exc, openai.AuthenticationError):
            return f"{where}: the backend refused the API key (HTTP 401); check {cfg.env_key if cfg else 'the key'}"
        if isinstance(exc, openai.APIStatusError):
            return f"{where}: the backend answered HTTP {exc.status_code}: {_short(exc.message)}"
        if isinstance(exc, openai.APIError):
            return f"{where}: the backend reported an error: {_short(exc.message)}"
    except ImportError:  # pragma: no cover - openai is a dependency of langchain-openai
        pass
    try:
        from google.genai import errors as genai_errors

        if isinstance(exc, genai_errors.APIError):
            return f"{where}: the backend answered HTTP {exc.code}: {_short(str(exc.message or exc))}"
    except ImportError:  # pragma: no cover
        pass
    if isinstance(exc, httpx.TimeoutException | TimeoutError):
        return f"{where}: no answer within {timeout} s (llm_call_timeout); is the backend overloaded?"
    if isinstance(exc, httpx.ConnectError | ConnectionError):
        return f"{where}: cannot connect ({exc}); is the server running and the host right?"
    if isinstance(exc, json.JSONDecodeError | ValueError | httpx.HTTPError):
        return f"{where}: malformed response from the backend ({type(exc).__name__}: {_short(str(exc))})"
    return f"{where}: {type(exc).__name__}: {_short(str(exc))}"


def _short(text: str, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


# ── History ─────────────────────────────────────────────────────────────────────────────────


def trim_history(history: list[dict[str, Any]], max_messages: int) -> list[dict[str, Any]]:
    """The last `max_messages` messages, starting at a user message so no tool result loses its call."""
    if len(history) <= max_messages:
        return history
    kept = history[-max_messages:]
    for i, msg in enumerate(kept):
        if msg.get("role") == "user":
            return kept[i:]
    # A single turn longer than the limit: keep it whole from its user message.
    for i in range(len(history) - 1, -1, -1):
        if history[i].get("role") == "user":
            return history[i:]
    return []


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


async def execute_tool(rt: state.Runtime, client_id: str, name: str, args: dict[str, Any]) -> str:
    """Run one tool call: runtime checks (rate limit, gate) → argument validation → executor.

    Every failure is returned as a result string the model can read; only cancellation escapes.
    """
    token = state.current_client_id.set(client_id)
    try:
        tool = rt.tools.get(name)
        if tool is None:
            return f"ERROR: unknown tool '{name}'. Available tools: {', '.join(rt.tools.names()) or 'none'}"
        for check in rt.tool_checks:
            verdict = await check(rt, client_id, name, args)
            if verdict is not None:
                rt.hub.status(client_id, f"[{name} ✗] {_short(verdict, 200)}")
                return verdict
        try:
            parsed = tool.args_schema.model_validate(args or {})
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'arguments'}: {e['msg']}" for e in exc.errors())
            return f"ERROR: invalid arguments for {name}: {problems}. Fix them and call again."
        rt.hub.status(client_id, f"[{name} ▶] {_short(json.dumps(args, ensure_ascii=False), 200)}")
        try:
            result = await tool.coroutine(**parsed.model_dump())
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            logger.exception("tool %s failed for %s", name, client_id)
            return f"ERROR: tool {name} failed: {type(exc).__name__}: {exc}"
        text = result if isinstance(result, str) else json.dumps(result, ensure_ascii=False, default=str)
        session = rt.sessions.get(client_id)
        limit = session.tool_preview_length if session else state.DEFAULT_TOOL_PREVIEW
        rt.hub.status(client_id, f"[{name} ◀] {_preview(text, limit)}")
        return text
    finally:
        state.current_client_id.reset(token)


# ── The loop ────────────────────────────────────────────────────────────────────────────────


async def _stream_once(rt: state.Runtime, llm: Any, context: list[BaseMessage], client_id: str) -> AIMessageChunk:
    """One model call, streaming its text to the session as it arrives."""
    full: AIMessageChunk | None = None
    async for chunk in llm.astream(context):
        text = _content_to_str(chunk.content)
        if text:
            rt.hub.tok(client_id, text)
        full = chunk if full is None else full + chunk
    if full is None:
        raise LLMError("the backend closed the stream without sending anything")
    return full


async def agentic_lc(rt: state.Runtime, session: state.Session, key: str) -> str:
    """Run the tool-calling loop for one turn on model `key`; return the final answer text.

    Messages of the turn (assistant tool calls, tool results, the answer) are appended to
    `session.history` as they happen; the caller rolls them back if the turn fails.
    """
    cfg = rt.config.models[key]
    client_id = session.client_id
    llm = _build_lc_llm(rt, key)
    tools = rt.tools.for_model(cfg)
    bound = llm.bind_tools(tools) if tools else llm
    for _ in range(MAX_TOOL_ITERATIONS):
        context = [SystemMessage(rt.prompt.assemble()), *to_lc_messages(trim_history(session.history, cfg.max_context))]
        reply = await _stream_once(rt, bound, context, client_id)
        text = _content_to_str(reply.content)
        calls = [{"id": c.get("id") or f"call_{uuid.uuid4().hex[:12]}", "name": c["name"], "args": c["args"]}
                 for c in reply.tool_calls]
        broken = [{"id": c.get("id") or f"call_{uuid.uuid4().hex[:12]}", "name": c.get("name") or "unknown",
                   "args": {}, "error": c.get("error") or "arguments were not valid JSON"}
                  for c in reply.invalid_tool_calls]
        if not calls and not broken:
            session.history.append({"role": "assistant", "content": text})
            return text
        session.history.append({
            "role": "assistant",
            "content": text,
            "tool_calls": [{k: c[k] for k in ("id", "name", "args")} for c in calls + broken],
        })
        for call in calls:
            result = await execute_tool(rt, client_id, call["name"], call["args"])
            session.history.append({"role": "tool", "tool_call_id": call["id"], "name": call["name"], "content": result})
        for call in broken:
            session.history.append({
                "role": "tool", "tool_call_id": call["id"], "name": call["name"],
                "content": f"ERROR: {call['error']}; send the call again with a JSON object of arguments.",
            })
    raise LLMError(f"model '{key}' kept calling tools for {MAX_TOOL_ITERATIONS} rounds; stopped. Ask again more narrowly.")


async def dispatch_llm(rt: state.Runtime, session: state.Session, text: str, model: str | None = None) -> None:
    """Run one LLM turn of `text` on `model` (default: the session's, possibly temporary, model).

    On failure the history is rolled back to how it was before the turn (the user message
    included) and the client gets an `error` event; cancellation rolls back too and propagates.
    """
    key = model or session.model
    mark = len(session.history)
    session.history.append({"role": "user", "content": text})
    try:
        await agentic_lc(rt, session, key)
    except asyncio.CancelledError:
        del session.history[mark:]
        raise
    except Exception as exc:
        if not isinstance(exc, LLMError):
            logger.warning("LLM turn of %s on %s failed", session.client_id, key, exc_info=True)
        del session.history[mark:]
        rt.hub.error(session.client_id, describe_llm_error(exc, key, rt.config.models.get(key)))
    else:
        session.history[:] = trim_history(session.history, rt.config.models[key].max_context)
