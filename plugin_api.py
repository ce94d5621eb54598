"""The whole plugin surface: what a plugin may use of the server, and nothing else.

A plugin subclasses `BasePlugin` and reaches the running server only through `self.ctx`, its
`PluginContext`: its requests (`request`, `submit`, `run_turn`, `wait_turn`, `stop`,
`delete_session`), the event streams and the sessions, the gates, the tool registry (read only), the
shared store of several instances (`values`, `signals`, `link`), metrics and tracing, and the settings. Of
the sessions, their gates and the client classes it reaches and vouches for its own only (plugin_scope.py),
unless the operator granted it every one.
The types those hand out (`Request`, `Turn`, `Event`, `Session`, …) and the client classes are
exported here too. Besides this module a plugin imports libraries, and the core's vocabulary,
record and file-format modules that hold no runtime (`LIBRARIES` in tests/test_architecture.py:
decisions, grants, approvals, audit_chain, gate_policy, config, secret_files, failures, guard,
database, db_results); tests/test_architecture.py fails on any other core import from plugins/.
The loader builds one context per plugin before `init()`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, Awaitable, Callable, Collection, Mapping
from typing import Any, TypeVar

import anyio
from pydantic import BaseModel, ConfigDict, ValidationError

import grants
import models
import routes
import state
from client_classes import (
    API,
    CLASSES,
    CLIENT_LABELS,
    HUMAN_WAIT,
    MCP,
    NO_WAIT,
    PROXY,
    SHELL,
    SLACK,
    SWARM,
    UNKNOWN,
    actor,
    client_class,
    may_administer,
    refusal,
)
from config import AppConfig, field_problems
from events import Event
from gate import ANY_TABLE, DDL, WRITE
from plugin_checks import ALL_SESSIONS, PluginReport
from plugin_scope import (
    PluginDesk,
    PluginGate,
    PluginHub,
    PluginSessions,
    PluginSignals,
    PluginTools,
    Scope,
    ScopeError,
)
from registry import ToolError
from routes import Request, Submitted, ends_turn
from sessions import Stopping
from shared_link import Link
from shared_values import PluginValues
from stores import Session, SessionError, SqliteFile
from tool_calls import ToolOutcome
from turns import ADMIN as DB_ADMIN
from turns import DbAccess, Turn, current_turn, running

__all__ = [
    "ANY_TABLE", "API", "CLASSES", "CLIENT_LABELS", "DB_ADMIN", "DDL", "HUMAN_WAIT", "MCP", "NO_WAIT", "PROXY",
    "SHELL", "SLACK", "SWARM", "UNKNOWN", "WRITE", "BasePlugin", "DbAccess", "Event", "Link", "PluginConfigError",
    "PluginContext",
    "PluginDesk", "PluginGate", "PluginHub", "PluginSessions", "PluginSettings", "PluginSignals", "PluginTools",
    "PluginValues", "Request", "ScopeError", "Session", "SessionError", "SqliteFile", "Stopping", "Submitted",
    "ToolError", "ToolOutcome", "Turn", "actor", "current_turn", "ends_turn", "may_administer", "parse_settings",
    "refusal", "running",
]

M = TypeVar("M", bound=BaseModel)


# ── The contract ────────────────────────────────────────────────────────────────────────────


class PluginConfigError(Exception):
    """A plugin's settings or credentials are missing or invalid; the message says what to set where.

    Raised from `init()`, it is reported as the plugin's reason as is (no traceback location).
    """


class PluginSettings(BaseModel):
    """Base of a plugin's typed `plugin_config` block: unknown keys are errors, `enabled` is always allowed."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = True


def parse_settings(plugin_name: str, model: type[M], config: dict[str, Any],
                   env_defaults: dict[str, str | None] | None = None) -> M:
    """A plugin's `plugin_config` block as `model`, unset fields taken from `env_defaults` (env values).

    Raises PluginConfigError naming each bad field of `plugin_config.<plugin_name>`.
    """
    data = {k: v for k, v in (env_defaults or {}).items() if v}
    data.update(config)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        problems = field_problems(exc, "(block)")
        raise PluginConfigError(f"plugin_config.{plugin_name} in plugins-enabled.json: {problems}") from None


