"""Assembling one server instance: the runtime's object graph, and taking it down again."""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import agents
import approvals
import audit_chain
import client_classes
import commands
import events
import gate
import gate_commands
import grants
import metrics
import models
import rate_limits
import routes
import shared_events
import shared_gates
import shared_link
import shared_store
import shared_values
import state
import stores
import tool_calls
import tools
import tracing
import turns
from config import CORE_GATES, AppConfig, ConfigError, SessionsConfig, env_seconds
from plugin_checks import is_enabled
from plugin_loader import PluginLoader
from prompt import PROMPT_DIR, PromptTree
from registry import ToolRegistry
from sessions import DEFAULT_LOCK_SECONDS, SessionLimits, SessionManager, SessionPolicy

logger = logging.getLogger("agent_mcp.build")


def event_buffer(env: Mapping[str, str]) -> int:
    """AGENT_EVENT_BUFFER: how many events each session keeps for readers that fall behind or reconnect
    (default events.EVENT_BUFFER); a reader further behind gets an error instead of an answer with a gap."""
    raw = env.get("AGENT_EVENT_BUFFER", "").strip()
    if not raw:
        return events.EVENT_BUFFER
    if not raw.isdigit() or not 10 <= int(raw) <= 1_000_000:
        raise ConfigError(f"environment variable AGENT_EVENT_BUFFER={raw[:40]!r}: must be a whole number of events "
                          f"from 10 to 1000000 (default {events.EVENT_BUFFER})")
    return int(raw)


def store_lock_seconds(env: Mapping[str, str]) -> float:
    """SESSION_STORE_LOCK_SECONDS: how long a save waits while another process holds the session store's lock
    (default DEFAULT_LOCK_SECONDS) before the request fails, its change kept in memory and retried."""
    return env_seconds(env, "SESSION_STORE_LOCK_SECONDS", DEFAULT_LOCK_SECONDS)


def _store_news(hub: events.EventHub, hide: Callable[[str], str], client_id: str, text: str) -> None:
    """Tell a session's clients what its store does (SessionManager.store_news); the file's location only to
    the shell and admins, as every error is."""
    turn = turns.current_turn()
    shown = text if turn is not None and client_classes.may_administer(turn) else hide(text)
    hub.publish(client_id, "status", {"text": shown, "store": True})


@dataclass
class Server(state.Runtime):
    """The assembled server: the runtime and the plugin loader, which holds the runtime to give each plugin its
    context. The composition root owns this type, so the runtime that the modules below are typed with does not
    name the loader above them (no type-level circle)."""

    plugins: PluginLoader | None = None


async def build_runtime(config: AppConfig, store: stores.SessionStore | None = None,
                        spans: tracing.Tracing | None = None) -> Server:
    """The object graph of one server instance, with sessions loaded and core tools registered. `spans`: where
    its traces go (default: `observability`, from the environment)."""
    namespaces: dict[str, tuple[str, str]] = {}  # filled by the plugin loader as client plugins load
    # Before anything opens:
    rules = approvals.ApprovalRules(config.enabled.approvals, client_classes.CLASSES, [client_classes.SHELL])
    registry, prompt = ToolRegistry(), PromptTree(config.path(PROMPT_DIR)).load()
    sessions = SessionManager(store or shared_store.open_store(config.env.get("SESSION_STORE"), config.data_dir()),
                              session_policy(config.enabled.sessions, namespaces),
                              lock_seconds=store_lock_seconds(config.env))
    await sessions.open()
    link = sessions.store.link if isinstance(sessions.store, shared_store.RedisStore) else None
    buffer = event_buffer(config.env)
    hub = shared_events.RedisEventHub(link, buffer) if link else events.EventHub(buffer=buffer)
    keeper = gate.GateKeeper.from_env(config.gates, hub, config.env, config.config_dir)
    grant_store = keeper.grants = grants.GrantStore(config.data_dir() / grants.AUDIT_FILE,
                                                    key_file=audit_chain.key_path(config.data_dir(), config.env))
    try:
        await grant_store.open()
    except BaseException:
        await sessions.close()
        raise
    found, from_env = observability(config)
    spans = spans or from_env
    limiter = rate_limits.RateLimiter(config.enabled.rate_limits, hub)
    llms: dict[str, Any] = {}
    windows: dict[str, tuple[int, str]] = {}
    hide = functools.partial(client_classes.without_locations, config)
    checks: list[gate.ToolCheck] = [limiter.check, keeper.check]  # rate limit first, then the human
    pipeline = tool_calls.ToolPipeline(registry, hub.status, hide, checks, found, spans)
    rt = Server(
        config=config,
        sessions=sessions,
        client_namespaces=namespaces,
        hub=hub,
        link=link,
        tools=registry,
        prompt=prompt,
        gate=keeper,
        rate_limiter=limiter,
        pipeline=pipeline,
        # `closing` is read when a turn is cancelled, long after `rt` is bound here.
        agent=agents.Agent(config, sessions, hub, prompt, pipeline, llms, windows, found, spans, lambda: rt.closing),
        llms=llms,
        windows=windows,
        metrics=found,
        tracing=spans,
    )
    rt.plugins = PluginLoader(rt)
    swarm = tools.Swarm(config, rt.plugins.client_credentials, sessions, hub, spans)
    for tool in tools.make_core_tools(tools.CoreParts(config, prompt, pipeline, llms, windows, found, spans, swarm)):
        registry.register(tool, gate=CORE_GATES.get(tool.name))
    if rules.configured:  # else no gate is routed: every class behaves as the spec says
        keeper.desk = approvals.ApprovalDesk(rules, hub, shared_gates.SharedApprovals(link) if link else None)
    found.watch(rt.levels)
    rt.gate.metrics, rt.gate.tracing = found, spans
    if link is not None:
        link.metrics = found
    if link is not None:  # several instances: gates, grants, windows and plugin values in Redis
        rt.gate.relay, rt.rate_limiter.shared = shared_gates.GateRelay(link), shared_values.SharedLimits(link)
        rt.values = shared_values.SharedValues(link)
        grant_store.link = link
        rt.signals = rt.gate.signals = shared_link.Signals(link)
        rt.signals.on(gate.POLICY_SIGNAL, rt.gate.policy_changed_elsewhere)
        for what in ("cancel", "stop"):
            rt.signals.on(what, functools.partial(routes.signalled, rt.active_tasks, rt.hub, what))
        rt.signals.start()
    # Whatever removes a session (delete, expiry, eviction) also drops its stream, rate-limit windows and grants.
    sessions.forgotten += [rt.hub.drop, rt.rate_limiter.forget, grant_store.forget]
    sessions.is_busy = lambda client_id: bool(rt.active_tasks.get(client_id))
    sessions.interrupted = functools.partial(routes.interrupted, rt.hub)
    sessions.store_news = functools.partial(_store_news, rt.hub, hide)
    await sessions.recover()  # turns a stopped server left unfinished (later: SessionManager.start_sweeping)
    sessions.start_sweeping()
    ctx = command_context(rt)
    for name, handler in commands.COMMANDS.items():
        rt.commands[name] = turns.Command(functools.partial(handler, ctx), usage=turns.usage_of(handler))
    parts = gate_commands.Parts(gate=rt.gate, rate_limiter=rt.rate_limiter, sessions=rt.sessions, tools=rt.tools)
    for name, gate_command in gate_commands.COMMANDS.items():
        rt.commands[name] = turns.Command(functools.partial(gate_command, parts), usage=turns.usage_of(gate_command))
    return rt


