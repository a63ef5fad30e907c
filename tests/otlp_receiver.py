"""An OTLP/HTTP trace receiver on loopback for the tests: ``POST /v1/traces`` bodies decoded with
``opentelemetry-proto`` (``ExportTraceServiceRequest``) into plain :class:`Span` records."""

from __future__ import annotations

import gzip
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


@dataclass
class Span:
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    service: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    status: int  # 0 unset, 1 ok, 2 error
    kind: int
    events: list[str] = field(default_factory=list)
    trace_state: str = ""
    resource: dict[str, Any] = field(default_factory=dict)  # the sending process's attributes

    @property
    def duration_ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


class Receiver:
    """Collects spans; ``wait(predicate)`` blocks until the spans satisfy it (bounded)."""

    def __init__(self, discard: bool = False) -> None:
        self.spans: list[Span] = []
        self.requests = 0
        self._cond = threading.Condition()
        self._discard = discard
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as a collector: each export is not a new connection

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                receiver._take(body)
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> Receiver:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _take(self, body: bytes) -> None:
        if self._discard:
            with self._cond:
                self.requests += 1
            return
        request = ExportTraceServiceRequest.FromString(body)
        spans = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for s in scope_spans.spans:
                    spans.append(Span(s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(),
                                      str(resource.get("service.name")), s.start_time_unix_nano,
                                      s.end_time_unix_nano, {a.key: _value(a.value) for a in s.attributes},
                                      s.status.code, s.kind, [e.name for e in s.events], s.trace_state,
                                      resource))
        with self._cond:
            self.requests += 1
            self.spans += spans
            self._cond.notify_all()

    def of(self, trace_id: str) -> list[Span]:
        with self._cond:
            return [s for s in self.spans if s.trace_id == trace_id]

    def wait(self, predicate: Callable[[list[Span]], bool], timeout_s: float, what: str) -> list[Span]:
        with self._cond:
            if not self._cond.wait_for(lambda: predicate(self.spans), timeout_s):
                raise AssertionError(f"timed out after {timeout_s}s waiting for {what}; "
                                     f"{len(self.spans)} spans received")
            return list(self.spans)

    def wait_trace(self, trace_id: str, count: int, timeout_s: float = 20.0) -> list[Span]:
        """The spans of ``trace_id`` once at least ``count`` have arrived."""
        self.wait(lambda spans: sum(s.trace_id == trace_id for s in spans) >= count, timeout_s,
                  f"{count} spans of trace {trace_id}")
        return self.of(trace_id)


def by_trace(spans: list[Span]) -> Iterator[tuple[str, list[Span]]]:
    groups: dict[str, list[Span]] = {}
    for span in spans:
        groups.setdefault(span.trace_id, []).append(span)
    yield from groups.items()
