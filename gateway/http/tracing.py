"""A request's span and timing headers at the HTTP front (every route that runs a pipeline: conveyor's
predict, the Open Inference Protocol's infer, OpenAI's embeddings: every ``POST``).

**Span.** The front continues the caller's trace from ``traceparent`` (and keeps its ``tracestate``)
or starts one, and decides there, once, whether the request is sampled (:class:`broker.tracing.
TraceSettings`: ``OTEL_TRACES_SAMPLER``, the caller's flag for the ``parentbased_*`` samplers). A
sampled request's span (kind SERVER, named ``POST <route>``) runs from the moment the front routes
it to the moment its answer is framed, with the status code and conveyor's outcome as attributes,
status ERROR for a 5xx, a stage's error (422) or a timeout; its ``traceparent`` is what the request's
stream entries carry, so every stage's spans are its children (docs/operations.md, "Traces"). A
request not sampled costs a random draw here and nothing anywhere else.

**Timing headers** (``HttpSettings.timing_headers``, ``conveyor gateway --timing-headers``; off by
default: asking every request's stages for their timings makes every entry carry a ``trace``
field): ``x-total-time``, ``x-queue-time``, ``x-inference-time`` in ms (as text-embeddings-inference
sends them; queue and inference summed over the stages, for a request of several items the
slowest item's), and ``Server-Timing`` with those and each stage's ``queue-<i>`` and
``inference-<i>``, for browsers' tools. They are the spans' own numbers: the total is the request
span's duration; each stage's are its wait and predict spans' (:mod:`workers.loop.tracing`).
"""

from __future__ import annotations

import functools
import os
import time
from dataclasses import replace

from broker import otlp, tracing
from gateway.client.trace_context import RequestTrace
from gateway.http.types import Reply, Request

__all__ = ["RequestTracing"]

TRACEPARENT = b"traceparent"
TRACESTATE = b"tracestate"
# W3C Trace Context: a vendor propagates at least 512 characters of tracestate and may drop a longer one.
TRACESTATE_MAX_BYTES = 512
_TRACESTATE_BYTES = bytes(range(0x20, 0x7F)) + b"\t"  # what a W3C tracestate header holds
_FAILED_OUTCOMES = frozenset({"stage_error", "timeout", "error"})
_CHUNKS = otlp.key("conveyor.stream.chunks")
_CANCELLED = otlp.attributes({"conveyor.outcome": "cancelled"})
_CACHED = 256  # encoded tails kept (routes and paths that run a pipeline; outcomes)


