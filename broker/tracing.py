"""OpenTelemetry traces across conveyor's processes: configuration, the ``trace`` field, a span sink.

**Off unless configured.** :meth:`TraceSettings.from_env` reads the standard ``OTEL_*`` variables when
a process starts (never at import): tracing is on when ``OTEL_EXPORTER_OTLP_ENDPOINT`` or
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` is set, or ``OTEL_TRACES_EXPORTER`` names ``otlp``; off when
``OTEL_SDK_DISABLED=true`` or ``OTEL_TRACES_EXPORTER=none``. The SDK and its OTLP/HTTP exporter (the
``[otel]`` extra) are imported only then, by :func:`start_sink`: the core install never needs them.

**Sampling is decided once, at the gateway** (:meth:`TraceSettings.sampled`): ``OTEL_TRACES_SAMPLER``
(default ``parentbased_always_on``) and ``OTEL_TRACES_SAMPLER_ARG`` (the ratio), the ``parentbased_*``
samplers honouring the caller's ``traceparent`` flag. Only a sampled request carries the ``trace``
field in its stream entries (docs/protocol.md), so an unsampled one costs Redis and the workers
nothing; a worker traces whatever entry carries a sampled ``traceparent``, a foreign producer's too.

**The ``trace`` field** (:func:`field_value`): ASCII tokens separated by spaces: the W3C
``traceparent`` (``-``: none), then ``t`` if the producer asks for timings, then one ``<queue
ms>,<predict ms>`` token per stage passed, which each stage appends (:func:`with_timing`) and the
last one copies into the result record (``timing``). Every stage's spans are children of the span
the ``traceparent`` names (the gateway's request span): each stage forwards the value it read, plus
its timing token, so the parent stays one and the tree stays flat and simple.

**Spans are made off the hot path** (:class:`SpanSink`): the caller records a tuple (ids, times,
attributes) per span, a thread of the sink turns them into OTLP protobuf bytes (:mod:`broker.otlp`, a
few microseconds a span where the SDK's encoder takes ~75) and sends them with the SDK's OTLP/HTTP
exporter's client. The
span's times are given, not measured by the SDK: a worker's wait span starts at its entry's id (when
it entered the stream) and the numbers a timing header reports are the spans' own.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("conveyor.tracing")

__all__ = ["SpanRecord", "SpanSink", "TraceSettings", "field_value", "new_span_id", "new_trace_id",
           "parse_traceparent", "start_sink", "timing_asked", "timings", "traceparent", "with_timing"]

_RATIO_SAMPLERS = ("traceidratio", "parentbased_traceidratio")
_SAMPLERS = ("always_on", "always_off", "parentbased_always_on", "parentbased_always_off", *_RATIO_SAMPLERS)
NO_PARENT = b"-"
TIMING = b"t"


@dataclass(frozen=True)
class TraceSettings:
    """Whether this process traces, and how the gateway samples (``OTEL_TRACES_SAMPLER``)."""

    enabled: bool = False
    sampler: str = "parentbased_always_on"
    ratio: float = 1.0

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> TraceSettings:
        """The standard variables, read when a process starts (the module docstring says which)."""
        exporter = environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
        disabled = environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true" or exporter == "none"
        endpoint = environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        enabled = not disabled and (bool(endpoint) or "otlp" in exporter.split(","))
        sampler = environ.get("OTEL_TRACES_SAMPLER", "parentbased_always_on").strip().lower()
        if sampler not in _SAMPLERS:
            log.warning("OTEL_TRACES_SAMPLER=%s is not one conveyor knows (%s): parentbased_always_on", sampler,
                        ", ".join(_SAMPLERS))
            sampler = "parentbased_always_on"
        ratio = 1.0
        if sampler in _RATIO_SAMPLERS:
            try:
                ratio = min(1.0, max(0.0, float(environ.get("OTEL_TRACES_SAMPLER_ARG", "1.0"))))
            except ValueError:
                log.warning("OTEL_TRACES_SAMPLER_ARG is not a number: sampling every request")
        return cls(enabled, sampler, ratio)

    def sampled(self, parent_flags: int | None) -> bool:
        """Whether a request is traced: ``parent_flags`` is its caller's ``traceparent`` flags (None:
        no parent). A ratio is drawn per request (the SDK draws it from the trace id: the same odds)."""
        sampler = self.sampler
        if parent_flags is not None and sampler.startswith("parentbased"):
            return bool(parent_flags & 1)
        if sampler.endswith("always_on"):
            return True
        if sampler.endswith("always_off"):
            return False
        return random.random() < self.ratio


def new_trace_id() -> int:
    return random.getrandbits(128) or 1


def new_span_id() -> int:
    return random.getrandbits(64) or 1


def parse_traceparent(raw: bytes | None) -> tuple[int, int, int] | None:
    """(trace id, parent span id, flags) of a W3C ``traceparent`` (version 00 or later), None if
    absent or malformed (then the request starts a trace of its own, as the spec says)."""
    if raw is None or len(raw) < 55 or raw[2:3] != b"-" or raw[35:36] != b"-" or raw[52:53] != b"-":
        return None
    try:
        version, trace_id, span_id, flags = int(raw[:2], 16), int(raw[3:35], 16), int(raw[36:52], 16), \
            int(raw[53:55], 16)
    except ValueError:
        return None
    if version == 0xFF or not trace_id or not span_id or (version == 0 and len(raw) != 55):
        return None
    return trace_id, span_id, flags


def traceparent(trace_id: int, span_id: int, sampled: bool = True) -> bytes:
    return b"00-%032x-%016x-%02x" % (trace_id, span_id, 1 if sampled else 0)


def field_value(parent: bytes | None, timing: bool) -> bytes:
    """A request's ``trace`` field as its producer writes it (module docstring)."""
    value = parent or NO_PARENT
    return value + b" t" if timing else value


