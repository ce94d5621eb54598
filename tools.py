"""The tool registry: core tools and plugin tools, all LangChain `StructuredTool`s.

Each tool's pydantic `args_schema` is the single source of truth for every backend; executors are
taken from `StructuredTool.coroutine`. Which tools a model sees is set per model by `llm_tools`.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import platform
import re
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import StructuredTool
from langchain_core.utils.function_calling import convert_to_openai_tool
from pydantic import BaseModel, Field

import agents
import gate
import state
from api_client import AgentClient, AgentClientError, AgentTimeout
from config import SECRET_NAME, AgentTarget
from prompt import PromptError

if TYPE_CHECKING:
    from config import ModelConfig

CORE = "core"


class ToolRegistrationError(ValueError):
    """A plugin handed over a tool that cannot be registered; the message says what to fix."""


@dataclass
class RegisteredTool:
    """A tool, who provided it, and how it is gated (filled by `register_gate_tools`)."""

    tool: StructuredTool
    owner: str
    gate: dict[str, Any] = field(default_factory=dict)


def _lc_tool_to_openai_dict(tool: StructuredTool) -> dict[str, Any]:
    """The OpenAI `{"type": "function", "function": {...}}` form of a tool."""
    return convert_to_openai_tool(tool)


def _check_tool(tool: Any, owner: str) -> StructuredTool:
    if not isinstance(tool, StructuredTool):
        raise ToolRegistrationError(f"{owner}: {tool!r} is not a langchain StructuredTool")
    if not tool.name.isidentifier():
        raise ToolRegistrationError(f"{owner}: tool name {tool.name!r} is not a valid identifier")
    if tool.coroutine is None:
        raise ToolRegistrationError(f"{owner}: tool '{tool.name}' has no async coroutine executor")
    schema = tool.args_schema
    if not (isinstance(schema, type) and issubclass(schema, BaseModel)):
        raise ToolRegistrationError(f"{owner}: tool '{tool.name}' needs a pydantic BaseModel args_schema")
    return tool


def _check_gate(spec: Any, name: str, owner: str) -> dict[str, Any]:
    """A gate declaration `{"type": str, "operation": "read" | "write" | callable}`, checked."""
    if not spec:
        return {}
    if not isinstance(spec, dict) or not isinstance(spec.get("type"), str) or not spec["type"]:
        raise ToolRegistrationError(f"{owner}: gate of '{name}' needs a 'type' string (db, search, drive, ...)")
    operation = spec.get("operation", "read")
    if not callable(operation) and operation not in ("read", "write"):
        raise ToolRegistrationError(f"{owner}: gate of '{name}': operation must be 'read', 'write' or a callable")
    return dict(spec)


class ToolRegistry:
    """Every tool of one server instance, by name, in registration order."""

    def __init__(self) -> None:
        self._tools: dict[str, RegisteredTool] = {}

    def register(self, tool: StructuredTool, owner: str = CORE, gate: dict[str, Any] | None = None) -> None:
        tool = _check_tool(tool, owner)
        other = self._tools.get(tool.name)
        if other is not None:
            raise ToolRegistrationError(
                f"{owner}: tool '{tool.name}' is already provided by {other.owner}; rename one of them"
            )
        self._tools[tool.name] = RegisteredTool(tool, owner, _check_gate(gate or {}, tool.name, owner))

    def register_plugin_tools(self, plugin_name: str, tools: dict[str, Any]) -> list[str]:
        """Register a plugin's `get_tools()` result (`{"lc": [StructuredTool, ...]}`); all or nothing."""
        if not isinstance(tools, dict) or not isinstance(tools.get("lc", []), list):
            raise ToolRegistrationError(f"{plugin_name}: get_tools() must return {{'lc': [StructuredTool, ...]}}")
        checked = [_check_tool(t, plugin_name) for t in tools.get("lc", [])]
        names = [t.name for t in checked]
        clashes = [n for n in names if n in self._tools] + [n for n in set(names) if names.count(n) > 1]
        if clashes:
            raise ToolRegistrationError(f"{plugin_name}: tool name(s) already registered: {', '.join(clashes)}")
        for t in checked:
            self.register(t, plugin_name)
        return names

    def register_gate_tools(self, plugin_name: str, gates: dict[str, Any]) -> None:
        """Record the gate description of each tool (`{"tool": {"type": ..., ...}}`)."""
        for name, spec in (gates or {}).items():
            entry = self._tools.get(name)
            if entry is None or entry.owner != plugin_name:
                raise ToolRegistrationError(f"{plugin_name}: get_gate_tools() names '{name}', not one of its tools")
            entry.gate = _check_gate(spec, name, plugin_name)

    def replace_plugin_tools(self, plugin_name: str, tools: dict[str, Any], gates: dict[str, Any]) -> list[str]:
        """Swap every tool of a running plugin for a new set with its gates; all or nothing.

        For plugins whose tools change while the server runs (an MCP server's tool list). On any
        problem the old tools stay registered and ToolRegistrationError says why.
        """
        old = {n: t for n, t in self._tools.items() if t.owner == plugin_name}
        for name in old:
            del self._tools[name]
        try:
            names = self.register_plugin_tools(plugin_name, tools)
            self.register_gate_tools(plugin_name, gates)
        except ToolRegistrationError:
            self.unregister_owner(plugin_name)
            self._tools.update(old)
            raise
        return names

    def unregister_owner(self, owner: str) -> None:
        for name in [n for n, t in self._tools.items() if t.owner == owner]:
            del self._tools[name]

    def get(self, name: str) -> StructuredTool | None:
        entry = self._tools.get(name)
        return entry.tool if entry else None

    def entry(self, name: str) -> RegisteredTool | None:
        return self._tools.get(name)

    def executor(self, name: str) -> Callable[..., Any] | None:
        tool = self.get(name)
        return tool.coroutine if tool else None

    def names(self) -> list[str]:
        return list(self._tools)

    def entries(self) -> Iterable[RegisteredTool]:
        return self._tools.values()

    def for_model(self, model: ModelConfig) -> list[StructuredTool]:
        """The tools a model may call: all, or the names in its `llm_tools` list that exist."""
        if model.llm_tools == "all":
            return [t.tool for t in self._tools.values()]
        return [self._tools[n].tool for n in model.llm_tools if n in self._tools]

    def openai_schemas(self, model: ModelConfig | None = None) -> list[dict[str, Any]]:
        tools = self.for_model(model) if model else [t.tool for t in self._tools.values()]
        return [_lc_tool_to_openai_dict(t) for t in tools]


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