class RequestTracing:
    """One front's tracing and timing headers; ``active`` is False when neither is on (then the
    connection never calls it)."""

    def __init__(self, traces: tracing.TraceSettings, timing_headers: bool) -> None:
        self.traces = traces
        self.timing_headers = timing_headers
        self.active = traces.enabled or timing_headers
        self._sink: tracing.SpanSink | None = None

    def start(self) -> None:
        """Start exporting (the OTLP exporter reads its ``OTEL_EXPORTER_OTLP_*`` variables now)."""
        if self.traces.enabled and self._sink is None:
            self._sink = tracing.start_sink("conveyor-gateway", os.environ)

    def close(self) -> None:
        if self._sink is not None:
            self._sink.close()
            self._sink = None

    def finish_stream(self, trace: RequestTrace, request: Request, route: str, outcome: str, first_chunk_ns: int,
                      chunks: int) -> None:
        """A streamed answer's span, once its last bytes are written: its first chunk's moment an
        event (``first chunk``) and ``conveyor.stream.first_chunk_ms`` from the request's start, its
        chunks counted. (Its head went out with the first chunk: no timing headers.)"""
        sink = self._sink
        if not trace.sampled or sink is None:
            return
        end_ns = time.time_ns()
        tail = _route_tail(request.method, request.path, route) + _outcome(200, outcome) \
            + otlp.int_attribute(_CHUNKS, chunks)
        if first_chunk_ns:
            tail += otlp.event("first chunk", first_chunk_ns) + otlp.attributes(
                {"conveyor.stream.first_chunk_ms": (first_chunk_ns - trace.start_ns) / 1e6})
        if outcome in _FAILED_OUTCOMES:
            tail += otlp.error("stream", outcome, "", end_ns)
        self._record(sink, trace, tail, end_ns)

    def abandoned(self, trace: RequestTrace | None, request: Request, route: str) -> None:
        """The span of a request cancelled before its answer was written (its client left, or the
        gateway stopped while streaming it): outcome ``cancelled``, no status code. Without it the
        spans its stages recorded would have no parent."""
        sink = self._sink
        if trace is not None and trace.sampled and sink is not None:
            self._record(sink, trace, _route_tail(request.method, request.path, route) + _CANCELLED, time.time_ns())

    @staticmethod
    def _record(sink: tracing.SpanSink, trace: RequestTrace, tail: bytes, end_ns: int) -> None:
        if trace.tracestate:
            tail += otlp.tracestate(trace.tracestate)
        sink.record(otlp.span(trace.trace_id, trace.span_id, trace.parent_id, trace.start_ns, end_ns, tail))

    def begin(self, request: Request) -> RequestTrace | None:
        """The request's trace if it is sampled or timed, else None (nearly always, at a low rate)."""
        headers = request.headers
        raw = headers.get(TRACEPARENT)
        parent = tracing.parse_traceparent(raw) if raw is not None else None
        sampled = self.traces.enabled and self._sink is not None and self.traces.sampled(
            None if parent is None else parent[2])
        if not sampled and not self.timing_headers:
            return None
        trace_id = parent[0] if parent is not None else tracing.new_trace_id()
        span_id = tracing.new_span_id()
        own = tracing.traceparent(trace_id, span_id) if sampled else None
        state = headers.get(TRACESTATE) if parent is not None else None  # W3C: not without a traceparent
        if state is not None and (len(state) > TRACESTATE_MAX_BYTES or state.translate(None, _TRACESTATE_BYTES)):
            state = None  # too long, kept on the span it would weigh on every export; or not W3C's printable ASCII
        return RequestTrace(trace_id, span_id, b"" if parent is None else parent[1], sampled,
                            tracing.field_value(own, self.timing_headers), time.time_ns(),
                            state.decode("latin-1") if state else None)

    def finish(self, trace: RequestTrace, request: Request, route: str, reply: Reply) -> Reply:
        """The reply with its timing headers (if on); the request's span recorded (if sampled)."""
        end_ns = time.time_ns()
        if self.timing_headers:
            reply = replace(reply, headers=(*reply.headers, *timing_headers((end_ns - trace.start_ns) / 1e6,
                                                                            trace.timing)))
        if trace.sampled and self._sink is not None:
            tail = _route_tail(request.method, request.path, route) + _outcome(reply.status, reply.outcome)
            if reply.status >= 500 or reply.outcome in _FAILED_OUTCOMES:
                tail += otlp.error(f"HTTP {reply.status}", reply.outcome, "", end_ns)
            self._record(self._sink, trace, tail, end_ns)
        return reply


@functools.lru_cache(maxsize=_CACHED)
def _route_tail(method: bytes, path: bytes, route: str) -> bytes:
    """A route's span name, kind and request attributes, encoded once per method, path and route."""
    name = method.decode("latin-1")
    return otlp.head(f"{name} {route}", otlp.KIND_SERVER) + otlp.attributes(
        {"http.request.method": name, "url.path": path.decode("latin-1"), "http.route": route})


@functools.lru_cache(maxsize=_CACHED)
def _outcome(status: int, outcome: str) -> bytes:
    return otlp.attributes({"http.response.status_code": status, "conveyor.outcome": outcome})


def timing_headers(total_ms: float, stages: list[tuple[float, float]] | None) -> list[tuple[bytes, bytes]]:
    """``x-total-time``, ``x-queue-time``, ``x-inference-time`` (ms) and ``Server-Timing``; queue and
    inference only once the stages' timings came back (not for a request refused or timed out)."""
    headers = [(b"x-total-time", b"%.3f" % total_ms)]
    timing = [b"total;dur=%.3f" % total_ms]
    if stages:
        queue, inference = sum(q for q, _ in stages), sum(c for _, c in stages)
        headers += ((b"x-queue-time", b"%.3f" % queue), (b"x-inference-time", b"%.3f" % inference))
        timing[:0] = (b"queue;dur=%.3f" % queue, b"inference;dur=%.3f" % inference)
        for i, (q, c) in enumerate(stages):
            timing += (b"queue-%d;dur=%.3f" % (i, q), b"inference-%d;dur=%.3f" % (i, c))
    headers.append((b"server-timing", b", ".join(timing)))
    return headers