def timing_asked(value: bytes) -> bool:
    return value[56:57] == TIMING or value[:3] == b"- t"


def with_timing(value: bytes, queue_ms: float, predict_ms: float) -> bytes:
    """The value a stage forwards: its own timing token appended."""
    return b"%b %.3f,%.3f" % (value, queue_ms, predict_ms)


def timings(value: bytes) -> bytes:
    """The timing tokens of a value (what the result record's ``timing`` holds)."""
    head = value.find(b" t")
    return value[head + 3:] if head >= 0 else b""


def parent_of(value: bytes) -> tuple[int, int, int] | None:
    """The sampled ``traceparent`` a value names, or None (none, malformed, or not sampled)."""
    parent = parse_traceparent(value[:55])
    return parent if parent is not None and parent[2] & 1 else None


@dataclass(slots=True)
class SpanRecord:
    """One finished span, as a hot path records it: the sink encodes it later, on its own thread."""

    name: str
    trace_id: int
    span_id: int
    parent_id: int
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    server: bool = False  # the gateway's request span (kind SERVER); stages' spans are INTERNAL
    error: tuple[str, str, str] | None = None  # exception type, message, traceback
    constant: bytes = b""  # attributes every span of the process has, encoded once (broker.otlp.attributes)
    tracestate: str | None = None  # the caller's W3C tracestate, kept on the gateway's span