def target_token(rt: state.Runtime, name: str, target: AgentTarget) -> tuple[str | None, str | None]:
    """(token to present to the target or None, problem) — never one of this server's own credentials."""
    if target.token_env is None:
        return None, None
    env = rt.config.env
    token = env.get(target.token_env)
    if not token:
        return None, f"{target.token_env} (the token of agent '{name}') is not set; an operator puts it into .env"
    models = [k for k, m in rt.config.models.items() if m.env_key == target.token_env]
    own = {v for k, v in env.items() if k != target.token_env and SECRET_NAME.search(k) and v}
    for plugin in rt.plugins.client_plugins() if rt.plugins else []:
        cfg = plugin.get_config()
        own |= {cfg[k] for k in ("token", "admin_token") if cfg.get(k)}
    if models or token in own:
        return None, (f"the token in {target.token_env} is one of this server's own credentials, which are never sent "
                      f"to another agent; an operator gives agent '{name}' a token it issued itself (agents.json)")
    return token, None


async def call_agent(rt: state.Runtime, caller: str, ref: str, message: str, target_client_id: str = "") -> str:
    """One swarm call (the agent_call tool): checks, then the remote turn, relayed live unless `!stream off`."""
    if gate.client_class(caller) == gate.SWARM:
        return ("ERROR: agent_call refused: this conversation is itself an agent_call from another agent, and agents "
                "call each other at most 1 hop deep. Answer with what you know instead.")
    found = find_agent(rt.config.agents, ref)
    if found is None:
        return (f"ERROR: agent_call refused: '{ref}' is not a configured agent, and only configured agents may be "
                f"called. Configured: {_agents_listing(rt.config.agents)}.")
    name, target = found
    token, problem = target_token(rt, name, target)
    if problem:
        return f"ERROR: agent_call refused: {problem}."
    if target_client_id and not _REMOTE_ID.match(target_client_id):
        return "ERROR: target_client_id may use 1-100 letters, digits and . _ : @ - only; leave it empty normally."
    remote = swarm_client_id(caller, target.url, target_client_id)
    session = rt.sessions.get(caller)
    relay = session is None or session.settings.get(AGENT_CALL_STREAM, True) is not False
    client = AgentClient(target.url, remote, api_key=token, default_timeout=target.timeout)
    parts: list[str] = []
    error = ended = None
    try:
        async for ev in client.events(message):
            if ev.name == "tok":
                parts.append(ev.text)
                if relay:
                    rt.hub.tok(caller, ev.text)
            elif ev.name == "error":
                error = ev.text
            elif ev.ends_turn:
                ended = ev.name
            elif ev.name == "status" and relay and ev.text:
                rt.hub.status(caller, f"[{name}] {ev.text}")
    except AgentTimeout:
        error = f"no answer within {target.timeout:g} s (the timeout of '{name}' in agents.json)"
    except AgentClientError as exc:
        error = str(exc)
    answer = "".join(parts)
    if relay and answer and not answer.endswith("\n"):
        rt.hub.tok(caller, "\n\n")  # the caller's own answer starts on a new paragraph
    if ended not in (None, "done"):
        error = "the remote turn was cancelled (a newer message replaced it)"
    if error is not None:
        return f"ERROR: agent_call to '{name}' failed: {error}" + (f"\nPartial answer:\n{answer}" if answer else "")
    return f"Answer of agent '{name}' (its session {remote}):\n{answer}"


