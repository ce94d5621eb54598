"""Prometheus metrics of one server instance: what the turns, models, tools, gates and stores did.

`Metrics` owns a `CollectorRegistry` of its own (never prometheus_client's global one), so several
runtimes in one process (tests) never share a counter. Every exported sample carries an `instance`
label (the operator's AGENT_INSTANCE, else host:port of the metrics listener), added when the registry
is collected, not on every increment. Labels are bounded: client classes are a fixed set, model keys
and tool names come from the configuration (a name the registry does not know becomes `other`),
outcomes and error kinds are fixed words; never a session id, never text from a user or a model.

When no metrics listener is enabled, the runtime holds `OFF`: the same methods, doing nothing.
`plugins/plugin_client_metrics.py` serves the registry at `GET /metrics`. This module imports
nothing of ours.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

import decisions

#: The prefix of every metric name.
PREFIX = "agent_mcp"
#: The label value of a name that is not one the configuration declares (an unknown tool a model asked for).
OTHER = "other"
#: Seconds: a turn end to end; to its first answer token; one model call; one tool call; one db_query call.
TURN_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300)
FIRST_TOKEN_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60)
CALL_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120)
TOOL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
DB_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
#: How a gate was allowed: by gate-defaults or a gate command (policy), an active grant, an `@model` turn,
#: or a person's answer (once, or a grant of a scope: minutes, session, pattern).
ALLOW_SCOPES = decisions.SCOPE_NAMES
#: Refusal kinds (gate.Refusal.kind) that are gate rejections, and why: the user said no, nobody answered in
#: time, or the client class cannot ask anyone.
REJECTIONS = {"reject": "user", "timeout": "timeout", "denied": "no_approver"}
#: How a proxy request's session was found: it continues a conversation, starts one, or is named by a forwarded
#: header or the client's address.
PROXY_RESULTS = ("matched", "new", "header", "address")
#: The turn now running in this task (its start, for the time to first token).
_CLOCK: contextvars.ContextVar[_Clock | None] = contextvars.ContextVar("agent_mcp_turn_clock", default=None)


class _Clock:
    __slots__ = ("first", "model", "start")

    def __init__(self, model: str) -> None:
        self.model, self.start, self.first = model, time.perf_counter(), False


class _Call:
    """One model call being measured: `done(usage)` when it answered, else its failure is classified on exit."""

    __slots__ = ("usage",)

    def __init__(self) -> None:
        self.usage: Mapping[str, Any] | None = None

    def done(self, usage: Mapping[str, Any] | None) -> None:
        self.usage = usage


class _WithInstance(Collector):
    """The samples of `inner`, each with the `instance` label (collected at scrape time only)."""

    def __init__(self, inner: CollectorRegistry, instance: str):
        self.inner, self.instance = inner, instance

    def collect(self) -> Iterable[Metric]:
        for family in self.inner.collect():
            out = Metric(family.name, family.documentation, family.type, family.unit)
            out.samples = [s._replace(labels={"instance": self.instance, **s.labels}) for s in family.samples]
            yield out


class _Levels(Collector):
    """Gauges read when Prometheus scrapes (sessions stored and running, SSE subscribers, grants, gates
    waiting): nothing is counted on the request path for them."""

    def __init__(self, read: Callable[[], Mapping[str, float]]):
        self.read = read

    def collect(self) -> Iterable[Metric]:
        for name, value in self.read().items():
            yield GaugeMetricFamily(f"{PREFIX}_{name}", LEVELS.get(name, name), value=value)


#: The gauges `Metrics.watch` reads at each scrape, with their help text.
LEVELS = {
    "sessions_stored": "Sessions this instance has loaded (with several instances: the ones it knows now).",
    "sessions_running": "Sessions with a request running or waiting on this instance.",
    "sse_subscribers": "Event-stream (SSE) responses open on this instance.",
    "grants_active": "Grants (approvals that reach further than one call) in force now.",
    "gates_pending": "Gates raised on this instance and waiting for an answer.",
}


class Metrics:
    """The counters and histograms of one runtime; `registry` is what `/metrics` exposes."""

    on = True

    def __init__(self, instance: str, models: Iterable[str] = ()):
        self.instance = instance
        self.models = frozenset(models)
        self.own = CollectorRegistry(auto_describe=False)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_WithInstance(self.own, instance))
        r, p = self.own, PREFIX
        self.turns = Counter(f"{p}_turns", "LLM turns by client class, model and outcome (ok, error, cancelled).",
                             ("client_class", "model", "outcome"), registry=r)
        self.turn_seconds = Histogram(f"{p}_turn_duration_seconds", "An LLM turn from start to its answer's end.",
                                      ("model",), buckets=TURN_BUCKETS, registry=r)
        self.first_token = Histogram(f"{p}_time_to_first_token_seconds",
                                     "From the start of an LLM turn to the first answer text the model sent.",
                                     ("model",), buckets=FIRST_TOKEN_BUCKETS, registry=r)
        self.model_calls = Counter(f"{p}_model_calls", "Model calls (retries included) by model and outcome.",
                                   ("model", "outcome"), registry=r)
        self.model_errors = Counter(f"{p}_model_errors", "Failed model calls by model and kind (timeout, "
                                    "unreachable, http_<status>, context_overflow, stream_cut, other).",
                                    ("model", "kind"), registry=r)
        self.stream_cuts = Counter(f"{p}_model_stream_cut", "Model streams that ended before their finish reason (the "
                                   "connection closed or broke mid-answer): answers cut off, by model.", ("model",),
                                   registry=r)
        self.model_seconds = Histogram(f"{p}_model_call_duration_seconds", "One model call, streamed to its end.",
                                       ("model",), buckets=CALL_BUCKETS, registry=r)
        self.tokens = Counter(f"{p}_tokens", "Tokens the backends reported, by model and direction (input, output).",
                              ("model", "direction"), registry=r)
        self.tool_calls = Counter(f"{p}_tool_calls", "Tool calls by tool and outcome (ok, error, refused, invalid).",
                                  ("tool", "outcome"), registry=r)
        self.tool_seconds = Histogram(f"{p}_tool_call_duration_seconds", "Tool calls that ran (checks passed).",
                                      ("tool",), buckets=TOOL_BUCKETS, registry=r)
        self.gates_raised = Counter(f"{p}_gates_raised", "Gates that asked a person (a gate event was sent).",
                                    registry=r)
        self.gates_allowed = Counter(f"{p}_gates_allowed", "Gated tool calls allowed, by scope (policy, grant, "
                                     "model_prefix, once, minutes, session, pattern).", ("scope",), registry=r)
        self.gates_rejected = Counter(f"{p}_gates_rejected", "Gated tool calls rejected, by reason (user, timeout, "
                                      "no_approver).", ("reason",), registry=r)
        self.gates_routed = Counter(f"{p}_gates_routed", "Gates sent to configured approvers.", registry=r)
        self.rate_limited = Counter(f"{p}_rate_limit_refusals", "Tool calls refused by a rate limit, by tool type.",
                                    ("tool_type",), registry=r)
        self.proxy = Counter(f"{p}_proxy_conversations", "Proxy requests by how their session was found (matched: "
                             "continues a conversation; new; header: a forwarded id or the address).", ("result",),
                             registry=r)
        self.redis_calls = Counter(f"{p}_redis_round_trips", "Redis commands or pipelines sent.", registry=r)
        self.redis_failures = Counter(f"{p}_redis_failures", "Redis round trips that failed (connection, timeout).",
                                      registry=r)
        self.db_calls = Counter(f"{p}_db_queries", "db_query calls by outcome (ok, error).", ("outcome",), registry=r)
        self.db_seconds = Histogram(f"{p}_db_query_duration_seconds", "One db_query call, all its statements.",
                                    buckets=DB_BUCKETS, registry=r)
        # The fixed label values exist from the start (at 0), so rate() and increase() see their first event.
        for scope in ("policy", "grant", "model_prefix", *ALLOW_SCOPES.values()):
            self.gates_allowed.labels(scope)
        for reason in REJECTIONS.values():
            self.gates_rejected.labels(reason)
        for result in PROXY_RESULTS:
            self.proxy.labels(result)
        for outcome in ("ok", "error"):
            self.db_calls.labels(outcome)

    # ── turns and model calls ──

    def model_label(self, key: str) -> str:
        return key if key in self.models else OTHER

    @contextlib.contextmanager
    def turn(self, client_class: str, key: str) -> Iterator[None]:
        """Measure one LLM turn: its outcome (an exception: cancelled or error), duration, first token."""
        model = self.model_label(key)
        clock = _Clock(model)
        token = _CLOCK.set(clock)
        outcome = "error"
        try:
            yield
            outcome = "ok"
        except BaseException as exc:
            outcome = "error" if isinstance(exc, Exception) else "cancelled"
            raise
        finally:
            _CLOCK.reset(token)
            self.turns.labels(client_class, model, outcome).inc()
            self.turn_seconds.labels(model).observe(time.perf_counter() - clock.start)

    def first_answer_token(self) -> None:
        """The model of the running turn sent answer text: the first time in the turn, its delay is observed."""
        clock = _CLOCK.get()
        if clock is not None and clock.first is False:
            clock.first = True
            self.first_token.labels(clock.model).observe(time.perf_counter() - clock.start)

    @contextlib.contextmanager
    def model_call(self, classify: Callable[[BaseException], str]) -> Iterator[_Call]:
        """Measure one model call of the running turn (its model): ok with its reported tokens, or error by
        `classify(exc)`'s kind."""
        clock = _CLOCK.get()
        model = clock.model if clock is not None else OTHER
        call, start = _Call(), time.perf_counter()
        try:
            yield call
        except Exception as exc:
            self.model_calls.labels(model, "error").inc()
            self.model_errors.labels(model, classify(exc)).inc()
            raise
        self.model_calls.labels(model, "ok").inc()
        self.model_seconds.labels(model).observe(time.perf_counter() - start)
        usage = call.usage or {}
        if usage.get("input_tokens"):
            self.tokens.labels(model, "input").inc(usage["input_tokens"])
        if usage.get("output_tokens"):
            self.tokens.labels(model, "output").inc(usage["output_tokens"])

    def stream_cut(self) -> None:
        """A model call of the running turn (its model) ended its stream before the finish reason."""
        clock = _CLOCK.get()
        self.stream_cuts.labels(clock.model if clock is not None else OTHER).inc()

    # ── tools and gates ──

    def tool_call(self, name: str, status: str, refusal_kind: str | None, seconds: float | None,
                  tool_type: str = "") -> None:
        """One tool call's outcome (ok, error, refused, invalid); a refusal also counts as its gate rejection
        or rate-limit refusal; `seconds` is how long the tool ran (None: it did not run). `name` is a registered
        tool's name or OTHER (the caller's check: never a name a model made up)."""
        tool = name
        self.tool_calls.labels(tool, status).inc()
        if seconds is not None:
            self.tool_seconds.labels(tool).observe(seconds)
        if refusal_kind == "rate_limited":
            self.rate_limited.labels(tool_type or OTHER).inc()
        elif refusal_kind in REJECTIONS:
            self.gates_rejected.labels(REJECTIONS[refusal_kind]).inc()

    def gate_allowed(self, scope: str) -> None:
        """A gated call was allowed by `scope`: policy, grant, model_prefix, or a person's decision word."""
        self.gates_allowed.labels(ALLOW_SCOPES.get(scope, scope)).inc()

    def gate_raised(self) -> None:
        self.gates_raised.inc()

    def gate_answered(self, word: str) -> None:
        """A person's answer to a raised gate: an allow word counts as allowed (its scope); reject and timeout
        are counted with the refusal they become (tool_call)."""
        if word in ALLOW_SCOPES:
            self.gates_allowed.labels(ALLOW_SCOPES[word]).inc()

    def gate_routed(self) -> None:
        self.gates_routed.inc()

    # ── stores and plugins ──

    def proxy_conversation(self, result: str) -> None:
        self.proxy.labels(result).inc()

    def redis_round_trip(self) -> None:
        self.redis_calls.inc()

    def redis_failed(self) -> None:
        self.redis_failures.inc()

    def db_query(self, ok: bool, seconds: float) -> None:
        self.db_calls.labels("ok" if ok else "error").inc()
        self.db_seconds.observe(seconds)

    def watch(self, read: Callable[[], Mapping[str, float]]) -> None:
        """Read the gauges of `LEVELS` with `read()` at every scrape."""
        self.own.register(_Levels(read))


