"""The tool registry: core tools and plugin tools, all LangChain `StructuredTool`s.

Each tool's pydantic `args_schema` is the single source of truth for every backend; executors are
taken from `StructuredTool.coroutine`. Which tools a model sees is set per model by `llm_tools`.
"""

from __future__ import annotations

import platform
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from langchain_core.tools import StructuredTool
from langchain_core.utils.function_calling import convert_to_openai_tool
from pydantic import BaseModel, Field

import state

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


class ToolRegistry:
    """Every tool of one server instance, by name, in registration order."""

    def __init__(self) -> None:
        self._tools: dict[str, RegisteredTool] = {}

    def register(self, tool: StructuredTool, owner: str = CORE) -> None:
        tool = _check_tool(tool, owner)
        other = self._tools.get(tool.name)
        if other is not None:
            raise ToolRegistrationError(
                f"{owner}: tool '{tool.name}' is already provided by {other.owner}; rename one of them"
            )
        self._tools[tool.name] = RegisteredTool(tool, owner)

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
            if not isinstance(spec, dict) or not isinstance(spec.get("type"), str):
                raise ToolRegistrationError(f"{plugin_name}: gate of '{name}' needs a 'type' string")
            entry.gate = dict(spec)

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


def make_core_tools(rt: state.Runtime) -> list[StructuredTool]:
    """The tools every instance has, as closures over its runtime."""

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
        if section.strip():
            return tree.render(section)
        rows = [
            f"{i:>3} {'  ' * s.depth}{s.name}{' [container]' if s.is_container else ''} — {s.description}"
            for i, s in enumerate(tree.sections)
        ]
        return "System prompt sections (index, name):\n" + "\n".join(rows)

    return [
        StructuredTool.from_function(
            coroutine=get_system_info,
            name="get_system_info",
            description="Current date and time, host, uptime, this session and the loaded tools.",
            args_schema=_NoArgs,
        ),
        StructuredTool.from_function(
            coroutine=read_system_prompt,
            name="read_system_prompt",
            description="Read your system prompt: list its sections, or one section by name or index.",
            args_schema=_ReadPromptArgs,
        ),
    ]