def make_core_tools(rt: state.Runtime) -> list[StructuredTool]:
    """The tools every instance has, as closures over its runtime (gates in CORE_GATES)."""

    async def get_system_info() -> str:
        client_id = state.current_client_id.get()
        session = rt.sessions.get(client_id) if client_id else None
        lines = [
            f"Local time: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}",
            f"Host: {platform.node()} ({platform.system()} {platform.release()}, Python {platform.python_version()})",
            f"Uptime: {int(time.time() - rt.started)} s",
            f"Session: {client_id or '-'}" + (f" (#{session.shorthand}, model {session.model})" if session else ""),
            f"Tools: {', '.join(rt.tools.names())}",
        ]
        return "\n".join(lines)

    async def read_system_prompt(section: str = "") -> str:
        tree = rt.prompt
        if not section.strip():
            rows = [
                f"{i:>3} {'  ' * s.depth}{s.name}{' [container]' if s.is_container else ''} — {s.description}"
                for i, s in enumerate(tree.sections)
            ]
            return "System prompt sections (index, name):\n" + "\n".join(rows)
        try:
            return tree.render(section)
        except PromptError as exc:
            return f"ERROR: {exc}"

    async def update_system_prompt(
        section: str, operation: str, content: str = "", target: str = "", confirm_overwrite: bool = False
    ) -> str:
        try:
            return rt.prompt.apply(section, operation, content, target, confirm_overwrite)
        except PromptError as exc:
            return f"Prompt update rejected: {exc}"

    async def llm_list() -> str:
        client_id = state.current_client_id.get()
        session = rt.sessions.get(client_id) if client_id else None
        rows = []
        for key, m in rt.config.models.items():
            mark = " (this session's model)" if session and session.model == key else ""
            rows.append(f"- {key}{mark}: {m.type} {m.model_id}; delegation {'YES' if m.tool_call_available else 'no'}, "
                        f"timeout {m.llm_call_timeout:g} s, max_context {m.max_context}"
                        + (f", window {rt.windows[key][0]:,} tokens ({rt.windows[key][1]})" if key in rt.windows else "")
                        + (f"\n  {m.description}" if m.description else ""))
        return ("Models (llm_clean_text / llm_clean_tool accept only those with delegation YES):\n"
                + "\n".join(rows))

    def delegate(model: str) -> tuple[ModelConfig | None, str]:
        cfg = rt.config.models.get(model)
        if cfg is None:
            return None, f"ERROR: unknown model '{model}'. Models: {', '.join(rt.config.models)} (llm_list)."
        if not cfg.tool_call_available:
            return None, (f"ERROR: model '{model}' does not accept delegation (tool_call_available is false). "
                          f"Pick another model from llm_list, or the user can enable it with !llm_call {model} true.")
        return cfg, ""

    async def llm_clean_text(model: str, prompt: str) -> str:
        cfg, error = delegate(model)
        if cfg is None:
            return error
        try:
            llm = agents.chat_model(rt, model)
            async with asyncio.timeout(cfg.llm_call_timeout):
                reply = await llm.ainvoke([HumanMessage(prompt)])
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            return f"ERROR: llm_clean_text: {agents.describe_llm_error(exc, model, cfg)}"
        return agents.content_text(reply.content)

    def tool_instructions(tool: StructuredTool) -> str:
        for ident in (f"tool-{tool.name.replace('_', '-')}", f"tool_{tool.name}"):
            try:
                return rt.prompt.render(ident)
            except PromptError:
                continue
        return f"Call the tool {tool.name} once to do what the user asks. {tool.description}"

    async def llm_clean_tool(model: str, tool: str, arguments: str) -> str:
        cfg, error = delegate(model)
        if cfg is None:
            return error
        target = rt.tools.get(tool)
        if target is None:
            return f"ERROR: unknown tool '{tool}'. Available tools: {', '.join(rt.tools.names())}"
        if tool in NOT_DELEGABLE:
            return f"ERROR: {tool} cannot be delegated; call it yourself."
        llm = agents.chat_model(rt, model)
        messages: list[Any] = [SystemMessage(tool_instructions(target)), HumanMessage(arguments)]
        try:
            async with asyncio.timeout(cfg.llm_call_timeout):
                first = await llm.bind_tools([target]).ainvoke(messages)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            return f"ERROR: llm_clean_tool: {agents.describe_llm_error(exc, model, cfg)}"
        said = agents.content_text(first.content)
        native = [c for c in first.tool_calls if c["name"] == tool]
        calls = native or agents.try_force_tool_calls(said, {tool: target})[0]
        if not calls:
            return f"{model} did not call {tool}; it answered: {said}"
        call = {"id": calls[0].get("id") or f"call_{uuid.uuid4().hex[:12]}", "name": tool, "args": calls[0]["args"]}
        # The call goes through the normal pipeline: rate limit, gate, executor (outside the timeout).
        result = await agents.execute_tool(rt, state.current_client_id.get() or "", tool, call["args"])
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
                    f"({agents.describe_llm_error(exc, model, cfg)}). Raw result:\n{result}")
        return (f"{model} called {tool}({json.dumps(call['args'], ensure_ascii=False)}).\n"
                f"{agents.content_text(final.content)}")

    async def agent_call(agent_url: str, message: str, target_client_id: str = "") -> str:
        return await call_agent(rt, state.current_client_id.get() or "", agent_url, message, target_client_id)

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
             f"messages to it. Agents: {_agents_listing(rt.config.agents)}"),
    ]
