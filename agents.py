"""The LLM turn: the tool-calling loop, from the user's message to the final answer.

`Agent.dispatch_llm()` runs one turn of a session: the system prompt plus the session history go to the
model with its tools bound; text streams to the session's subscribers as it arrives; tool calls go
through the tool pipeline (`tool_calls.ToolPipeline`: the checks, then the executor) and their results back
to the model, up to `MAX_TOOL_ITERATIONS` rounds. Every failure becomes an `error` event that says why.
The chat models and their calls are `models.py`; what a failure means, `llm_errors.py`.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from langchain_core.messages import AIMessageChunk, BaseMessage, SystemMessage
from langchain_core.tools import StructuredTool
from langchain_core.utils.function_calling import convert_to_openai_tool

import budget
import client_classes
import events
import stores
import turns
from config import MAX_TOOL_ITERATIONS, AppConfig, ModelConfig
from llm_errors import ContextFull, LLMError, StreamCut, describe_llm_error, from_backend, llm_error_kind, overflowed
from models import HistoryCache, built_model, content_text, model_window, router_wants_tools, stream_once
from sessions import SessionManager, trim_history
from text_calls import (
    TextCallFilter,
    TextCalls,
    call_signature,
    correction,
    described_tool,
    find_text_calls,
    likely_call,
    tool_manifest,
    without_spans,
)
from tool_calls import ToolOutcome, ToolPipeline, preview

if TYPE_CHECKING:
    from langchain_core.language_models import BaseChatModel

    from metrics import Metrics
    from prompt import PromptTree
    from registry import ToolRegistry
    from tracing import Tracing

logger = logging.getLogger("agent_mcp.agents")

#: One streamed model call with the session's stream and the telemetry bound (models.stream_once):
#: (model, its config, the messages, the session's client id, the text-call filter) → the reply.
ModelCall = Callable[[Any, ModelConfig, list[BaseMessage], str, TextCallFilter | None], Awaitable[AIMessageChunk]]
#: One tool call through the pipeline (tool_calls.ToolPipeline.execute): (turn, tool name, arguments) → its outcome.
ToolCall = Callable[[turns.Turn, str, dict[str, Any]], Awaitable[ToolOutcome]]
#: A line for a session's status stream: (client id, text).
Status = Callable[[str, str], None]


#: Ends the stored text of an answer whose stream broke off (models.stream_once's StreamCut): the next turn's
#: model, and anyone reading the history, see that it is not the whole answer.
CUT_MARK = "[answer cut off: the model's stream ended before the answer was finished]"


def cut_answer(partial: str) -> dict[str, Any]:
    """The history message of an answer cut off after `partial`: its text with CUT_MARK, flagged `cut`."""
    return {"role": "assistant", "content": f"{partial}\n\n{CUT_MARK}" if partial.strip() else CUT_MARK, "cut": True}


# ── The loop ────────────────────────────────────────────────────────────────────────────────


def _last_user_text(history: list[dict[str, Any]]) -> str:
    return next((str(m.get("content") or "") for m in reversed(history)
                 if m.get("role") == "user" and not m.get("tool_results")), "")



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

    @functools.cached_property
    def system_message(self) -> SystemMessage:
        """The system prompt as one message object for every call of the turn (its body dict is built once)."""
        return SystemMessage(self.system)

    @classmethod
    def build(cls, cfg: ModelConfig, prompt: PromptTree, tools: list[StructuredTool], window: int) -> Request:
        """The system prompt for these tools (in `text` tool mode with their manifest; in `native` mode
        their schemas travel beside it) and its size, for a model with this context `window`."""
        native = cfg.tool_mode == "native"
        system = prompt.assemble(t.name for t in tools) + (
            "\n" + tool_manifest(tools) if tools and not native else ""
        )
        count, _ = budget.counter_for(cfg)
        schemas = sum(count(_schema(t)[1]) for t in tools) if native else 0
        return cls(cfg, system, budget.MESSAGE_OVERHEAD + count(system) + schemas, window, count)

    def fit(self, history: list[dict[str, Any]], cache: HistoryCache, tighter: float = 1.0) -> budget.Fit:
        """The history this call sends (after `max_context` in messages, the window in tokens)."""
        try:
            return budget.fit(trim_history(history, self.cfg.max_context), self.fixed_tokens, self.window,
                              self.cfg.answer_share, self.count, tighter, cache.tokens(self.count))
        except budget.DoesNotFit as exc:
            raise ContextFull(f"the request does not fit the model's context window: {exc}") from None

    async def send(self, call: ModelCall, status: Status, llm: Any, session: stores.Session, cache: HistoryCache,
                   hold: TextCallFilter | None, final: _Final | None = None) -> AIMessageChunk:
        """One model call (`call`) with the fitted history (its messages converted and counted through `cache`),
        any shortening told by `status`; when the backend still says the context was exceeded, once more with a
        tighter budget. With `final`, the history goes as plain conversation (no tool calls, no tool messages)
        followed by the request for the final answer."""
        tighter = 1.0
        while True:
            # The final request is fitted as sent: its question and results, not the turn's calls it replaces.
            fitted = self.fit(session.history if final is None else final.conversation(session.history), cache,
                              tighter)
            note = fitted.note()
            if note and note not in self.notes:  # each new shortening once per turn
                self.notes.add(note)
                status(session.client_id, note)
            context = [self.system_message, *cache.messages(fitted.history)]
            try:
                return await call(llm, self.cfg, context, session.client_id, hold)
            except Exception as exc:
                if tighter < 1 or not overflowed(exc):
                    raise
                tighter = budget.RETRY_SHARE
                status(session.client_id, "[context] the backend said the request exceeds its context window: "
                                          "sending it again with less history (the stored history is unchanged)")


#: Sessions whose HistoryCache is kept (the most recently active). A cache holds about 1.7 KB per message
#: (a LangChain message and its body dict; the texts are the history's own): 64 sessions of the default
#: 1,000 messages keep about 110 MB at most.
MAX_HISTORY_CACHES = 64
#: Tool bindings kept (`Agent._bound`): one per model and tool set (the router's choice makes a second).
MAX_BINDINGS = 32


def history_cache(caches: OrderedDict[str, HistoryCache], client_id: str) -> HistoryCache:
    """The HistoryCache of session `client_id` in `caches`, made at its first turn; the least recently used
    beyond MAX_HISTORY_CACHES is let go (its session's next turn converts and counts its history again)."""
    cache = caches.get(client_id)
    if cache is None:
        cache = caches[client_id] = HistoryCache()
        if len(caches) > MAX_HISTORY_CACHES:
            caches.popitem(last=False)
    else:
        caches.move_to_end(client_id)
    return cache


async def context_report(session: stores.Session, config: AppConfig, prompt: PromptTree, tools: ToolRegistry,
                         windows: dict[str, tuple[int, str]]) -> str:
    """For `!model`: the session model's window, where it comes from, and the size of its next request."""
    key = session.model if session.model in config.models else config.default_model
    cfg = config.models[key]
    window, source = await model_window(windows, key, cfg)
    request = Request.build(cfg, prompt, tools.for_model(cfg), window)
    line = f"Context of '{key}': {window:,}-token window ({source}), {cfg.answer_share:.0%} kept for the answer"
    try:
        fitted = request.fit(session.history, HistoryCache())
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
                content = without_spans(content, found.spans + found.bad_spans).strip()
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


@dataclass
class _Loop:
    """What every round of one LLM turn shares: the model with its tools, the calls made so far, and
    why the turn must end with a final answer without tools (`finish`), once that is so."""

    turn: turns.Turn
    session: stores.Session
    hub: events.EventHub  # the session's stream: answer tokens and status lines
    model_call: ModelCall
    run_tool: ToolCall
    prompt: PromptTree
    llm: Any  # the model without tools, for the final answer
    bound: Any  # the model with the turn's tools bound (native tool mode)
    tools: list[StructuredTool]
    request: Request
    cache: HistoryCache  # the session's messages as converted and counted for its earlier requests
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
            self.hub.status(
                self.turn.client_id, f"[{name} ↺] identical call already made in this turn; not run again"
            )
            if self.repeats >= REPEATS_BEFORE_FINAL:
                self.finish = f"the model repeated its call of {name}"
            return REPEAT_NOTE.format(name=name, result=preview(self.done[signature], 2000)), True
        outcome = await self.run_tool(self.turn, name, args)
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
        self.hub.status(self.turn.client_id, f"[tools] {what}; told the model once how to call")
        return True


#: Tool object → (the tool, its OpenAI function schema, that schema as JSON), least recently used first. Every
#: turn binds and counts the same tools: converting them again was about 0.4 ms of a turn's 8.5 ms of server
#: CPU (issue 31). The entry keeps its tool, so an id is never mistaken for a later object's.
_SCHEMAS: OrderedDict[int, tuple[StructuredTool, dict[str, Any], str]] = OrderedDict()
MAX_SCHEMAS = 1024


def _schema(tool: StructuredTool) -> tuple[dict[str, Any], str]:
    """The tool's OpenAI function schema and its JSON, converted once per tool object."""
    entry = _SCHEMAS.get(id(tool))
    if entry is None or entry[0] is not tool:
        schema = convert_to_openai_tool(tool)
        entry = _SCHEMAS[id(tool)] = (tool, schema, json.dumps(schema, ensure_ascii=False))
        if len(_SCHEMAS) > MAX_SCHEMAS:
            _SCHEMAS.popitem(last=False)
    else:
        _SCHEMAS.move_to_end(id(tool))
    return entry[1], entry[2]


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
    hub, history, client_id = loop.hub, loop.session.history, loop.turn.client_id
    by_name = loop.by_name
    hold = TextCallFilter() if by_name else None
    reply = await loop.request.send(loop.model_call, hub.status, loop.bound, loop.session, loop.cache, hold)
    text = content_text(reply.content)
    calls, broken = _native_calls(reply)
    if hold is not None:
        found = find_text_calls(text, by_name) if not calls and not broken else TextCalls()
        hub.tok(client_id, hold.finish(found.spans + found.bad_spans if found.calls or found.problems else []))
        if found.calls or found.problems:
            await _text_round(loop, text, found)
            return None
    if not calls and not broken:
        if not text.strip() and loop.results:
            loop.finish = "the model's answer after the tool results was empty"
            return None
        named = described_tool(text, by_name) if by_name and not loop.done and not loop.corrected else None
        if named and loop.strike(f"the model named {named} instead of calling it"):
            hub.tok(client_id, "\n\n")  # what it said stays on screen; the answer follows apart
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
    shown = "\n".join(f"- {name}: {preview(result, 1500)}" for name, result in loop.results[-3:])
    return f"The model gave no answer; here is what the tools returned:\n{shown}"


async def _final_answer(loop: _Loop) -> str:
    """One more model call, without tools and without the text-call instructions, for the final answer
    from what the tools returned; it becomes the turn's assistant message."""
    hub, client_id = loop.hub, loop.turn.client_id
    hub.status(client_id, f"[final answer] {loop.finish}: asked it once more, without tools, "
                          "for the answer from the tool results")
    request = Request.build(loop.request.cfg, loop.prompt, [], loop.request.window)
    request.notes = loop.request.notes
    hold = TextCallFilter()
    final = _Final([(name, preview(result, FINAL_RESULT_CHARS)) for name, result in loop.results], loop.by_name)
    why = "the model wrote no answer"
    try:
        reply = await request.send(loop.model_call, hub.status, loop.llm, loop.session, loop.cache, hold, final)
    except ContextFull:
        reply, why = AIMessageChunk(content=""), "even the question and the tool results do not fit the window"
    text = content_text(reply.content)
    found = find_text_calls(text, loop.by_name) if loop.by_name else TextCalls()
    spans = found.spans + found.bad_spans if found.calls or found.problems else []
    hub.tok(client_id, hold.finish(spans))
    answer = without_spans(text, spans).strip()
    if not answer:
        hub.status(client_id, f"[final answer] {why}; showing what the tools returned")
        answer = _last_resort(loop)
        hub.tok(client_id, answer)
    loop.session.history.append({"role": "assistant", "content": answer})
    return answer


async def agentic_lc(loop: _Loop) -> str:
    """Run the tool-calling loop of a turn (`_prepare`); return the final answer text.

    Messages of the turn (assistant tool calls, tool results, the answer) are appended to the
    session's history as they happen; the caller rolls them back if the turn fails. With the
    model's `router` option on, a short yes/no call first decides whether tools are bound. A model
    that repeats a call, cannot write a usable call after being told how, or still calls tools after
    `MAX_TOOL_ITERATIONS` rounds is asked once more without tools: every turn ends with an answer
    unless the model fails outright.
    """
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


@dataclass
class Agent:
    """The LLM turns of one instance and exactly what they use (built once by build.py): the configuration,
    the sessions and their streams, the system prompt, the tool pipeline (its registry holds the tools), the
    chat models and their windows (kept across turns), the telemetry, and whether the server is stopping."""

    config: AppConfig
    sessions: SessionManager
    hub: events.EventHub
    prompt: PromptTree
    pipeline: ToolPipeline
    #: model key → LangChain chat model, built once and reused (the runtime's `llms`).
    llms: dict[str, BaseChatModel]
    #: model key → (context window in tokens, where that number comes from) (the runtime's `windows`).
    windows: dict[str, tuple[int, str]]
    metrics: Metrics
    tracing: Tracing
    #: Whether the server is stopping (the runtime's `closing`, set by routes.end_all), read when a turn is cancelled.
    closing: Callable[[], bool]
    #: client id → what the turns made of its session's history, for the sessions that took a turn most recently
    #: (`history_cache`), least recent first.
    histories: OrderedDict[str, HistoryCache] = field(default_factory=OrderedDict)
    #: (the model's id, its tools' ids) → (the model, the tools, the model with them bound) (`_bound`).
    bindings: dict[tuple[int, ...], tuple[Any, list[StructuredTool], Any]] = field(default_factory=dict)

    async def warm(self, key: str) -> None:
        """Build model `key` before a turn needs it (`built_model`: in a worker thread). One that cannot be
        built is left to its first turn, which says why."""
        try:
            await built_model(self.llms, self.config, key, self.metrics.on or self.tracing.on,
                              self.pipeline.tools.for_model(self.config.models[key]))
        except LLMError as exc:
            logger.warning("model %s is not prepared: %s", key, exc)

    async def _prepare(self, turn: turns.Turn, session: stores.Session, key: str) -> _Loop:
        """The loop of a turn on model `key`: the model with the tools it may call bound (none when its router
        says no), and the pieces the rounds use."""
        cfg = self.config.models[key]
        tools = self.pipeline.tools.for_model(cfg)
        llm = await built_model(self.llms, self.config, key, self.metrics.on or self.tracing.on, tools)
        if tools and cfg.router and not await router_wants_tools(llm, cfg, _last_user_text(session.history), tools):
            tools = []
        bound = self._bound(llm, cfg, tools) if tools and cfg.tool_mode == "native" else llm
        window, _ = await model_window(self.windows, key, cfg)
        await budget.load_tokenizer()  # at the first turn only: off the event loop

        async def model_call(llm: Any, cfg: ModelConfig, context: list[BaseMessage], client_id: str,
                             hold: TextCallFilter | None) -> AIMessageChunk:
            return await stream_once(llm, cfg, context, client_id, self.hub.tok, self.metrics, self.tracing, hold)

        return _Loop(turn, session, self.hub, model_call, self.pipeline.execute, self.prompt, llm, bound,
                     tools, Request.build(cfg, self.prompt, tools, window),
                     history_cache(self.histories, session.client_id))

    def _bound(self, llm: BaseChatModel, cfg: ModelConfig, tools: list[StructuredTool]) -> Any:
        """`llm` with `tools` bound, made once per model and tool set (a new binding converts every tool and builds
        a RunnableBinding: 90 µs a turn, issue 31). ChatOpenAI takes the schemas as they are; other models the tools."""
        key = (id(llm), *map(id, tools))
        known = self.bindings.get(key)
        if known is None:
            if len(self.bindings) >= MAX_BINDINGS:
                self.bindings.clear()  # tool sets changed that often: start over
            bound = llm.bind_tools([_schema(t)[0] for t in tools] if cfg.type == "OPENAI" else tools)
            known = self.bindings[key] = (llm, list(tools), bound)  # holding them keeps their ids theirs
        return known[2]

    async def dispatch_llm(self, turn: turns.HeldTurn, text: str) -> None:
        """Run one LLM turn of `text` on the turn's model (default: the session's).

        On failure the history is rolled back to how it was before the turn (the user message
        included) and the client gets an `error` event; cancellation rolls back too and propagates. An answer
        whose stream broke off (StreamCut) is an error too, but the turn is kept, its partial answer marked
        as cut off (`cut_answer`).
        """
        session = turn.session
        key = turn.model or session.model
        mark = len(session.history)
        session.history.append({"role": "user", "content": text})
        await self.sessions.save(session)  # kept if this server dies before answering (see SessionManager.hold)
        cfg = self.config.models.get(key)
        attributes = {"gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "agent-mcp",
                      "gen_ai.request.model": cfg.model_id if cfg else key, "agent_mcp.client_class": turn.kind}
        try:
            with self.metrics.turn(turn.kind, key), self.tracing.span("invoke_agent agent-mcp", attributes) as span:
                self.tracing.text(span, "gen_ai.input.messages", text)
                answer = await agentic_lc(await self._prepare(turn, session, key))
                self.tracing.text(span, "gen_ai.output.messages", answer)
        except asyncio.CancelledError:
            # Replaced by a newer message: as if never asked. The server stopping: as if it died (the question stays).
            del session.history[mark + 1 if self.closing() else mark:]
            raise
        except Exception as exc:
            if not from_backend(exc):  # a backend failure is reported below; anything else is a bug to see
                logger.warning("LLM turn of %s on %s failed", session.client_id, key, exc_info=True)
            if isinstance(exc, StreamCut):  # the turn so far is kept: its calls ran, and the answer began
                session.history.append(cut_answer(exc.partial))
                session.history[:] = trim_history(session.history, self.config.models[key].max_context)
            else:
                del session.history[mark:]
            message = describe_llm_error(exc, key, cfg)
            logger.warning("turn of %s failed: %s", session.client_id, message)  # one line, the whole text
            if not client_classes.may_administer(turn):
                # Proxy, Slack and API users learn what failed, not where the backends live.
                message = client_classes.without_locations(self.config, message)
            self.hub.error(session.client_id, message, llm_error_kind(exc))
        else:
            session.history[:] = trim_history(session.history, self.config.models[key].max_context)
