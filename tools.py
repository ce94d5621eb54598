"""The core tools every instance has (system info, the system prompt, delegation, agent_call) and
the swarm client behind agent_call. The registry they are put in is `registry.py`."""

from __future__ import annotations

import asyncio
import hashlib
import json
import platform
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import StructuredTool
from pydantic import BaseModel, Field

import client_classes
import models
import turns
from api_client import AgentClient, AgentClientError, AgentTimeout
from config import SECRET_NAME, AgentTarget, AppConfig
from llm_errors import describe_llm_error
from prompt import PromptError
from registry import ToolError
from text_calls import try_force_tool_calls
from tool_calls import ToolPipeline

if TYPE_CHECKING:
    from langchain_core.language_models import BaseChatModel

    from config import ModelConfig
    from events import EventHub
    from metrics import Metrics
    from prompt import PromptTree
    from sessions import SessionManager
    from tracing import Tracing

# ── Core tools ──────────────────────────────────────────────────────────────────────────────


class _NoArgs(BaseModel):
    pass


class _ReadPromptArgs(BaseModel):
    section: str = Field(default="", description="Section name or index; empty lists all sections")


class _UpdatePromptArgs(BaseModel):
    section: str = Field(description="Name or index of a leaf section (read_system_prompt lists them)")
    operation: Literal["append", "prepend", "replace", "delete", "overwrite"] = Field(
        description="append/prepend content; replace target with content; delete every line containing target; "
                    "overwrite the whole section with content (needs confirm_overwrite)")
    content: str = Field(default="", description="Text to add, or the replacement text")
    target: str = Field(default="", description="replace: exact text to replace; delete: text of the lines to remove")
    confirm_overwrite: bool = Field(default=False, description="Must be true for overwrite, and only when the user "
                                                                "explicitly asked to rewrite the whole section")


class _CleanTextArgs(BaseModel):
    model: str = Field(description="Model key (see llm_list); it must accept delegation")
    prompt: str = Field(description="The complete, self-contained prompt: the model sees nothing else")


class _CleanToolArgs(BaseModel):
    model: str = Field(description="Model key (see llm_list); it must accept delegation")
    tool: str = Field(description="Name of the one tool the model may call")
    arguments: str = Field(description="What to do with the tool, in words or JSON; the model sees nothing else")


class _AgentCallArgs(BaseModel):
    agent_url: str = Field(description="Name of a configured agent (listed in this tool's description)")
    message: str = Field(description="The complete message for the other agent: it does not see this conversation, "
                                     "only its own earlier exchanges with you")
    target_client_id: str = Field(default="", description="Optional: the remote session to use instead of this "
                                                          "conversation's own one (always an api-swarm- session)")


#: Tools llm_clean_tool refuses to hand to another model (no delegation chains, no swarm hops).
NOT_DELEGABLE = frozenset({"llm_clean_text", "llm_clean_tool", "agent_call"})


# ── Swarm calls ─────────────────────────────────────────────────────────────────────────────

SWARM_PREFIX = "api-swarm-"
#: Session setting of `!stream`: whether agent_call relays the other agent's events live (default on).
AGENT_CALL_STREAM = "agent_call_stream"
_REMOTE_ID = re.compile(r"^[A-Za-z0-9._:@-]{1,100}$")


def swarm_client_id(caller: str, url: str, target: str = "") -> str:
    """The remote session of an agent_call: `target` kept in `api-swarm-`, else api-swarm-<md5(caller:url)[:8]>.

    The derived id is stable, so repeated calls from one session to one agent continue one conversation.
    """
    if target:
        return target if target.startswith(SWARM_PREFIX) else SWARM_PREFIX + target.removeprefix("api-")
    return SWARM_PREFIX + hashlib.md5(f"{caller}:{url}".encode(), usedforsecurity=False).hexdigest()[:8]


def find_agent(agents: dict[str, AgentTarget], ref: str) -> tuple[str, AgentTarget] | None:
    """The configured agent named `ref`, or whose URL is `ref` (trailing slash ignored)."""
    ref = ref.strip()
    if ref in agents:
        return ref, agents[ref]
    return next(((n, t) for n, t in agents.items() if t.url == ref.rstrip("/")), None)