def command_context(rt: Server) -> commands.Context:
    """The pieces of the runtime the server's own `!commands` use (looked up at each call where a test or a
    reload may replace them: the rate limiter; routes.delete_session, which tests watch)."""
    return commands.Context(
        config=rt.config, sessions=rt.sessions, prompt=rt.prompt, tools=rt.tools, commands=rt.commands,
        plugins=rt.plugins, gate=rt.gate,
        delete_session=lambda client_id: routes.delete_session(rt, client_id),
        context_report=lambda session: agents.context_report(session, rt.config, rt.prompt, rt.tools, rt.windows),
        close_models=lambda keys: models.close_models(rt.llms, keys),
        reenable=lambda client_id, tool_type: rt.rate_limiter.reenable(client_id, tool_type))


#: The plugin that serves /metrics; metrics are collected only while it is enabled.
METRICS_PLUGIN = "plugin_client_metrics"
#: Its port when plugins-enabled.json names none (the OpenTelemetry Prometheus exporter's usual port).
METRICS_PORT = 9464


def instance_name(config: AppConfig) -> str:
    """The `instance` label of this server's metrics and its traces' service.instance.id: AGENT_INSTANCE,
    else host:port of its metrics listener (stable across restarts, unlike a process id)."""
    named = config.env.get("AGENT_INSTANCE", "").strip()
    if named:
        return named[:100]
    port = config.enabled.plugin_config.get(METRICS_PLUGIN, {}).get("port", METRICS_PORT)
    return f"{socket.gethostname()}:{port}"


def observability(config: AppConfig) -> tuple[metrics.Metrics, tracing.Tracing]:
    """An instance's metrics (metrics.OFF unless the metrics listener is enabled; build_runtime has them read the
    runtime's levels) and traces (tracing.OFF unless an OTLP endpoint is configured and the otel extra installed)."""
    instance = instance_name(config)
    spans = tracing.from_env(config.env, instance)
    if not is_enabled(config.enabled, METRICS_PLUGIN):
        return metrics.OFF, spans
    return metrics.Metrics(instance, models=config.models), spans


def session_policy(bounds: SessionsConfig, namespaces: dict[str, tuple[str, str]] | None = None
                   ) -> SessionPolicy:
    """The session bounds of plugins-enabled.json `sessions`, per client class (`client_classes.session_class`,
    with the client-id `namespaces` the runtime's plugins declare)."""
    unknown = sorted(set(bounds.classes) - set(client_classes.CLIENT_LABELS))
    if unknown:
        logger.warning("plugins-enabled.json: field 'sessions.classes': %s name no client class and apply to no "
                       "session; the classes are %s", ", ".join(unknown), ", ".join(client_classes.CLIENT_LABELS))

    def limits(kind: str) -> SessionLimits:
        limit = bounds.limit(kind, interactive=kind == client_classes.SHELL)
        idle = None if limit.idle_days is None else limit.idle_days * 86400
        return SessionLimits(idle_seconds=idle, max_sessions=limit.max_sessions)

    def classify(session: stores.Session) -> str:
        return client_classes.session_class(namespaces or {}, session)

    return SessionPolicy(classify=classify, limits=limits, max_history=bounds.max_history_messages,
                         max_message_chars=bounds.max_message_chars, sweep_seconds=bounds.sweep_minutes * 60)


async def close_runtime(rt: Server) -> None:
    """End running turns (routes.end_all), shut plugins down (reverse order) and close the session store."""
    await routes.end_all(rt)
    if rt.plugins:
        await rt.plugins.shutdown_all()
    await rt.hub.aclose()
    if rt.signals is not None:
        await rt.signals.close()
    if rt.gate.grants is not None:
        await rt.gate.grants.close()
    await rt.sessions.close()  # last: with a shared store it closes the Redis connection the others use
    await models.close_models(rt.llms)
    if rt.tracing.on:
        await asyncio.to_thread(rt.tracing.close)
