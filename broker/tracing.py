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

**Spans are encoded where they end and sent off the hot path** (:class:`SpanSink`): the recorder
packs each span into OTLP protobuf bytes (:mod:`broker.otlp`: its ids and times, then a tail it
encoded once for the spans that share it), a thread of the sink sends them in batches with the SDK's
OTLP/HTTP exporter's client. The span's times are given, not measured by the SDK: a worker's wait
span starts at its entry's id (when it entered the stream) and the numbers a timing header reports
are the spans' own.
"""

from __future__ import annotations

import logging
import math
import random
import re
import threading
import time
from binascii import hexlify, unhexlify
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("conveyor.tracing")

__all__ = ["SpanSink", "TraceSettings", "field_value", "new_span_id", "new_trace_id",
           "parse_traceparent", "start_sink", "timing_asked", "timings", "traceparent", "with_timing"]

_RATIO_SAMPLERS = ("traceidratio", "parentbased_traceidratio")
_SAMPLERS = ("always_on", "always_off", "parentbased_always_on", "parentbased_always_off", *_RATIO_SAMPLERS)
NO_PARENT = b"-"
_NO_TRACE, _NO_SPAN = bytes(16), bytes(8)
_HEX, _ODD_HEX = frozenset(b"0123456789abcdefABCDEF"), frozenset(b"13579bdfBDF")
_TRACEPARENT = re.compile(rb"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?", re.S)
_AFTER_VERSION_00 = (b"", b" ")  # what may follow a version 00 traceparent in a ``trace`` value
_AFTER_LATER_VERSION = (b"", b" ", b"-")
_LOWER_HEX_AND_DASH = b"0123456789abcdef-"
# Spans per export unless OTEL_BSP_MAX_EXPORT_BATCH_SIZE says otherwise: not the SDK's 512, because a
# post costs the exporter's client about the same CPU whatever its size (docs/benchmarks.md,
# "Tracing"). An export also stops at EXPORT_BYTES (spans with long error texts are large), well
# under a collector's limit for a request (20 MiB for the OpenTelemetry Collector's OTLP/HTTP).
EXPORT_BATCH = 16384
EXPORT_BYTES = 4 << 20
TIMING = b"t"


@dataclass(frozen=True)
class TraceSettings:
    """Whether this process traces, and how the gateway samples (``OTEL_TRACES_SAMPLER``)."""

    enabled: bool = False
    sampler: str = "parentbased_always_on"
    ratio: float = 1.0
    _parent_based: bool = field(init=False, repr=False, compare=False)
    _odds: float = field(init=False, repr=False, compare=False)

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
        return cls(enabled, sampler, _ratio(environ.get("OTEL_TRACES_SAMPLER_ARG")) if sampler in _RATIO_SAMPLERS
                   else 1.0)

    def __post_init__(self) -> None:
        # What sampled() reads: whether the caller's flag decides, and the odds of a request without one.
        object.__setattr__(self, "_parent_based", self.sampler.startswith("parentbased"))
        object.__setattr__(self, "_odds", 1.0 if self.sampler.endswith("always_on")
                           else 0.0 if self.sampler.endswith("always_off") else self.ratio)

    def sampled(self, parent_flags: int | None) -> bool:
        """Whether a request is traced: ``parent_flags`` is its caller's ``traceparent`` flags (None:
        no parent). A ratio is drawn per request (the SDK draws it from the trace id: the same odds)."""
        if parent_flags is not None and self._parent_based:
            return bool(parent_flags & 1)
        odds = self._odds
        return odds >= 1.0 or (odds > 0.0 and random.random() < odds)


def _ratio(raw: str | None) -> float:
    """``OTEL_TRACES_SAMPLER_ARG``: a ratio from 0 to 1 (default 1); one that is no number is warned of
    and every request sampled, one out of range warned of and taken to the nearest bound (``5`` for
    5 % would otherwise sample every request, unsaid)."""
    try:
        ratio = float(raw if raw is not None else 1.0)
    except ValueError:
        ratio = math.nan
    if math.isnan(ratio):
        log.warning("OTEL_TRACES_SAMPLER_ARG=%s is not a number: sampling every request", raw)
        return 1.0
    if not 0.0 <= ratio <= 1.0:
        log.warning("OTEL_TRACES_SAMPLER_ARG=%s is not a ratio from 0 to 1: %g", raw, min(1.0, max(0.0, ratio)))
    return min(1.0, max(0.0, ratio))


def new_trace_id() -> bytes:
    trace_id = random.getrandbits(128).to_bytes(16, "big")
    return new_trace_id() if trace_id == _NO_TRACE else trace_id


def new_span_id() -> bytes:
    span_id = random.getrandbits(64).to_bytes(8, "big")
    return new_span_id() if span_id == _NO_SPAN else span_id


def parse_traceparent(raw: bytes | None) -> tuple[bytes, bytes, int] | None:
    """(trace id, parent span id, flags) of a W3C ``traceparent`` (version 00 or later; the ids as
    16 and 8 bytes), None if absent or malformed (then the request starts a trace of its own, as
    the spec says): lowercase hex fields of their exact sizes, version not ff, nothing after version
    00's 55 characters and, for a later version, only what follows a ``-``."""
    match = _TRACEPARENT.fullmatch(raw) if raw is not None else None
    if match is None:
        return None
    version, trace_hex, span_hex, flags, rest = match.groups()
    if version == b"ff" or (version == b"00" and rest is not None):
        return None
    trace_id, span_id = unhexlify(trace_hex), unhexlify(span_hex)
    if trace_id == _NO_TRACE or span_id == _NO_SPAN:
        return None
    return trace_id, span_id, int(flags, 16)