def _agents_listing(agents: dict[str, AgentTarget]) -> str:
    """The configured agents for the model: names and descriptions, never where they run."""
    return "; ".join(f"{n}{': ' + t.description if t.description else ''}" for n, t in agents.items()) \
        or "none configured (an operator lists them in agents.json)"


def target_token(config: AppConfig, own_credentials: Callable[[], set[str]], name: str, target: AgentTarget
                 ) -> tuple[str | None, str | None]:
    """(token to present to the target or None, problem) — never one of this server's own credentials (its
    secrets in `config.env`, the models' keys, and `own_credentials()`: the loaded client plugins' tokens)."""
    if target.token_env is None:
        return None, None
    env = config.env
    token = env.get(target.token_env)
    if not token:
        return None, f"{target.token_env} (the token of agent '{name}') is not set; an operator puts it into .env"
    models = [k for k, m in config.models.items() if m.env_key == target.token_env]
    own = {v for k, v in env.items() if k != target.token_env and SECRET_NAME.search(k) and v}
    own |= own_credentials()
    if models or token in own:
        return None, (f"the token in {target.token_env} is one of this server's own credentials, which are never sent "
                      f"to another agent; an operator gives agent '{name}' a token it issued itself (agents.json)")
    return token, None


@dataclass(frozen=True)
class Swarm:
    """What agent_call uses of its instance: the configured agents, the credentials never sent to them (the
    loaded client plugins' tokens), the caller's session (its `!stream` setting) and stream, and the trace
    context that goes along."""

    config: AppConfig
    own_credentials: Callable[[], set[str]]
    sessions: SessionManager
    hub: EventHub
    tracing: Tracing


async def call_agent(swarm: Swarm, turn: turns.Turn | None, ref: str, message: str,
                     target_client_id: str = "") -> str:
    """One swarm call (the agent_call tool) of `turn`: checks, then the remote turn, relayed live unless
    `!stream off`. A refused or failed call raises ToolError. The one-hop rule reads the class the request's
    plugin stated; a call outside any request, whose class nobody stated, is refused (fail closed)."""
    if turn is None:
        raise ToolError("agent_call refused: it runs only as a tool call of a request (nobody vouched for this "
                        "caller's client class).")
    if turn.kind == client_classes.SWARM:
        raise ToolError("agent_call refused: this conversation is itself an agent_call from another agent, and agents "
                        "call each other at most 1 hop deep. Answer with what you know instead.")
    caller = turn.client_id
    found = find_agent(swarm.config.agents, ref)
    if found is None:
        raise ToolError(f"agent_call refused: '{ref}' is not a configured agent, and only configured agents may be "
                        f"called. Configured: {_agents_listing(swarm.config.agents)}.")
    name, target = found
    token, problem = target_token(swarm.config, swarm.own_credentials, name, target)
    if problem:
        raise ToolError(f"agent_call refused: {problem}.")
    if target_client_id and not _REMOTE_ID.match(target_client_id):
        raise ToolError("target_client_id may use 1-100 letters, digits and . _ : @ - only; leave it empty normally.")
    remote = swarm_client_id(caller, target.url, target_client_id)
    session = swarm.sessions.get(caller)
    relay = session is None or session.settings.get(AGENT_CALL_STREAM, True) is not False
    # `or ""`: without a token of its own the call carries none (never this server's API_KEY or key file).
    # The trace context of this tool call's span goes along, so the other agent's turn joins this trace.
    client = AgentClient(target.url, remote, api_key=token or "", default_timeout=target.timeout,
                         headers=swarm.tracing.headers())
    parts: list[str] = []
    error = ended = None
    try:
        async for ev in client.events(message):
            if ev.name == "tok":
                parts.append(ev.text)
                if relay:
                    swarm.hub.tok(caller, ev.text)
            elif ev.name == "error":
                error = ev.text
            elif ev.ends_turn:
                ended = ev.name
            elif ev.name == "status" and relay and ev.text:
                swarm.hub.status(caller, f"[{name}] {ev.text}")
    except AgentTimeout:
        error = f"no answer within {target.timeout:g} s (the timeout of '{name}' in agents.json)"
    except AgentClientError as exc:
        error = str(exc)
    answer = "".join(parts)
    if relay and answer and not answer.endswith("\n"):
        swarm.hub.tok(caller, "\n\n")  # the caller's own answer starts on a new paragraph
    if ended not in (None, "done"):
        error = "the remote turn was cancelled (a newer message replaced it)"
    if error is not None:
        raise ToolError(f"agent_call to '{name}' failed: {error}" + (f"\nPartial answer:\n{answer}" if answer else ""))
    return f"Answer of agent '{name}' (its session {remote}):\n{answer}"


