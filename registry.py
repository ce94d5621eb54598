"""The tool registry: core tools and plugin tools, all LangChain `StructuredTool`s.

Each tool's pydantic `args_schema` is the single source of truth for every backend; executors are
taken from `StructuredTool.coroutine`. Which tools a model sees is set per model by `llm_tools`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from langchain_core.tools import StructuredTool
from langchain_core.utils.function_calling import convert_to_openai_tool
from pydantic import BaseModel

if TYPE_CHECKING:
    from config import ModelConfig

CORE = "core"


class ToolRegistrationError(ValueError):
    """A plugin handed over a tool that cannot be registered; the message says what to fix."""


class ToolError(Exception):
    """A tool's own failure, raised by the tool: the message says what failed and what to do. The tool
    pipeline (tool_calls.py) gives the model `ERROR: <message>` as the result, without locations, and
    counts the call as failed. Anything else a tool raises is reported as a bug of that tool."""


@dataclass
class RegisteredTool:
    """A tool, who provided it, and how it is gated (filled by `register_gate_tools`)."""

    tool: StructuredTool
    owner: str
    gate: dict[str, Any] = field(default_factory=dict)

    @property
    def args_model(self) -> type[BaseModel]:
        """The pydantic model of the tool's arguments (registration refuses a tool without one)."""
        schema = self.tool.args_schema
        if not (isinstance(schema, type) and issubclass(schema, BaseModel)):
            raise ToolRegistrationError(f"{self.owner}: tool '{self.tool.name}' needs a pydantic BaseModel args_schema")
        return schema


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

    def register_plugin_tools(self, plugin_name: str, tools: object) -> list[str]:
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
