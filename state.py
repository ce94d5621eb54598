"""The runtime: everything one server instance owns.

One `Runtime` per server instance owns every mutable object; it is built once (see
`build.build_runtime`) and passed in.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio

from metrics import OFF as NO_METRICS
from metrics import Metrics
from tracing import OFF as NO_TRACING
from tracing import Tracing

if TYPE_CHECKING:  # annotations only: importing these (langchain, sqlglot) would slow every CLI start
    from langchain_core.language_models import BaseChatModel

    from config import AppConfig
    from events import EventHub
    from gate import GateKeeper, ToolCheck
    from prompt import PromptTree
    from rate_limits import RateLimiter
    from registry import ToolRegistry
    from sessions import SessionManager
    from shared_link import Link, Signals
    from shared_values import SharedValues
    from turns import Command


#: client id → its requests running or waiting for the session: each task with its turn id, carried as data
#: (a stopped request's `done` carries its id).
Requests = dict[str, dict[asyncio.Task[None], str]]


def _no_credentials() -> set[str]:
    return set()


@dataclass
class Runtime:
    """Everything one server instance owns. Built once, passed to every module that needs it."""

    config: AppConfig
    sessions: SessionManager
    hub: EventHub
    tools: ToolRegistry
    prompt: PromptTree
    #: The gate keeper (pending gates included) and the rate limiter.
    gate: GateKeeper
    rate_limiter: RateLimiter
    #: `!command` name (lower case, no `!`) → Command.
    commands: dict[str, Command] = field(default_factory=dict)
    #: model key → LangChain chat model, built once and reused.
    llms: dict[str, BaseChatModel] = field(default_factory=dict)
    #: client id → its requests that are running or waiting for the session (routes.py keeps it).
    active_tasks: Requests = field(default_factory=dict)
    #: Checks run by tool_calls.execute_tool, in order, on validated arguments before the executor
    #: (rate limit, then gate); see gate.ToolCheck.
    tool_checks: list[ToolCheck] = field(default_factory=list)
    started: float = field(default_factory=time.time)
    #: model key → (context window in tokens, where that number comes from), found at first use.
    windows: dict[str, tuple[int, str]] = field(default_factory=dict)
    #: client id → what the agent made of its session's history (models.HistoryCache), for the sessions that
    #: took a turn most recently (agents.history_cache), least recent first.
    histories: OrderedDict[str, Any] = field(default_factory=OrderedDict)
    #: Client-id namespaces declared by the loaded client plugins: prefix → (client class, plugin).
    client_namespaces: dict[str, tuple[str, str]] = field(default_factory=dict)
    #: The credentials the loaded client plugins accept (their port and admin tokens), which are never sent to
    #: another agent (tools.target_token); the plugin loader provides it (build.build_runtime).
    own_credentials: Callable[[], set[str]] = field(default_factory=lambda: _no_credentials)
    #: Set when the server stops, so endless event streams end (sse-starlette's shutdown event).
    stopping: anyio.Event = field(default_factory=anyio.Event)
    #: Event-stream responses not yet complete, and the event a stopping server waits on until none is left.
    open_streams: int = 0
    streams_done: asyncio.Event | None = None
    #: Set when the server starts to stop (routes.end_all): requests cancelled from then on end as
    #: interrupted (error + done, the user's message kept), not as replaced by a newer one.
    closing: bool = False
    #: With a shared store (several instances on one Redis): the connection, and the small values plugins
    #: share through it; None on one instance.
    link: Link | None = None
    values: SharedValues | None = None
    #: With a shared store: requests to the other instances (cancel, stop).
    signals: Signals | None = None
    #: Prometheus metrics (OFF without a metrics listener) and OpenTelemetry spans (OFF without an endpoint).
    metrics: Metrics = NO_METRICS
    tracing: Tracing = NO_TRACING

    def unavailable(self) -> str | None:
        """Why this instance cannot serve requests now (its shared store is unreachable), or None."""
        return self.link.unavailable_message() if self.link is not None else None