class _Off(Metrics):
    """Metrics switched off: every method does nothing (no metrics listener is enabled)."""

    on = False

    def __init__(self) -> None:  # no registry, no metric objects
        self.instance, self.models = "", frozenset()

    @contextlib.contextmanager
    def turn(self, client_class: str, key: str) -> Iterator[None]:
        yield

    def first_answer_token(self) -> None:
        return None

    @contextlib.contextmanager
    def model_call(self, classify: Callable[[BaseException], str]) -> Iterator[_Call]:
        yield _Call()

    def stream_cut(self) -> None:
        return None

    def tool_call(self, name: str, status: str, refusal_kind: str | None, seconds: float | None,
                  tool_type: str = "") -> None:
        return None

    def gate_allowed(self, scope: str) -> None:
        return None

    def gate_raised(self) -> None:
        return None

    def gate_answered(self, word: str) -> None:
        return None

    def gate_routed(self) -> None:
        return None

    def proxy_conversation(self, result: str) -> None:
        return None

    def redis_round_trip(self) -> None:
        return None

    def redis_failed(self) -> None:
        return None

    def db_query(self, ok: bool, seconds: float) -> None:
        return None

    def watch(self, read: Callable[[], Mapping[str, float]]) -> None:
        return None


#: The metrics of a runtime without a metrics listener.
OFF: Metrics = _Off()
