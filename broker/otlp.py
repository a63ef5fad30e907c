"""OTLP trace export requests encoded by hand (protobuf wire format), for :class:`broker.tracing.SpanSink`.

Why not the SDK's encoder: it builds a protobuf message per span, attribute and value through
Python, which at 100 % sampling more than tripled a worker's CPU per item (docs/benchmarks.md,
"Tracing"). The messages conveyor sends are few and fixed (``ExportTraceServiceRequest`` >
``ResourceSpans`` > ``ScopeSpans`` > ``Span`` with ``KeyValue`` attributes, an ``Event``, a
``Status``), so a span is its ids and times packed by one ``struct`` call, followed by a **tail**
(name, kind, attributes) the caller encodes once for all the spans that share it (a stage's batch,
a route) and the few attributes of its own. Protobuf fields may come in any order, which is what
lets a tail be reused. The bytes go out through the SDK's OTLP/HTTP exporter's client (its
endpoint, headers, compression, timeout and retries, as the ``OTEL_EXPORTER_OTLP_*`` variables
configure them). ``tests/test_traces.py`` decodes every request with ``opentelemetry-proto``.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["attributes", "error", "event", "export_request", "head", "int_attribute", "key", "span", "string_attribute",
           "string_prefixes", "tracestate"]

KIND_INTERNAL, KIND_SERVER = 1, 2
# trace id (field 1), span id (2), parent span id (4), start and end (fields 7, 8: fixed64)
_CHILD = struct.Struct("<2s16s2s8s2s8sBQBQ")
_ROOT = struct.Struct("<2s16s2s8sBQBQ")
_SIZED_CHILD = struct.Struct("<BBB2s16s2s8s2s8sBQBQ")  # as _CHILD, after its field's tag and two-byte length
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
    if size < 16384:
        return b"%c%c%c%b" % (tag, size & 0x7F | 0x80, size >> 7, payload)
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
    return b"".join(_field(tag, _field(0x0A, name.encode()) + _field(0x12, _value(value)))
                    for name, value in values.items())


def key(name: str) -> bytes:
    """An attribute's key, encoded once, for :func:`string_attribute` and :func:`int_attribute`."""
    return _field(0x0A, name.encode())


def string_attribute(encoded_key: bytes, value: bytes) -> bytes:
    """One span attribute whose value is the UTF-8 ``value`` (``encoded_key``: from :func:`key`)."""
    size = len(value)
    if size < 100 and len(encoded_key) + size < 124:
        return b"\x4a%c%b\x12%c\x0a%c%b" % (len(encoded_key) + size + 4, encoded_key, size + 2, size, value)
    return _field(0x4A, encoded_key + _field(0x12, _field(0x0A, value)))


def string_prefixes(name: str, longest: int = 128) -> list[bytes]:
    """The bytes that precede a value of each length up to ``longest`` in the attribute ``name``:
    ``prefixes[len(value)] + value`` is :func:`string_attribute`, for an attribute every span has."""
    encoded = key(name)
    return [string_attribute(encoded, b"\0" * size)[:-size or None] for size in range(longest + 1)]


def int_attribute(encoded_key: bytes, value: int) -> bytes:
    return _field(0x4A, encoded_key + _field(0x12, b"\x18" + _varint(value)))


def head(name: str, kind: int = KIND_INTERNAL) -> bytes:
    """A span's name and kind: the start of every tail."""
    return _field(0x2A, name.encode()) + b"\x30" + _SMALL[kind]


def span(trace_id: bytes, span_id: bytes, parent_id: bytes, start_ns: int, end_ns: int, tail: bytes) -> bytes:
    """One ``Span`` (as ``ScopeSpans.spans``, field 2): ids of 16, 8 and 8 bytes (``parent_id`` b"":
    none), times in ns since the epoch, ``tail``: :func:`head` and the attributes (and :func:`error`)."""
    size = _CHILD.size + len(tail)
    if parent_id and 128 <= size < 16384:  # a stage's span: one pack, its length's two bytes included
        return _SIZED_CHILD.pack(0x12, size & 0x7F | 0x80, size >> 7, b"\x0a\x10", trace_id, b"\x12\x08", span_id,
                                 b"\x22\x08", parent_id, 0x39, start_ns, 0x41, end_ns) + tail
    if parent_id:
        body = _CHILD.pack(b"\x0a\x10", trace_id, b"\x12\x08", span_id, b"\x22\x08", parent_id, 0x39, start_ns,
                           0x41, end_ns)
    else:
        body = _ROOT.pack(b"\x0a\x10", trace_id, b"\x12\x08", span_id, 0x39, start_ns, 0x41, end_ns)
    size = len(body) + len(tail)
    if 128 <= size < 16384:
        return b"\x12%c%c%b%b" % (size & 0x7F | 0x80, size >> 7, body, tail)
    return _field(0x12, body + tail)


def tracestate(value: str) -> bytes:
    """The W3C ``tracestate`` a span keeps (field 3), for its tail."""
    return _field(0x1A, value.encode())


def event(name: str, at_ns: int, values: Mapping[str, Any] | None = None) -> bytes:
    """An ``Event`` of a span (field 11), for its tail: a moment named, with its attributes."""
    return _field(0x5A, b"\x09" + struct.pack("<Q", at_ns) + _field(0x12, name.encode())
                  + attributes(values or {}, 0x1A))


ERROR_TEXT_MAX = 8192  # characters of an error's message, and of its traceback, that a span keeps


def error(kind_name: str, message: str, trace: str, at_ns: int) -> bytes:
    """An ``exception`` event and status ERROR, for the tail of a span that failed. Its texts are cut at
    :data:`ERROR_TEXT_MAX` characters (an error may quote a whole input: a span stays small)."""
    message, trace = _cut(message), _cut(trace)
    return event("exception", at_ns, {"exception.type": kind_name, "exception.message": message,
                                      "exception.stacktrace": trace}) \
        + _field(0x7A, _field(0x12, f"{kind_name}: {message}".encode()) + b"\x18\x02")


def _cut(text: str) -> str:
    return text if len(text) <= ERROR_TEXT_MAX else text[:ERROR_TEXT_MAX] + " [cut]"


def export_request(resource: Mapping[str, Any], scope: str, spans: Sequence[bytes]) -> bytes:
    """An ``ExportTraceServiceRequest`` of one resource and scope; ``spans`` from :func:`span`,
    joined once (the nested messages' lengths are computed, not their bytes copied)."""
    scope_head = _field(0x0A, _field(0x0A, scope.encode()))
    scope_size = len(scope_head) + sum(map(len, spans))
    resource_head = _field(0x0A, attributes(resource, 0x0A)) + _SMALL[0x12] + _varint(scope_size)
    resource_size = len(resource_head) + scope_size
    return b"".join((_SMALL[0x0A], _varint(resource_size), resource_head, scope_head, *spans))
