"""A fake OpenTelemetry collector: OTLP/HTTP with protobuf bodies (`POST /v1/traces`), as the OTLP exporter
of opentelemetry-exporter-otlp-proto-http sends them; the spans it received are kept for the test."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from tests.fakes.server import ThreadedServer


def _value(any_value: Any) -> Any:
    kind = any_value.WhichOneof("value")
    if kind == "array_value":
        return tuple(_value(v) for v in any_value.array_value.values)
    return getattr(any_value, kind) if kind else None


@dataclass
class Span:
    """One received span: its ids as hex, name, attributes and its resource's attributes."""

    name: str
    trace_id: str
    span_id: str
    parent_id: str
    attributes: dict[str, Any]
    resource: dict[str, Any] = field(default_factory=dict)


class FakeCollector(ThreadedServer):
    """Receives OTLP/HTTP protobuf trace exports; `spans` holds every span received."""

    def __init__(self) -> None:
        super().__init__()
        self.spans: list[Span] = []
        self.lock = threading.Lock()

    def app(self) -> Starlette:
        return Starlette(routes=[Route("/v1/traces", self._traces, methods=["POST"])])

    async def _traces(self, request: Request) -> Response:
        if request.headers.get("content-type") != "application/x-protobuf":
            return Response(status_code=415)
        export = ExportTraceServiceRequest.FromString(await request.body())
        received = []
        for resource_spans in export.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for s in scope_spans.spans:
                    received.append(Span(s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(),
                                         {a.key: _value(a.value) for a in s.attributes}, resource))
        with self.lock:
            self.spans += received
        return Response(ExportTraceServiceResponse().SerializeToString(),
                        headers={"Content-Type": "application/x-protobuf"})