class BasePlugin(ABC):
    """What every plugin is. Subclass it in `plugins/plugin_<type>_<name>.py`.

    Before `init()` the loader sets `self.context` to the plugin's `PluginContext` (read it as `self.ctx`).
    """

    PLUGIN_NAME: str = ""
    PLUGIN_VERSION: str = "0.0.0"
    PLUGIN_TYPE: str = ""  # "data_tool" or "client_interface"
    DESCRIPTION: str = ""
    DEPENDENCIES: list[str] = []
    ENV_VARS: list[str] = []
    #: client_interface: the client-id prefixes this plugin's sessions use, and their client class
    #: (`client_classes.CLASSES`: "api", "proxy", …), e.g. `{"api-": "api", "api-swarm-": "swarm"}`. A request
    #: whose id no loaded plugin declared gets the least privilege ("unknown").
    CLIENT_NAMESPACES: dict[str, str] = {}

    def __init__(self) -> None:
        self.enabled = False
        self.context: PluginContext | None = None

    @property
    def ctx(self) -> PluginContext:
        """The plugin's door to the server, for code that only runs after the loader has set it."""
        assert self.context is not None, f"{self.PLUGIN_NAME}: context used before the loader set it"
        return self.context

    def client_class(self, client_id: str) -> str:
        """The class this plugin states for a request of `client_id`: that of its own namespace owning the
        id (the longest prefix in CLIENT_NAMESPACES); outside them, the least privilege."""
        owning = [p for p in self.CLIENT_NAMESPACES if client_id.startswith(p)]
        return self.CLIENT_NAMESPACES[max(owning, key=len)] if owning else UNKNOWN

    @abstractmethod
    def init(self, config: dict[str, Any]) -> bool | Awaitable[bool]:
        """Start with this plugin's `plugin_config` block; return False to be skipped. May be async."""

    @abstractmethod
    def shutdown(self) -> Awaitable[None] | None:
        """Close connections and stop background work. May be async."""

    def get_tools(self) -> dict[str, Any]:
        """data_tool: `{"lc": [StructuredTool, ...]}`."""
        return {"lc": []}

    def get_gate_tools(self) -> dict[str, Any]:
        """data_tool: `{"tool_name": {"type": "search" | "drive" | ..., ...}}`."""
        return {}

    def get_routes(self) -> list[Any]:
        """client_interface: Starlette routes served on this plugin's own port."""
        return []

    def get_config(self) -> dict[str, Any]:
        """client_interface: `{"port": int, "host": str, "name": str, "token": str | None}`.

        `"authenticates_requests": True` says the plugin checks a credential on every request itself,
        so it may listen beyond loopback without a port token.
        """
        return {}

    def get_commands(self) -> dict[str, Any]:
        """Optional `!command` handlers: name → `async def handler(args: str) -> str`."""
        return {}

    def get_help(self) -> str:
        """Optional section for `!help`."""
        return ""




# ── The context ─────────────────────────────────────────────────────────────────────────────


