"""The trace of one request as the gateway's client side sees it: what its stream entries carry, and
the stages' timings its answer brought back. A leaf, shared by the HTTP front (which starts and ends
a request's span: :mod:`gateway.http.tracing`) and the hub (which submits and resolves requests).

Why a context variable: the HTTP routes call ``backend.submit`` (conveyor's predict, the Open
Inference Protocol, OpenAI's embeddings) without a parameter for it; the front sets :data:`CURRENT`
around a route's start, and the hub reads it when it queues the request (a task the route starts
copies it). Unset for nearly every request (not sampled, no timing asked): one ``get`` per request.
"""

from __future__ import annotations

from contextvars import ContextVar

__all__ = ["CURRENT", "RequestTrace"]


class RequestTrace:
    """One sampled (or timed) request: its span's ids, its ``trace`` field value (broker.tracing),
    when it arrived, and the timings its answers carried (the slowest item's, for a request of several)."""

    __slots__ = ("field", "parent_id", "sampled", "span_id", "start_ns", "timing", "trace_id", "tracestate")

    def __init__(self, trace_id: bytes, span_id: bytes, parent_id: bytes, sampled: bool, field: bytes,
                 start_ns: int, tracestate: str | None = None) -> None:
        self.trace_id = trace_id
        self.span_id = span_id
        self.parent_id = parent_id  # the caller's span (its traceparent), b"" for none
        self.sampled = sampled
        self.field = field
        self.start_ns = start_ns
        self.tracestate = tracestate
        self.timing: list[tuple[float, float]] | None = None

    def answered(self, timing: object) -> None:
        """An answer's ``timing`` (``"<q>,<c> <q>,<c>"``, one pair per stage), kept if it is the slowest."""
        if not isinstance(timing, str):
            return
        try:
            pairs = [(float(q), float(c)) for q, c in (token.split(",") for token in timing.split())]
        except ValueError:
            return
        if self.timing is None or sum(q + c for q, c in pairs) > sum(q + c for q, c in self.timing):
            self.timing = pairs


CURRENT: ContextVar[RequestTrace | None] = ContextVar("conveyor_request_trace", default=None)
