"""The runtime: everything one server instance owns.

One `Runtime` per server instance owns every mutable object; it is built once (see
`build.build_runtime`) and passed in.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import anyio

from metrics import OFF as NO_METRICS
from metrics import Metrics
from tracing import OFF as NO_TRACING
from tracing import Tracing

if TYPE_CHECKING:  # annotations only: importing these (langchain, sqlglot) would slow every CLI start
    from langchain_core.language_models import BaseChatModel

    from agents import Agent
    from config import AppConfig
    from events import EventHub
    from gate import GateKeeper
    from prompt import PromptTree
    from rate_limits import RateLimiter
    from registry import ToolRegistry
    from sessions import SessionManager
    from shared_link import Link, Signals
    from shared_values import SharedValues
    from tool_calls import ToolPipeline
    from turns import Command


#: client id → its requests running or waiting for the session: each task with its turn id, carried as data
#: (a stopped request's `done` carries its id).
Requests = dict[str, dict[asyncio.Task[None], str]]


@dataclass
class Runtime:
    """Everything one server instance owns. Built once (build.py); only the request entry (routes.py) and the
    plugins' contexts take it whole, everything else gets the parts it uses."""

    config: AppConfig
    sessions: SessionManager
    hub: EventHub
    tools: ToolRegistry
    prompt: PromptTree
    #: The gate keeper (pending gates included) and the rate limiter.
    gate: GateKeeper
    rate_limiter: RateLimiter
    #: The tool-call pipeline (its checks: the rate limiter's, then the gate keeper's) and the LLM turns.
    pipeline: ToolPipeline
    agent: Agent
    #: `!command` name (lower case, no `!`) → Command.
    commands: dict[str, Command] = field(default_factory=dict)
    #: model key → LangChain chat model, built once and reused.
    llms: dict[str, BaseChatModel] = field(default_factory=dict)
    #: client id → its requests that are running or waiting for the session (routes.py keeps it).
    active_tasks: Requests = field(default_factory=dict)
    #: model key → (context window in tokens, where that number comes from), found at first use.
    windows: dict[str, tuple[int, str]] = field(default_factory=dict)
    #: Client-id namespaces declared by the loaded client plugins: prefix → (client class, plugin).
    client_namespaces: dict[str, tuple[str, str]] = field(default_factory=dict)
    #: Set when the server stops, so endless event streams end (sse-starlette's shutdown event).
    stopping: anyio.Event = field(default_factory=anyio.Event)
    #: Event-stream responses not yet complete, and the event a stopping server waits on until none is left.
    open_streams: int = 0
    streams_done: asyncio.Event | None = None
    #: Set when the server starts to stop (routes.end_all): requests cancelled from then on end as
    #: interrupted (error + done, the user's message kept), not as replaced by a newer one.
    closing: bool = False
    #: With a shared store (several instances on one Redis): the connection, and the core's small values
    #: (each plugin's are its own, plugin_api.PluginContext.values); None on one instance.
    link: Link | None = None
    values: SharedValues | None = None
    #: With a shared store: requests to the other instances (cancel, stop).
    signals: Signals | None = None
    #: Prometheus metrics (OFF without a metrics listener) and OpenTelemetry spans (OFF without an endpoint).
    metrics: Metrics = NO_METRICS
    tracing: Tracing = NO_TRACING

    def levels(self) -> dict[str, float]:
        """How full this instance is, read at every scrape (the gauges of metrics.LEVELS)."""
        grants = self.gate.grants
        return {"sessions_stored": len(self.sessions.all()),
                "sessions_running": sum(1 for tasks in list(self.active_tasks.values()) if tasks),
                "sse_subscribers": self.open_streams,
                "grants_active": sum(len(grants.active(s)) for s in list(grants.grants)) if grants is not None else 0,
                "gates_pending": len(self.gate.pending)}

    def unavailable(self) -> str | None:
        """Why this instance cannot serve requests now (its shared store is unreachable), or None."""
        return self.link.unavailable_message() if self.link is not None else None
