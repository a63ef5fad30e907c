"""OTLP trace export requests encoded by hand (protobuf wire format), for :class:`broker.tracing.SpanSink`.

Why not the SDK's encoder: it builds a protobuf message per span, attribute and value through
Python, ~75 us per span on the benchmark machine (a worker's whole cost per item is ~15 us), which
at 100 % sampling more than tripled the CPU per request (docs/benchmarks.md, "Tracing"). The messages
conveyor sends are few and fixed (``ExportTraceServiceRequest`` > ``ResourceSpans`` > ``ScopeSpans`` >
``Span`` with ``KeyValue`` attributes, an ``Event``, a ``Status``): written here as bytes, a span costs a
few microseconds, and the attributes a process repeats on every span are encoded once. The bytes go
out through the SDK's OTLP/HTTP exporter's client (its endpoint, headers, compression, timeout and
retries, as the ``OTEL_EXPORTER_OTLP_*`` variables configure them). ``tests/test_traces.py`` decodes
every request with ``opentelemetry-proto``.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["attributes", "export_request", "span"]

KIND_INTERNAL, KIND_SERVER = 1, 2
_IDS = struct.Struct(">BBQQBBQ")  # trace id (field 1, 16 bytes), span id (field 2, 8 bytes)
_PARENT = struct.Struct(">BBQ")
_TIMES = struct.Struct("<BBBQBQ")  # kind (field 6, < 128), start and end (fields 7, 8: fixed64)
_LOW = (1 << 64) - 1
STATUS_ERROR = 2


_SMALL = [bytes((n,)) for n in range(128)]


def _varint(n: int) -> bytes:
    if 0 <= n < 128:
        return _SMALL[n]
    if n < 0:
        n += 1 << 64
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(tag: int, payload: bytes) -> bytes:
    """A length-delimited field (``tag``: field number << 3 | 2)."""
    size = len(payload)
    if size < 128:
        return b"%c%c%b" % (tag, size, payload)
    return _SMALL[tag] + _varint(size) + payload


def _value(value: Any) -> bytes:
    """An ``AnyValue``: string 1, bool 2, int 3, double 4."""
    if type(value) is str:
        return _field(0x0A, value.encode())
    if isinstance(value, bool):
        return b"\x10" + (b"\x01" if value else b"\x00")
    if isinstance(value, int):
        return b"\x18" + _varint(value)
    if isinstance(value, float):
        return b"\x21" + struct.pack("<d", value)
    return _field(0x0A, str(value).encode())


def attributes(values: Mapping[str, Any], tag: int = 0x4A) -> bytes:
    """``KeyValue`` fields (a span's attributes: field 9; a resource's or an event's: pass their tag)."""
    return b"".join(_field(tag, _field(0x0A, key.encode()) + _field(0x12, _value(value)))
                    for key, value in values.items())


def span(trace_id: int, span_id: int, parent_id: int, name: str, kind: int, start_ns: int, end_ns: int,
         constant: bytes, values: Mapping[str, Any], tracestate: str | None = None,
         error: tuple[str, str, str] | None = None) -> bytes:
    """One ``Span`` message (``constant``: attributes encoded once by :func:`attributes`)."""
    parts = [_IDS.pack(0x0A, 16, trace_id >> 64, trace_id & _LOW, 0x12, 8, span_id)]
    if tracestate:
        parts.append(_field(0x1A, tracestate.encode()))
    if parent_id:
        parts.append(_PARENT.pack(0x22, 8, parent_id))
    parts += (_field(0x2A, name.encode()), _TIMES.pack(0x30, kind, 0x39, start_ns, 0x41, end_ns), constant,
              attributes(values))
    if error is not None:
        kind_name, message, trace = error
        event = b"\x09" + struct.pack("<Q", end_ns) + _field(0x12, b"exception") + attributes(
            {"exception.type": kind_name, "exception.message": message, "exception.stacktrace": trace}, 0x1A)
        parts += (_field(0x5A, event), _field(0x7A, _field(0x12, f"{kind_name}: {message}".encode()) + b"\x18\x02"))
    return _field(0x12, b"".join(parts))  # as ScopeSpans.spans (field 2)


def export_request(resource: Mapping[str, Any], scope: str, spans: Iterable[bytes]) -> bytes:
    """An ``ExportTraceServiceRequest`` of one resource and scope; ``spans`` from :func:`span`."""
    scope_spans = _field(0x0A, _field(0x0A, scope.encode())) + b"".join(spans)
    resource_spans = _field(0x0A, attributes(resource, 0x0A)) + _field(0x12, scope_spans)
    return _field(0x0A, resource_spans)