def traceparent(trace_id: bytes, span_id: bytes, sampled: bool = True) -> bytes:
    return b"00-%b-%b-%b" % (hexlify(trace_id), hexlify(span_id), b"01" if sampled else b"00")


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


def _sampled_form(value: bytes) -> bool:
    """Whether ``value`` starts with a sampled ``traceparent``'s form (any version but ff, any flags
    with the sampled bit), the ids' hex aside: the rules one by one, for what the common form is not."""
    return len(value) >= 55 and value[54] in _ODD_HEX and value[53] in _HEX and value[2] == 45 and value[35] == 45 \
        and value[52] == 45 and value[0] in _HEX and value[1] in _HEX and value[:2] not in (b"ff", b"FF") \
        and value[55:56] in (_AFTER_VERSION_00 if value[:2] == b"00" else _AFTER_LATER_VERSION)


def parent_of(value: bytes) -> tuple[bytes, bytes] | None:
    """(trace id, parent span id) of the sampled ``traceparent`` a ``trace`` value starts with, or
    None (none, malformed, or not sampled). :func:`parse_traceparent`'s rules, checked byte by byte:
    a worker asks this of every traced item it runs."""
    if ((value[52:55] != b"-01" or value[:3] != b"00-" or value[35] != 45 or value[55:56] not in _AFTER_VERSION_00)
            and not _sampled_form(value)) or value[:55].translate(None, _LOWER_HEX_AND_DASH):
        return None
    try:
        trace_id, parent_id = unhexlify(value[3:35]), unhexlify(value[36:52])
    except ValueError:
        return None
    return None if trace_id == _NO_TRACE or parent_id == _NO_SPAN else (trace_id, parent_id)


class SpanSink:
    """Sends spans (encoded by their recorders with :mod:`broker.otlp`) on a thread of its own, every
    ``period_s`` or as soon as a batch waits: ``batch`` spans, or ``batch_bytes`` (spans with long
    error texts are large); the recording side only appends. ``send``: the OTLP/HTTP exporter's
    client's ``export(bytes)`` (:func:`start_sink`); ``resource``: the attributes of the process
    every span shares (sent once per request). At most ``queue`` spans, and ``QUEUED_BATCHES``
    batches' bytes, wait: past that, new ones are dropped (counted in ``dropped``), as the SDK's
    batch processor does, so that a collector that cannot keep up never grows a process. Why not
    send sooner: one HTTP request costs the exporter's client most of a millisecond of CPU, which at
    a low sampling rate and a short period was most of tracing's cost (docs/benchmarks.md, "Tracing")."""

    QUEUED_BATCHES = 16

    def __init__(self, send: Any, resource: Mapping[str, Any], period_s: float = 5.0, batch: int = EXPORT_BATCH,
                 queue: int = 65_536, batch_bytes: int = EXPORT_BYTES) -> None:
        self.MAX_BATCH = max(1, batch)
        self.MAX_BYTES = max(1, batch_bytes)
        self.MAX_QUEUE = max(1, queue)
        self.MAX_QUEUE_BYTES = self.QUEUED_BATCHES * self.MAX_BYTES
        self._send = send
        self._resource = dict(resource)
        self._period_s = period_s
        self._spans: deque[bytes] = deque()
        # Bytes recorded, and bytes taken for export: each written by one thread only, so that no
        # update is lost without a lock; what waits is their difference.
        self._recorded_bytes = 0
        self._taken_bytes = 0
        self._wake = threading.Event()
        self._stopped = False
        self.dropped = 0
        self._thread = threading.Thread(target=self._run, name="conveyor-spans", daemon=True)
        self._thread.start()

    def record(self, span: bytes) -> None:
        """One span (:func:`broker.otlp.span`)."""
        self.record_all((span,))

    def record_all(self, spans: Sequence[bytes]) -> None:
        """Several spans at once (a batch's), in one check of the queue's bounds."""
        queue = self._spans
        size = sum(map(len, spans))
        waiting = self._recorded_bytes - self._taken_bytes
        if waiting + size > self.MAX_QUEUE_BYTES:
            self.dropped += len(spans)
            return
        room = self.MAX_QUEUE - len(queue)
        if room < len(spans):
            self.dropped += len(spans) - max(0, room)
            spans = spans[:max(0, room)]
            size = sum(map(len, spans))
        queue.extend(spans)
        self._recorded_bytes += size
        if len(queue) >= self.MAX_BATCH or waiting + size >= self.MAX_BYTES:
            self._wake.set()

    def _run(self) -> None:
        while not self._stopped:
            full = self._wake.wait(self._period_s)
            self._wake.clear()
            self._drain(whole_batches=full and not self._stopped)

    def _drain(self, whole_batches: bool = False) -> None:
        """Export what waits, a batch at a time (``whole_batches``: woken by a full batch, the rest
        waits for the next one or the period, rather than going out as a small export)."""
        from broker import otlp

        queue = self._spans
        while queue and (not whole_batches or len(queue) >= self.MAX_BATCH
                         or self._recorded_bytes - self._taken_bytes >= self.MAX_BYTES):
            batch: list[bytes] = []
            size = 0
            while queue and len(batch) < self.MAX_BATCH and size < self.MAX_BYTES:
                span = queue.popleft()
                batch.append(span)
                size += len(span)
            self._taken_bytes += size
            try:
                result = self._send(otlp.export_request(self._resource, "conveyor", batch))
                if getattr(result, "success", True) is False:
                    log.warning("span export failed error=%s", getattr(result, "error", None))
            except Exception:  # an exporter's trouble must never reach the request path
                log.exception("span export failed")

    def close(self, timeout_s: float = 5.0) -> None:
        """Send what was recorded (bounded), then stop. A thread still sending after ``timeout_s`` (a
        collector that does not answer) is left to it, alone: two drains would take spans from each other."""
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("spans still being sent after %gs: %d left to the exporter's thread", timeout_s,
                        len(self._spans))
            return
        self._drain()