class PluginContext:
    """One plugin's door to the running server: every part of the server a plugin may reach.

    Built by the loader for each plugin. The runtime it wraps stays private: a plugin never hands
    the whole runtime to a core function, it calls the method here that does the one thing. It reaches
    the sessions of its own namespaces (and of a turn it serves); `grants` are what the operator gave
    it in plugin-manifest.json (`all-sessions`: every session).
    """

    def __init__(self, rt: state.Runtime, plugin: BasePlugin, reports: Mapping[str, PluginReport],
                 grants: Collection[str] = ()) -> None:
        self._rt = rt
        self._plugin = plugin
        self._reports = reports  # the loader's start reports, by plugin name
        name = plugin.PLUGIN_NAME
        self._scope = Scope(name, rt.client_namespaces, rt.sessions, ALL_SESSIONS in grants)
        self._sessions = PluginSessions(rt.sessions, self._scope)
        self._hub = PluginHub(rt.hub, self._scope)
        self._gate = PluginGate(rt.gate, self._scope)
        own = (lambda: (plugin.get_tools(), plugin.get_gate_tools())) if plugin.PLUGIN_TYPE == "data_tool" else None
        self._tools = PluginTools(rt.tools, name, own)
        self._values = PluginValues(rt.values.link, name) if rt.values is not None else None
        self._signals = PluginSignals(rt.signals, name) if rt.signals is not None else None

    # ── settings ──

    @property
    def config(self) -> AppConfig:
        """The server's configuration (config dir, env, models, gate defaults, plugin settings)."""
        return self._rt.config

    # ── requests ──

    def request(self, client_id: str, text: str = "", *, kind: str | None = None, **flags: Any) -> Request:
        """A typed request of `client_id`: its class is `kind`, else the one this plugin's own
        CLIENT_NAMESPACES state for the id (outside them: the least privilege). `flags`: the other
        `Request` fields (model, default_model, admin, interactive, identity, history). Building one of another
        plugin's session, or one that claims more than the plugin may vouch for, is allowed; running it is not
        (`submit` and the rest raise ScopeError, see `_vouch`)."""
        return Request(client_id, kind or self._plugin.client_class(client_id), text, **flags)

    def _vouch(self, client_id: str, kind: str, admin: bool, interactive: bool, bypass_gates: bool = False) -> None:
        """Raise ScopeError unless the plugin may run a request of this session with these privileges: without
        the all-sessions grant, only as the class its own CLIENT_NAMESPACES state for the id, and neither as an
        administrator (`admin`) nor as the interactive shell (`interactive`, `bypass_gates`)."""
        self._scope.check(client_id)
        if self._scope.everything:
            return
        own = self._plugin.client_class(client_id)
        claims = [word for word, claimed in (("admin", admin is True), ("interactive", interactive is True),
                                             ("bypass_gates", bypass_gates is True), (f"kind={kind!r}", kind != own))
                  if claimed]
        if claims:
            raise ScopeError(f"plugin {self._plugin.PLUGIN_NAME} may not vouch for {', '.join(claims)} on session "
                             f"'{client_id[:80]}': it vouches only for the class its CLIENT_NAMESPACES state for the "
                             f"id ('{own}'), without admin or interactive rights; a plugin that vouches for more needs "
                             "\"grants\": [\"all-sessions\"] in its plugin-manifest.json entry, which only an operator "
                             "gives")

    def _vouch_request(self, request: Request) -> None:
        self._vouch(request.client_id, request.kind, request.admin, request.interactive)

    async def submit(self, request: Request, *, cancel_running: bool = True) -> Submitted:
        """Start the request (see `routes.submit`); its events go to the session's subscribers."""
        self._vouch_request(request)
        return await routes.submit(self._rt, request, cancel_running=cancel_running)

    async def process_request(self, request: Request) -> None:
        """Run the request in the calling task, to its end (the spec's path; `routes.process_request`): it is
        tracked like a submitted one, so a newer request or a delete cancels it."""
        self._vouch_request(request)
        await routes.process_request(request, rt=self._rt)

    def run_turn(self, request: Request, *, cancel_running: bool = False) -> AsyncGenerator[Event, None]:
        """Submit the request and iterate its own events, ending with its `done` (`routes.run_turn`)."""
        self._vouch_request(request)
        return routes.run_turn(self._rt, request, cancel_running=cancel_running)

    async def wait_turn(self, request: Request, seconds: float, *, cancel_running: bool = False,
                        on_event: Callable[[Event], None] | None = None) -> dict[str, Any]:
        """Run the request to its end, or for `seconds` (`routes.wait_turn`): `{"status", "text"}`."""
        self._vouch_request(request)
        return await routes.wait_turn(self._rt, request, seconds, cancel_running=cancel_running, on_event=on_event)

    async def stop(self, client_id: str) -> bool:
        """Stop the session's requests (each says `[stopped]` and ends); whether any was running."""
        self._scope.check(client_id)
        return await routes.stop(self._rt, client_id)

    async def cancel(self, client_id: str) -> None:
        """Cancel the session's requests and wait until they have cleaned up."""
        self._scope.check(client_id)
        await routes.cancel_active_task(self._rt, client_id)

    async def delete_session(self, client_id: str, *, remember: bool = True, announce: bool = True) -> Session | None:
        """Delete a session the one way sessions are deleted (`routes.delete_session`): with `remember`, a client
        that comes back is told; with `announce`, every window following it is told now."""
        self._scope.check(client_id)
        return await routes.delete_session(self._rt, client_id, remember=remember, announce=announce)

    def busy(self, client_id: str) -> bool:
        """Whether a request of the session runs (or waits) on this instance."""
        self._scope.check(client_id)
        return any(not t.done() for t in self._rt.active_tasks.get(client_id, ()))

    async def execute_tool(self, turn: Turn, name: str, args: dict[str, Any]) -> ToolOutcome:
        """One call of an agent tool for `turn`, through the model's own pipeline (checks, gate, executor): the turn
        the plugin serves, or one with no more privileges than it may vouch for (see `_vouch`)."""
        if turn is not self._scope.served_turn():
            self._vouch(turn.client_id, turn.kind, turn.admin, turn.interactive, turn.bypass_gates)
        return await self._rt.pipeline.execute(turn, name, args)

    async def ask_gate(self, client_id: str, payload: dict[str, Any], seconds: float,
                       routed: Any = None) -> tuple[grants.Decision, str]:
        """Raise a gate on the session and wait for its decision (`GateKeeper.ask`): (decision, gate id)."""
        self._scope.check(client_id)
        return await self._rt.gate.ask(client_id, payload, seconds, routed)

    # ── what the server holds ──

    @property
    def hub(self) -> PluginHub:
        """The event streams of the plugin's sessions: publish, subscribe, last_id, observe."""
        return self._hub

    @property
    def sessions(self) -> PluginSessions:
        """The plugin's sessions: get, all, resolve, exists, refresh, save, get_or_add, on_forgotten, …"""
        return self._sessions

    @property
    def gate(self) -> PluginGate:
        """The gates of the plugin's sessions and those routed to the approvers it answers for: answer, resolve,
        owner, desk, active_grants, defaults (a copy), timeouts; with the grant also grants, set_policy, …"""
        return self._gate

    @property
    def tools(self) -> PluginTools:
        """The tool registry, read only (get, entry, names, openai_schemas; reload: the plugin's own again)."""
        return self._tools

    def client_class(self, client_id: str) -> str:
        """The class of the loaded plugin namespace owning `client_id`: for labels, never for privileges."""
        return client_class(client_id, self._rt.client_namespaces)

    def plugin_reports(self) -> dict[str, dict[str, Any]]:
        """How each plugin started: name → {"status", "reasons"} (what /health shows)."""
        reports = self._reports.values()
        return {r.name: {"status": r.status, "reasons": r.reasons} for r in reports}

    def report_problems(self, reasons: list[str]) -> None:
        """Replace this plugin's reasons on its start report (what /health shows), e.g. a server it lost."""
        report = self._reports.get(self._plugin.PLUGIN_NAME)
        if report is not None:
            report.reasons = reasons

    async def close_models(self, keys: list[str]) -> None:
        """Forget the chat models of `keys`, which are built again with their new settings at their next call."""
        await models.close_models(self._rt.llms, keys)

    # ── several instances on one store (None on one instance) ──

    @property
    def values(self) -> PluginValues | None:
        """The plugin's own small values in Redis (put, get, take, drop); no other plugin reads them."""
        return self._values

    @property
    def signals(self) -> PluginSignals | None:
        """Signals to the plugin on the other instances (send, on), apart from every other plugin's."""
        return self._signals

    @property
    def link(self) -> Link | None:
        """The Redis connection itself, which reaches every session: only with the all-sessions grant."""
        if not self._scope.everything:
            raise ScopeError(f"plugin {self._plugin.PLUGIN_NAME}: the Redis connection reaches every session; use "
                             "ctx.values and ctx.signals (or have an operator grant it all-sessions)")
        return self._rt.link

    # ── observability ──

    @property
    def metrics(self) -> Any:
        """Prometheus metrics (metrics.Metrics; metrics.OFF without a metrics listener)."""
        return self._rt.metrics

    @property
    def tracing(self) -> Any:
        """OpenTelemetry spans (tracing.Tracing)."""
        return self._rt.tracing

    # ── event streams to clients ──

    def stopping(self) -> anyio.Event:
        """Set when the server stops, so endless event streams end."""
        if self._rt.stopping is None:
            self._rt.stopping = anyio.Event()
        return self._rt.stopping

    def stream_opened(self) -> None:
        """An event-stream response started: a stopping server waits for it to end."""
        self._rt.open_streams += 1

    def stream_closed(self) -> None:
        self._rt.open_streams -= 1
        if not self._rt.open_streams and self._rt.streams_done is not None:
            self._rt.streams_done.set()