def _this_turn() -> turns.Turn:
    """The turn a core tool runs in (the tool pipeline sets it); outside one, nobody's (least privilege)."""
    return turns.current_turn() or turns.Turn("", uuid.uuid4().hex[:16], client_classes.UNKNOWN)


@dataclass(frozen=True)
class CoreParts:
    """What the core tools use of their instance (built once by build.py): the configuration, the system
    prompt, the tool pipeline (its registry lists the tools and gives the delegated one), the chat models and
    their windows, the telemetry the models report to, what agent_call uses, and when the instance started."""

    config: AppConfig
    prompt: PromptTree
    pipeline: ToolPipeline
    #: model key → LangChain chat model, built once and reused (the runtime's `llms`).
    llms: dict[str, BaseChatModel]
    #: model key → (context window in tokens, where that number comes from) (the runtime's `windows`).
    windows: dict[str, tuple[int, str]]
    metrics: Metrics
    tracing: Tracing
    swarm: Swarm
    started: float = field(default_factory=time.time)


def make_core_tools(parts: CoreParts) -> list[StructuredTool]:
    """The tools every instance has, as closures over the parts of it they use (gates in CORE_GATES)."""
    config, tree, registry, windows = parts.config, parts.prompt, parts.pipeline.tools, parts.windows
    usage = parts.metrics.on or parts.tracing.on  # chat models report their token counts when either listens

    async def get_system_info() -> str:
        turn = turns.current_turn()
        client_id, session = (turn.client_id, turn.session) if turn else (None, None)
        # The host's name and kernel only for a turn an admin started (shell, admin API): not the others' business.
        host = (f"{platform.node()} ({platform.system()} {platform.release()}, " if client_classes.may_administer(turn)
                else "<hidden> (") + f"Python {platform.python_version()})"
        lines = [
            f"Local time: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}",
            f"Host: {host}",
            f"Uptime: {int(time.time() - parts.started)} s",
            f"Session: {client_id or '-'}" + (f" (#{session.shorthand}, model {session.model})" if session else ""),
            f"Tools: {', '.join(registry.names())}",
        ]
        return "\n".join(lines)

    async def read_system_prompt(section: str = "") -> str:
        if not section.strip():
            rows = [
                f"{i:>3} {'  ' * s.depth}{s.name}{' [container]' if s.is_container else ''} — {s.description}"
                for i, s in enumerate(tree.sections)
            ]
            return "System prompt sections (index, name):\n" + "\n".join(rows)
        try:
            return tree.render(section)
        except PromptError as exc:
            raise ToolError(str(exc)) from None

    async def update_system_prompt(
        section: str, operation: str, content: str = "", target: str = "", confirm_overwrite: bool = False
    ) -> str:
        try:
            return tree.apply(section, operation, content, target, confirm_overwrite)
        except PromptError as exc:
            return f"Prompt update rejected: {exc}"

    async def llm_list() -> str:
        turn = turns.current_turn()
        session = turn.session if turn else None
        rows = []
        for key, m in config.models.items():
            mark = " (this session's model)" if session and session.model == key else ""
            rows.append(
                f"- {key}{mark}: {m.type} {m.model_id}; delegation {'YES' if m.tool_call_available else 'no'}, "
                f"timeout {m.llm_call_timeout:g} s, max_context {m.max_context}"
                + (f", window {windows[key][0]:,} tokens ({windows[key][1]})" if key in windows else "")
                + (f"\n  {m.description}" if m.description else "")
            )
        return ("Models (llm_clean_text / llm_clean_tool accept only those with delegation YES):\n"
                + "\n".join(rows))

    def delegate(model: str) -> ModelConfig:
        cfg = config.models.get(model)
        if cfg is None:
            raise ToolError(f"unknown model '{model}'. Models: {', '.join(config.models)} (llm_list).")
        if not cfg.tool_call_available:
            raise ToolError(f"model '{model}' does not accept delegation (tool_call_available is false). "
                            f"Pick another model from llm_list, or the user can enable it with !llm_call {model} true.")
        return cfg

    async def llm_clean_text(model: str, prompt: str) -> str:
        cfg = delegate(model)
        try:
            llm = await models.built_model(parts.llms, config, model, usage)
            async with asyncio.timeout(cfg.llm_call_timeout):
                reply = await llm.ainvoke([HumanMessage(prompt)])
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            raise ToolError(f"llm_clean_text: {describe_llm_error(exc, model, cfg)}") from None
        return models.content_text(reply.content)

    def tool_instructions(tool: StructuredTool) -> str:
        for ident in (f"tool-{tool.name.replace('_', '-')}", f"tool_{tool.name}"):
            try:
                return tree.render(ident)
            except PromptError:
                continue
        return f"Call the tool {tool.name} once to do what the user asks. {tool.description}"

    async def llm_clean_tool(model: str, tool: str, arguments: str) -> str:
        cfg = delegate(model)
        target = registry.get(tool)
        if target is None:
            raise ToolError(f"unknown tool '{tool}'. Available tools: {', '.join(registry.names())}")
        if tool in NOT_DELEGABLE:
            raise ToolError(f"{tool} cannot be delegated; call it yourself.")
        llm = await models.built_model(parts.llms, config, model, usage)
        messages: list[Any] = [SystemMessage(tool_instructions(target)), HumanMessage(arguments)]
        try:
            async with asyncio.timeout(cfg.llm_call_timeout):
                first = await llm.bind_tools([target]).ainvoke(messages)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            raise ToolError(f"llm_clean_tool: {describe_llm_error(exc, model, cfg)}") from None
        said = models.content_text(first.content)
        native = [c for c in first.tool_calls if c["name"] == tool]
        calls = native or try_force_tool_calls(said, {tool: target})[0]
        if not calls:
            return f"{model} did not call {tool}; it answered: {said}"
        args: dict[str, Any] = calls[0]["args"]
        call = {"id": calls[0].get("id") or f"call_{uuid.uuid4().hex[:12]}", "name": tool, "args": args}
        # The call goes through the normal pipeline: rate limit, gate, executor (outside the timeout).
        result = (await parts.pipeline.execute(_this_turn(), tool, args)).text
        if native:
            messages += [AIMessage(said, tool_calls=[{**call, "type": "tool_call"}]),
                         ToolMessage(result, tool_call_id=call["id"], name=tool)]
        else:
            messages += [AIMessage(said), HumanMessage(f"[Tool result for {tool}]:\n{result}")]
        try:
            async with asyncio.timeout(cfg.llm_call_timeout):
                final = await llm.ainvoke(messages)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            return (f"{model} called {tool}({json.dumps(call['args'], ensure_ascii=False)}) but could not summarise "
                    f"({describe_llm_error(exc, model, cfg)}). Raw result:\n{result}")
        return (f"{model} called {tool}({json.dumps(call['args'], ensure_ascii=False)}).\n"
                f"{models.content_text(final.content)}")

    async def agent_call(agent_url: str, message: str, target_client_id: str = "") -> str:
        return await call_agent(parts.swarm, turns.current_turn(), agent_url, message, target_client_id)

    def tool(fn: Callable[..., Any], schema: type[BaseModel], description: str) -> StructuredTool:
        return StructuredTool.from_function(coroutine=fn, name=fn.__name__, description=description,
                                            args_schema=schema)

    return [
        tool(get_system_info, _NoArgs, "Current date and time, host, uptime, this session and the loaded tools."),
        tool(read_system_prompt, _ReadPromptArgs,
             "Read your system prompt: list its sections, or one section by name or index."),
        tool(update_system_prompt, _UpdatePromptArgs,
             "Edit one leaf section of your system prompt (needs the user's approval). Never reconstruct or "
             "rewrite the whole prompt; change only what the user asked for. Containers cannot be edited."),
        tool(llm_list, _NoArgs, "List the models you can delegate to, with their timeouts and descriptions."),
        tool(llm_clean_text, _CleanTextArgs,
             "Send one self-contained prompt to another model (no history, no tools) and get its answer: "
             "for summaries, classification, drafts."),
        tool(llm_clean_tool, _CleanToolArgs,
             "Let another model make one call of one tool from a plain description, then summarise the result."),
        tool(agent_call, _AgentCallArgs,
             "Ask another agent-mcp agent, which answers with its own model and tools and remembers your earlier "
             f"messages to it. Agents: {_agents_listing(config.agents)}"),
    ]