def start_sink(service_name: str, environ: Mapping[str, str], process: Mapping[str, Any] | None = None) -> SpanSink:
    """A sink sending through the SDK's OTLP/HTTP exporter as the ``OTEL_*`` variables configure it
    (endpoint, headers, compression, timeout), its resource from ``OTEL_SERVICE_NAME`` and
    ``OTEL_RESOURCE_ATTRIBUTES`` (else ``service_name``) over ``process``: what every span of this
    process shares (a worker's stage), sent once per export rather than on every span. Raises
    ImportError with the install line when the ``[otel]`` extra is missing."""
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    except ImportError as exc:
        raise ImportError(f"tracing is configured (OTEL_*) but the OpenTelemetry SDK is missing: "
                          f"pip install 'conveyor[otel]' ({exc})") from exc
    protocol = environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
    if protocol and protocol.strip().lower() != "http/protobuf":
        log.warning("OTEL_EXPORTER_OTLP_PROTOCOL=%s: conveyor sends spans over OTLP http/protobuf only (to %s); "
                    "point it at the collector's OTLP/HTTP receiver (port 4318)", protocol,
                    environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"))
    attributes = {} if environ.get("OTEL_SERVICE_NAME") else {SERVICE_NAME: service_name}
    resource = {**(process or {}), **Resource.create(attributes).attributes}
    exporter = OTLPSpanExporter()
    client = getattr(exporter, "_client", None)  # the transport the exporter sends encoded bytes with (1.45)
    if client is None:
        raise ImportError("this opentelemetry-exporter-otlp-proto-http has no transport client: "
                          "pip install 'conveyor[otel]' (the pinned 1.45.2)")
    return SpanSink(client.export, resource, _env_number(environ, "OTEL_BSP_SCHEDULE_DELAY", 5000, 3_600_000) / 1000,
                    int(_env_number(environ, "OTEL_BSP_MAX_EXPORT_BATCH_SIZE", EXPORT_BATCH, 2**31)),
                    int(_env_number(environ, "OTEL_BSP_MAX_QUEUE_SIZE", 65_536, 2**31)))


def _env_number(environ: Mapping[str, str], name: str, default: float, most: float) -> float:
    """A number of the environment from 1 to ``most``, else ``default`` (warned), or ``most`` above it
    (warned): a period of 0 or less would spin the sink's thread, one past ``threading.TIMEOUT_MAX`` (or
    infinite) kill it, and a size must become an int of at least 1."""
    raw = environ.get(name)
    try:
        value = float(raw or default)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 1:
        log.warning("%s=%s is not a number from 1 to %g: %g", name, raw, most, default)
        return default
    if value > most:
        log.warning("%s=%s is more than %g: %g", name, raw, most, most)
        return most
    return value


def now_ns() -> int:
    return time.time_ns()