class SpanSink:
    """Encodes :class:`SpanRecord` s (:mod:`broker.otlp`) and sends them, on a thread of its own, every
    ``period_s`` or as soon as ``batch`` wait, at most ``batch`` per request; the recording side only
    appends. ``send``: the OTLP/HTTP exporter's client's ``export(bytes)`` (:func:`start_sink`). At most
    ``queue`` spans wait: past that, new ones are dropped (counted in ``dropped``), as the SDK's batch
    processor does, so that a collector that cannot keep up never grows a process. Why not send
    sooner: one HTTP request costs the exporter's client a millisecond or more of CPU, which at a low
    sampling rate and a short period was most of tracing's cost (docs/benchmarks.md, "Tracing")."""

    def __init__(self, send: Any, resource: Mapping[str, Any], period_s: float = 5.0, batch: int = 512,
                 queue: int = 65_536) -> None:
        self.WAKE_AT = self.MAX_BATCH = max(1, batch)
        self.MAX_QUEUE = max(1, queue)
        self._send = send
        self._resource = dict(resource)
        self._period_s = period_s
        self._records: deque[SpanRecord] = deque()
        self._wake = threading.Event()
        self._stopped = False
        self.dropped = 0
        self._thread = threading.Thread(target=self._run, name="conveyor-spans", daemon=True)
        self._thread.start()

    def record(self, span: SpanRecord) -> None:
        records = self._records
        if len(records) >= self.MAX_QUEUE:
            self.dropped += 1
            return
        records.append(span)
        if len(records) >= self.WAKE_AT:
            self._wake.set()

    def _run(self) -> None:
        while not self._stopped:
            self._wake.wait(self._period_s)
            self._wake.clear()
            self._drain()

    def _drain(self) -> None:
        from broker import otlp

        records = self._records
        while records:
            batch: list[bytes] = []
            while records and len(batch) < self.MAX_BATCH:
                r = records.popleft()
                batch.append(otlp.span(r.trace_id, r.span_id, r.parent_id, r.name,
                                       otlp.KIND_SERVER if r.server else otlp.KIND_INTERNAL, r.start_ns, r.end_ns,
                                       r.constant, r.attributes, r.tracestate, r.error))
            try:
                result = self._send(otlp.export_request(self._resource, "conveyor", batch))
                if getattr(result, "success", True) is False:
                    log.warning("span export failed error=%s", getattr(result, "error", None))
            except Exception:  # an exporter's trouble must never reach the request path
                log.exception("span export failed")

    def close(self, timeout_s: float = 5.0) -> None:
        """Send what was recorded (bounded), then stop."""
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout_s)
        self._drain()


def start_sink(service_name: str, environ: Mapping[str, str]) -> SpanSink:
    """A sink sending through the SDK's OTLP/HTTP exporter as the ``OTEL_*`` variables configure it
    (endpoint, headers, compression, timeout), its resource from ``OTEL_SERVICE_NAME`` and
    ``OTEL_RESOURCE_ATTRIBUTES``, else ``service_name``. Raises ImportError with the install line when
    the ``[otel]`` extra is missing."""
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    except ImportError as exc:
        raise ImportError(f"tracing is configured (OTEL_*) but the OpenTelemetry SDK is missing: "
                          f"pip install 'conveyor[otel]' ({exc})") from exc
    attributes = {} if environ.get("OTEL_SERVICE_NAME") else {SERVICE_NAME: service_name}
    resource = Resource.create(attributes).attributes
    exporter = OTLPSpanExporter()
    client = getattr(exporter, "_client", None)  # the transport the exporter sends encoded bytes with (1.45)
    if client is None:
        raise ImportError("this opentelemetry-exporter-otlp-proto-http has no transport client: "
                          "pip install 'conveyor[otel]' (the pinned 1.45.2)")
    return SpanSink(client.export, resource, _env_number(environ, "OTEL_BSP_SCHEDULE_DELAY", 5000) / 1000,
                    int(_env_number(environ, "OTEL_BSP_MAX_EXPORT_BATCH_SIZE", 512)),
                    int(_env_number(environ, "OTEL_BSP_MAX_QUEUE_SIZE", 65_536)))


def _env_number(environ: Mapping[str, str], name: str, default: float) -> float:
    try:
        return float(environ.get(name) or default)
    except ValueError:
        log.warning("%s is not a number: %g", name, default)
        return default


def now_ns() -> int:
    return time.time_ns()
