"""MCP client: the tools of external MCP servers (stdio and Streamable HTTP) as agent-mcp tools.

Servers are listed in `mcp-servers.json` in the config directory. At start every enabled server is
connected; each of its tools becomes a `StructuredTool` named `<server>_<tool>` whose argument
schema is the server's own input schema, registered with every other tool (so `llm_tools`, rate
limits and gates apply; gate type `mcp`). A server that cannot start is reported (log, /health,
`!mcp`) and skipped. A server that dies is reconnected on the next call of one of its tools; a
tool-list change announced by the server replaces its tools in the registry; shutdown closes
every session and stops every child process. `!mcp` lists servers, status and tools.

Each connection lives in its own task, so the SDK's task groups and cancel scopes are entered
and left in one task whatever task calls a tool.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import plugin_api
from plugin_api import BasePlugin, PluginSettings, parse_settings
from plugins._mcp_servers import (
    McpServersFile,
    McpTool,
    StdioServer,
    _args_model,
    _llm_schema,
    exposed_name,
    load_servers,
)

# The MCP SDK (about 20 MiB of code) is imported when mcp-servers.json enables a server (init).
if TYPE_CHECKING:
    import mcp_types as types

    from plugins._mcp_connection import Connection
    from plugins._mcp_fence import Host

logger = logging.getLogger("agent_mcp.mcp_client")

MCP_SERVERS_FILE = "mcp-servers.json"
GATE_TYPE = "mcp"


# ── The plugin ──────────────────────────────────────────────────────────────────────────────


class McpClientPlugin(BasePlugin):
    """Tools of the MCP servers in mcp-servers.json, with `!mcp` to see them."""

    PLUGIN_NAME = "plugin_mcp_client"
    PLUGIN_VERSION = "1.0.0"
    PLUGIN_TYPE = "data_tool"
    DESCRIPTION = "Tools of external MCP servers (stdio, Streamable HTTP) listed in mcp-servers.json"
    DEPENDENCIES = ["mcp", "httpx2", "jsonschema"]

    def __init__(self) -> None:
        super().__init__()
        self.servers: dict[str, Connection] = {}
        self.config_file: Path | None = None
        #: exposed tool name → (server, MCP tool name), as of the last registration.
        self._routes: dict[str, tuple[str, str]] = {}
        self._skipped: dict[str, str] = {}
        #: Set, then replaced, whenever a server's status or tools change: await it to follow them.
        self.changed = asyncio.Event()

    async def init(self, config: dict[str, Any]) -> bool:
        assert self.context is not None
        parse_settings(
            self.PLUGIN_NAME, PluginSettings, config
        )  # no settings but `enabled` (servers: mcp-servers.json)
        app = self.context.config
        self.config_file = app.path(MCP_SERVERS_FILE)
        servers = load_servers(self.config_file)
        secret_files = tuple(Path(v) for k, v in app.env.items()
                             if k.startswith("AGENT_") and k.endswith("_FILE") and v and Path(v).is_absolute())
        host = await self._sandbox(servers, app.config_dir, app.data_dir(), app.env.get("PATH"), secret_files)
        for name, spec in servers.servers.items():
            if spec.enabled:
                from plugins._mcp_connection import Connection  # the MCP SDK, imported with a server to connect
                self.servers[name] = Connection(name, spec, app.env, app.config_dir, self._server_changed,
                                                self._elicitation, sandbox=host)
        await asyncio.gather(*(c.connect() for c in self.servers.values()))
        return True

    @staticmethod
    async def _sandbox(servers: McpServersFile, config_dir: Path, data_dir: Path, path: str | None,
                       secret_files: tuple[Path, ...]) -> Host | None:
        """Look for bubblewrap once, when a stdio server may use it, and say at start whether servers are fenced."""
        stdio = [s for s in servers.servers.values() if s.enabled and isinstance(s, StdioServer)]
        if not stdio:
            return None
        from plugins._mcp_fence import INSTALL_HINT, Host, find_sandbox
        if all(s.sandbox == "off" for s in stdio):
            logger.warning("MCP stdio servers are NOT sandboxed: every entry says \"sandbox\": \"off\"; they run "
                           "with resource limits and only their declared environment")
            return Host(config_dir, data_dir, None, "\"sandbox\": \"off\"")
        bwrap, why, flags = await find_sandbox(path)
        if bwrap:
            logger.info("MCP stdio servers run in a bubblewrap sandbox (%s): no view of %s, %s or .env, a read-only "
                        "filesystem but for their own dir, cwd and a private /tmp, no network unless their entry "
                        "says \"network\": \"host\"; with resource limits", bwrap, config_dir, data_dir)
        else:
            logger.warning("MCP stdio servers are NOT sandboxed: %s. With bubblewrap (%s) they could not read %s, %s "
                           "or .env, nor reach the network; now they run only with resource limits and their "
                           "declared environment", why, INSTALL_HINT, config_dir, data_dir)
        return Host(config_dir, data_dir, bwrap, why, secret_files, flags)

    async def shutdown(self) -> None:
        await asyncio.gather(*(c.close() for c in self.servers.values()))

    async def _elicitation(self, conn: Connection, exposed: str, turn: plugin_api.Turn | None,
                           params: types.ElicitRequestParams) -> types.ElicitResult:
        """A server's question during a tool call: asked as a gate of the calling turn (plugins/_mcp_asks.py)."""
        from plugins import _mcp_asks
        assert self.context is not None
        with plugin_api.running(turn):  # what it tells the session belongs to the turn (its client's stream)
            return await _mcp_asks.ask(self.context, conn.name, exposed or f"{conn.name} (a tool)", turn, params,
                                       max(1.0, conn.spec.call_timeout - 5))

    # ── tools ──

    def _tool(self, conn: Connection, tool: types.Tool, exposed: str) -> McpTool:
        async def run(**arguments: Any) -> str:
            return await conn.call(exposed, tool.name, arguments)

        description = (tool.description or tool.title or f"Tool '{tool.name}'").strip()
        return McpTool(
            name=exposed,
            description=f"{description}\n(MCP server '{conn.name}')",
            args_schema=_args_model(exposed, tool.input_schema),
            coroutine=run,
            mcp_schema=_llm_schema(tool.input_schema),
            metadata={"mcp_server": conn.name, "mcp_tool": tool.name},
        )

    def _collect(self) -> tuple[list[McpTool], dict[str, dict[str, Any]]]:
        """Every server's tools and their gates; a name already taken is skipped and remembered."""
        assert self.context is not None
        registry = self.context.tools
        tools: list[McpTool] = []
        gates: dict[str, dict[str, Any]] = {}
        routes: dict[str, tuple[str, str]] = {}
        skipped: dict[str, str] = {}
        for conn in self.servers.values():
            for tool in conn.tools:
                exposed = exposed_name(conn.name, tool.name)
                other = registry.entry(exposed)
                if exposed in routes:
                    skipped[f"{conn.name}/{tool.name}"] = f"{exposed} is taken by MCP server '{routes[exposed][0]}'"
                    continue
                if other is not None and other.owner != self.PLUGIN_NAME:
                    skipped[f"{conn.name}/{tool.name}"] = f"{exposed} is taken by {other.owner}"
                    continue
                routes[exposed] = (conn.name, tool.name)
                tools.append(self._tool(conn, tool, exposed))
                read_only = bool(tool.annotations and tool.annotations.read_only_hint)
                gates[exposed] = {
                    "type": GATE_TYPE,
                    "operation": "read" if conn.spec.trusted and read_only else "write",
                }
        for key in skipped.keys() - self._skipped.keys():
            logger.warning("MCP tool %s skipped: %s", key, skipped[key])
        self._routes, self._skipped = routes, skipped
        return tools, gates

    def get_tools(self) -> dict[str, Any]:
        return {"lc": self._collect()[0]}

    def get_gate_tools(self) -> dict[str, Any]:
        return self._collect()[1]

    def _server_changed(self, conn: Connection) -> None:
        """A server connected, failed, died or changed its tools: update /health and the registry."""
        assert self.context is not None
        self.context.report_problems([f"MCP server '{c.name}' {c.status}: {c.error}"
                                      for c in self.servers.values() if c.error and c.status != "connected"])
        if self.enabled and conn.status == "connected":  # registered: keep the registry in step
            try:
                self.context.tools.reload()
            except Exception:
                logger.exception("MCP server %s: its new tool list could not be registered", conn.name)
        self.changed.set()
        self.changed = asyncio.Event()

    # ── commands ──

    def get_commands(self) -> dict[str, Any]:
        return {"mcp": self.cmd_mcp}

    def get_help(self) -> str:
        return ("MCP servers (plugin_mcp_client):\n"
                "  !mcp                        list MCP servers, their status and tools\n"
                "  !mcp reconnect <server>     restart one server's connection")

    async def cmd_mcp(self, turn: plugin_api.Turn, args: str) -> str:
        """!mcp [reconnect <server>] — the MCP servers, their status and their tools."""
        words = args.split()
        admin = plugin_api.may_administer(turn)
        if words and words[0] == "reconnect" and not admin:
            return plugin_api.refusal("!mcp reconnect", turn)
        if words and words[0] == "reconnect":
            if len(words) != 2 or words[1] not in self.servers:
                return f"Use: !mcp reconnect <server>  (servers: {', '.join(self.servers) or 'none'})"
            conn = self.servers[words[1]]
            ok = await conn.connect(force=True)
            return (f"MCP server '{conn.name}' reconnected: {len(conn.tools)} tool(s)." if ok
                    else f"MCP server '{conn.name}' failed: {conn.error}")
        if words:
            return "Use: !mcp  or  !mcp reconnect <server>"
        return self._status_text(admin)

    def _status_text(self, admin: bool) -> str:
        """Every server's status and tools; how each is reached (command lines, URLs) and why one failed only
        for an admin."""
        if not self.servers:
            return f"No MCP servers configured (add them to {self.config_file})."
        lines = [f"MCP servers ({self.config_file}):"]
        by_server: dict[str, list[str]] = {}
        for exposed, (server, _) in self._routes.items():
            by_server.setdefault(server, []).append(exposed)
        assert self.context is not None
        for conn in self.servers.values():
            flags = ", ".join(filter(None, [f"protocol {conn.protocol}" if conn.protocol else "",
                                            "trusted" if conn.spec.trusted else ""]))
            how = conn.describe() if admin else conn.describe().partition(":")[0]  # stdio / http, nothing more
            lines.append(f"  {conn.name} [{conn.status}] {how}" + (f" ({flags})" if flags else ""))
            if admin and conn.fence:
                lines.append(f"    fence: {conn.fence}")
            if conn.error:
                lines.append(f"    why: {conn.error}" if admin else "    why: see !mcp in the shell (operators only)")
            for exposed in by_server.get(conn.name, []):
                entry = self.context.tools.entry(exposed)
                op = entry.gate.get("operation", "?") if entry else "not registered"
                desc = entry.tool.description.splitlines()[0] if entry and entry.tool.description else ""
                lines.append(f"    {exposed:<30} {op:<6} {desc}")
            for key, why in self._skipped.items():
                if key.startswith(f"{conn.name}/"):
                    lines.append(f"    (skipped {key.partition('/')[2]}: {why})")
        return "\n".join(lines) + "\n"
