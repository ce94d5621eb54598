"""OpenTelemetry traces of one server instance (optional: `pip install -e '.[otel]'`).

Set the standard `OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) and every
LLM turn becomes a span (`invoke_agent`), with a child span per model call (`chat <model>`) and per
tool call (`execute_tool <tool>`), and a gate's wait for a person as a span (`gate <tool>`). The
attributes follow the OpenTelemetry GenAI semantic conventions (gen_ai.operation.name,
gen_ai.request.model, gen_ai.usage.input_tokens / output_tokens, gen_ai.response.finish_reasons,
gen_ai.tool.name). A swarm `agent_call` sends the W3C `traceparent` of its tool span, and the API
endpoint continues the trace it names, so one trace shows one agent calling another.

No prompt, answer or tool text is put in a span unless the operator sets
`OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=true` (the variable the OpenTelemetry GenAI
instrumentations use). Without the packages, or without an endpoint, `OFF` does nothing and costs
nothing. Each runtime has its own TracerProvider (none is installed globally). Imports nothing of ours.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import Any

try:
    from opentelemetry import context as otel_context
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
    from opentelemetry.trace.status import Status, StatusCode
except ImportError:  # the otel extra is not installed: tracing stays off
    trace = None  # type: ignore[assignment]  # the module's stand-in: None means tracing is off

logger = logging.getLogger("agent_mcp.tracing")

#: The variable that lets span attributes carry prompt, answer and tool text (off by default).
CONTENT_VAR = "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT"
#: The longest text put in one attribute when content capture is on.
MAX_CONTENT = 4000
#: gen_ai.provider.name of each model type of llm-models.json.
PROVIDERS = {"OPENAI": "openai", "GEMINI": "gcp.gemini"}
_TRUE = ("1", "true", "yes", "on")


class Tracing:
    """Spans of one runtime; a no-op (`on` False) when built without a tracer provider."""

    def __init__(self, provider: Any = None, *, content: bool = False):
        self.provider = provider
        self.on = provider is not None and trace is not None
        self.content = content and self.on
        self._tracer = provider.get_tracer("agent-mcp") if self.on else None
        self._propagator = TraceContextTextMapPropagator() if self.on else None

    @contextlib.contextmanager
    def span(self, name: str, attributes: Mapping[str, Any], *, client: bool = False) -> Iterator[Any]:
        """A span named `name`, current within; an exception marks it as an error (error.type) and passes on.
        Yields the span (None when tracing is off): set more attributes on it with `note`."""
        if self._tracer is None:
            yield None
            return
        kind = trace.SpanKind.CLIENT if client else trace.SpanKind.INTERNAL
        with self._tracer.start_as_current_span(name, kind=kind, attributes=dict(attributes), record_exception=False,
                                                set_status_on_exception=False) as span:
            try:
                yield span
            except BaseException as exc:
                span.set_attribute("error.type", "cancelled" if not isinstance(exc, Exception)
                                   else type(exc).__name__)
                span.set_status(Status(StatusCode.ERROR))
                raise

    @contextlib.asynccontextmanager
    async def waiting(self, name: str) -> AsyncIterator[Any]:
        """`span` for `async with` (a gate's wait for a person)."""
        with self.span(name, {"agent_mcp.operation": "gate_wait"}) as span:
            yield span

    @staticmethod
    def note(span: Any, **attributes: Any) -> None:
        """Set attributes on `span` (keys with `__` for `.`: gen_ai__usage__input_tokens); None values are left out."""
        if span is not None:
            for key, value in attributes.items():
                if value is not None:
                    span.set_attribute(key.replace("__", "."), value)

    def text(self, span: Any, key: str, value: Any) -> None:
        """Put prompt, answer or tool text in an attribute only when the operator turned content capture on."""
        if self.content and span is not None and value is not None:
            span.set_attribute(key, str(value)[:MAX_CONTENT])

    def headers(self) -> dict[str, str]:
        """The W3C trace context (`traceparent`) of the current span, for a request to another agent."""
        carrier: dict[str, str] = {}
        if self._propagator is not None:
            self._propagator.inject(carrier)
        return carrier

    @contextlib.contextmanager
    def continuing(self, traceparent: Any) -> Iterator[None]:
        """Within: spans started are children of the remote span `traceparent` names (a W3C header value)."""
        if self._propagator is None or not isinstance(traceparent, str) or not traceparent:
            yield
            return
        token = otel_context.attach(self._propagator.extract({"traceparent": traceparent[:256]}))
        try:
            yield
        finally:
            otel_context.detach(token)

    def close(self) -> None:
        """Send what is buffered and stop the exporter (blocking: call it in a thread)."""
        if self.provider is not None:
            with contextlib.suppress(Exception):
                self.provider.force_flush(2000)
            with contextlib.suppress(Exception):
                self.provider.shutdown()


def from_env(env: Mapping[str, str], instance: str) -> Tracing:
    """Tracing to the OTLP/HTTP endpoint of `OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT`, else off. An endpoint
    without the otel extra installed is one warning, never an error."""
    traces = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
    base = env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip()
    if not traces and not base:
        return OFF
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() in _TRUE:
        return OFF
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        logger.warning("OTEL_EXPORTER_OTLP_ENDPOINT is set but the OpenTelemetry packages are not installed, so no "
                       "traces are sent: pip install -c constraints.txt -e '.[otel]'")
        return OFF
    endpoint = traces or base.rstrip("/") + "/v1/traces"
    resource = Resource.create({"service.name": env.get("OTEL_SERVICE_NAME") or "agent-mcp",
                                "service.instance.id": instance})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    logger.info("traces: OpenTelemetry to %s%s", endpoint.split("?")[0],
                " (with prompt and tool text)" if env.get(CONTENT_VAR, "").lower() in _TRUE else "")
    return Tracing(provider, content=env.get(CONTENT_VAR, "").strip().lower() in _TRUE)


#: Tracing switched off.
OFF = Tracing()
