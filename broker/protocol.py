"""The wire format of stream entries and result records (pure; see docs/protocol.md).

A stage stream entry carries these fields (bytes values):

- ``id``           request id, 1-128 chars of ``[A-Za-z0-9_.:-]``; unique per request.
- ``data``         the input, encoded with :mod:`broker.codec` (msgpack).
- ``reply``        optional: a list key under ``<prefix>:{<pipeline>}:reply:`` (or, for a gateway serving
                   several pipelines on one Redis, ``<prefix>:reply:``) to RPUSH the record to.
- ``deadline_ms``  optional: absolute Unix time in ms after which nobody wants the answer.
- ``v``            optional: protocol version, ``1``.
- ``trace``        optional: the request's trace context (:mod:`broker.tracing`): a W3C ``traceparent``
                   (or ``-`` for none), then, if the producer asked for timings, ``t`` and one
                   ``<queue ms>,<predict ms>`` token per stage passed. Absent on most entries: only
                   sampled (or timed) requests carry it, and each stage forwards it as it came, plus its
                   own timing token where asked.

A **batch entry** carries several requests in one entry instead: the fields ``items`` and ``v``.
``items`` is a msgpack array of 4k strings (raw bytes), four per request: id, data, reply (empty: none)
and deadline_ms as decimal digits (empty: none). Workers forward a batch to the next stage this way
(one ``XADD``, one entry to read and ack, instead of k): each stage reads both kinds, and
:func:`expand` turns a batch entry into one entry per request, all with the batch entry's id.
Gateways submit a turn to the first stage this way too where no ``max_backlog`` is in force
(``submit.lua``: admission counts entries); other producers may, or write single entries.

A result record is a msgpack map ``{"id": str, "ok": true, "value": any}`` or
``{"id": str, "ok": false, "error": {"type", "message", "stage", "traceback"}}``. The
result key holds one record; a reply list element is a msgpack *array* of records
(one push per batch and reply key). A record whose request carried timings (``trace`` with ``t``)
also holds ``"timing": "<q>,<c> <q>,<c>"`` (one pair per stage, in ms).

A batch entry's requests carry their ``trace`` values in an optional third field, ``traces``: a msgpack
array of strings aligned with the requests (``""``: none), present only when one of them has one.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import msgpack

from broker.codec import CodecError, array_header, encode
from broker.keys import PROTOCOL_VERSION, Keys

_ID_RE = re.compile(rb"[A-Za-z0-9_.:\-]{1,128}")  # fullmatch: `$` would let a trailing newline through
MAX_DEADLINE_AHEAD_MS = 7 * 24 * 3600 * 1000  # a deadline further out than a week is a bug
MAX_REPLY_BYTES = 256  # a reply key's length at most (docs/protocol.md): a longer one is refused

F_ID, F_DATA, F_REPLY, F_DEADLINE, F_VERSION = b"id", b"data", b"reply", b"deadline_ms", b"v"
F_ITEMS = b"items"  # a batch entry's requests, 4 values each (see above)
F_TRACE = b"trace"  # optional: a request's trace context and timings (see above)
F_TRACES = b"traces"  # optional: a batch entry's requests' trace values, aligned with its items
# A trace value read from an entry: a traceparent, "t", then a timing token per stage (~16 bytes each).
MAX_TRACE_BYTES = 4096
_VERSION = str(PROTOCOL_VERSION).encode()

# Error types conveyor itself reports (besides the user's own exception names).
E_DEADLINE = "DeadlineExceeded"
E_UNENCODABLE = "UnencodableResult"
E_DEAD_LETTER = "DeadLettered"
E_TOO_LARGE = "ResultTooLarge"  # a stage's result over max_payload_bytes once encoded


@dataclass(slots=True)
class Item:
    """One stream entry that passed validation."""

    entry_id: bytes
    request_id: bytes
    data: bytes
    reply: bytes | None
    deadline_ms: int | None
    trace: bytes | None = None  # the entry's ``trace`` field: most entries have none

    def expired(self, now_ms: int) -> bool:
        return self.deadline_ms is not None and now_ms >= self.deadline_ms


@dataclass(slots=True)
class Rejected:
    """A stream entry that cannot be processed: dead-lettered with ``reason``.

    ``request_id``/``reply`` are kept when they were readable so the requester still hears of it.
    """

    entry_id: bytes
    reason: str
    request_id: bytes | None
    reply: bytes | None
    data: bytes


@dataclass(frozen=True)
class Limits:
    max_payload_bytes: int = 16 * 1024 * 1024
    # A reply to a gateway's list shared by its pipelines (one Redis). Not on a Redis Cluster: that key lies in
    # another hash slot than the pipeline's, which the commit's script cannot write with them.
    shared_replies: bool = True


def now_ms() -> int:
    return int(time.time() * 1000)


# Below this a deadline_ms is most likely seconds since the epoch: 1e11 ms is March 1973, while as seconds
# it is the year 5138. `date +%s` (or time.time()) where ms are meant made every request DeadlineExceeded.
SECONDS_LIKE_BELOW = 100_000_000_000


def deadline_passed(deadline_ms: int, when: str = "before the stage ran") -> str:
    """The message of a request whose deadline passed ``when``: with a hint when the value looks like
    seconds, the likeliest reason a fresh request is already past its deadline (shared by the workers
    and the gateway's HTTP header parse)."""
    message = f"deadline passed {when}"
    if 0 < deadline_ms < SECONDS_LIKE_BELOW:
        message += f" (deadline_ms {deadline_ms} looks like seconds: it is milliseconds since the epoch)"
    return message


def is_request_id(raw: bytes) -> bool:
    """Whether ``raw`` is a request id workers accept (1-128 chars of ``[A-Za-z0-9_.:-]``)."""
    return _ID_RE.fullmatch(raw) is not None


def parse_entry(entry_id: bytes, fields: dict[bytes, bytes] | None, keys: Keys, limits: Limits,
                at_ms: int) -> Item | Rejected:
    """Validate one entry as read from Redis; never raises on hostile input (:func:`parse_entries`)."""
    return parse_entries(((entry_id, fields),), keys, limits, at_ms)[0]


def parse_entries(entries: Iterable[tuple[bytes, dict[bytes, bytes] | None]], keys: Keys, limits: Limits,
                  at_ms: int) -> list[Item | Rejected]:
    """Validate a batch of entries as read from Redis, in order; never raises on hostile input.

    Every entry of every batch comes through here, so the common case (every check passes) is
    tested first, in one expression, without building the reasons a rejection needs; anything
    else takes :func:`_parse_checked`, which finds the reason (or accepts the entry as well).
    Why a batch at once: what each entry shares is looked up once, and a reply key is checked
    once per run of equal ones (a batch entry's requests all name their gateway's), which halves
    the cost per entry; the checks themselves are those of :func:`_parse_checked`."""
    fullmatch, max_bytes = _ID_RE.fullmatch, limits.max_payload_bytes
    latest_ms = at_ms + MAX_DEADLINE_AHEAD_MS
    good_reply = None  # the last reply key found valid
    parsed: list[Item | Rejected] = []
    append = parsed.append
    for entry_id, fields in entries:
        if fields is not None and F_ITEMS not in fields and fields.get(F_VERSION, _VERSION) == _VERSION:
            raw_id, data, reply = fields.get(F_ID), fields.get(F_DATA), fields.get(F_REPLY)
            if (isinstance(raw_id, bytes) and data is not None and len(data) <= max_bytes and fullmatch(raw_id)
                    and (reply is None or reply == good_reply
                         or _valid_reply(reply, keys, limits.shared_replies) is not None)):
                good_reply = good_reply if reply is None else reply
                raw_deadline, trace = fields.get(F_DEADLINE), fields.get(F_TRACE)
                if trace is not None and (len(trace) > MAX_TRACE_BYTES or not trace.isascii()):
                    trace = None  # _trace_of's rule
                if not raw_deadline:
                    append(Item(entry_id, raw_id, data, reply, None, trace))
                    continue
                deadline = _deadline_or_zero(raw_deadline)
                if 0 < deadline <= latest_ms:  # _parse_deadline's bounds
                    append(Item(entry_id, raw_id, data, reply, deadline, trace))
                    continue
        append(_parse_checked(entry_id, fields, keys, limits, at_ms))
    return parsed


def _deadline_or_zero(raw: bytes) -> int:
    """``deadline_ms`` as :func:`_parse_deadline` reads it; 0 (out of bounds) where it is no integer."""
    try:
        return int(raw)
    except ValueError:
        return 0


def _parse_checked(entry_id: bytes, fields: dict[bytes, bytes] | None, keys: Keys, limits: Limits,
                   at_ms: int) -> Item | Rejected:
    """:func:`parse_entry` one check at a time, naming the first that fails."""
    if fields is None:
        return Rejected(entry_id, "entry was deleted while pending", None, None, b"")
    raw_id = fields.get(F_ID)
    request_id = raw_id if isinstance(raw_id, bytes) and _ID_RE.fullmatch(raw_id) else None
    reply = _valid_reply(fields.get(F_REPLY), keys, limits.shared_replies)
    if F_ITEMS in fields:  # left whole by the reader: not a batch entry this worker can read
        return Rejected(entry_id, _unread_batch(fields), request_id, reply, fields[F_ITEMS][:1024])
    data = fields.get(F_DATA, b"")

    def reject(reason: str) -> Rejected:
        return Rejected(entry_id, reason, request_id, reply, data[:1024])

    if request_id is None:
        return reject("missing or invalid 'id' (1-128 chars of A-Z a-z 0-9 _ . : -)")
    if F_REPLY in fields and reply is None:
        return reject(f"invalid 'reply': must be a key starting with {keys.base}:reply: or {keys.prefix}:reply:, "
                      f"of at most {MAX_REPLY_BYTES} bytes" if limits.shared_replies else
                      f"invalid 'reply': must be a key starting with {keys.base}:reply: (on a Redis Cluster, in the "
                      f"pipeline's hash slot), of at most {MAX_REPLY_BYTES} bytes")
    version = fields.get(F_VERSION, _VERSION)
    if version != _VERSION:
        return reject(f"unknown protocol version {version[:16]!r}; this worker speaks v{PROTOCOL_VERSION}")
    if F_DATA not in fields:
        return reject("missing 'data'")
    if len(data) > limits.max_payload_bytes:
        return reject(f"payload of {len(data)} bytes exceeds max_payload_bytes={limits.max_payload_bytes}")
    deadline = _parse_deadline(fields.get(F_DEADLINE), at_ms)
    if isinstance(deadline, str):
        return reject(deadline)
    return Item(entry_id, request_id, data, reply, deadline, _trace_of(fields.get(F_TRACE)))


def _trace_of(value: bytes | None) -> bytes | None:
    """An entry's ``trace`` value where it can be read (ASCII, at most ``MAX_TRACE_BYTES``), else None:
    a value that cannot be read is ignored and its request served untraced (docs/protocol.md); never
    worth refusing a request for, and never carried into a result record it could not be written in."""
    return value if value and len(value) <= MAX_TRACE_BYTES and value.isascii() else None


def _unread_batch(fields: dict[bytes, bytes]) -> str:
    """Why an entry with ``items`` was not read as a batch entry."""
    version = fields.get(F_VERSION, _VERSION)
    if F_ID in fields:
        return "an entry carries either 'id' and 'data' (one request) or 'items' (a batch entry), not both"
    if version != _VERSION:
        return f"unknown protocol version {version[:16]!r}; this worker speaks v{PROTOCOL_VERSION}"
    return "malformed batch entry: 'items' must be a msgpack array of 4k strings (id, data, reply, deadline_ms)"


def _valid_reply(raw: bytes | None, keys: Keys, shared: bool = True) -> bytes | None:
    if raw is None or len(raw) > MAX_REPLY_BYTES:
        return None
    for prefix in (keys.reply_prefix, keys.shared_reply_prefix) if shared else (keys.reply_prefix,):
        if raw.startswith(prefix) and len(raw) > len(prefix):
            return raw
    return None


def _parse_deadline(raw: bytes | None, at_ms: int) -> int | str | None:
    if raw is None or raw == b"":
        return None
    try:
        deadline = int(raw)
    except ValueError:
        return f"'deadline_ms' is not an integer: {raw[:32]!r}"
    if deadline <= 0 or deadline > at_ms + MAX_DEADLINE_AHEAD_MS:
        return f"absurd 'deadline_ms' {deadline}: must be Unix ms within a week from now"
    return deadline


def batch_entry_items(flat: list[bytes]) -> bytes:
    """A batch entry's ``items`` field from its requests' values, four each (id, data, reply or b"",
    deadline_ms digits or b"")."""
    return msgpack.packb(flat, use_bin_type=False)  # str types, not bin: Redis's cmsgpack reads no bin (audit.lua)


def expand(entry_id: bytes, fields: dict[bytes, bytes]) -> list[tuple[bytes, dict[bytes, bytes] | None]]:
    """A batch entry as one entry per request (the batch entry's id each), as a single entry would
    carry it; one that cannot be read, or that carries an ``id`` too, is returned whole, for
    :func:`parse_entry` to reject with its reason."""
    if F_ID in fields:
        return [(entry_id, fields)]
    try:
        flat = msgpack.unpackb(fields[F_ITEMS], raw=True, use_list=True)
    except (ValueError, TypeError, msgpack.UnpackException):
        return [(entry_id, fields)]
    if (fields.get(F_VERSION, _VERSION) != _VERSION or not isinstance(flat, list) or not flat or len(flat) % 4
            or not all(isinstance(value, bytes) for value in flat)):
        return [(entry_id, fields)]
    entries: list[tuple[bytes, dict[bytes, bytes] | None]] = []
    for i in range(0, len(flat), 4):
        one = {F_ID: flat[i], F_DATA: flat[i + 1]}
        if flat[i + 2]:
            one[F_REPLY] = flat[i + 2]
        if flat[i + 3]:
            one[F_DEADLINE] = flat[i + 3]
        entries.append((entry_id, one))
    traces = fields.get(F_TRACES)
    if traces is not None:  # rare: only batch entries holding a traced request carry it
        _add_traces(entries, traces)
    return entries


def _add_traces(entries: list[tuple[bytes, dict[bytes, bytes] | None]], raw: bytes) -> None:
    """A batch entry's ``traces`` onto its expanded requests; ignored where it cannot be read (a
    trace is never worth refusing a request for)."""
    try:
        traces = msgpack.unpackb(raw, raw=True, use_list=True)
    except (ValueError, TypeError, msgpack.UnpackException):
        return
    if not isinstance(traces, list):
        return
    for (_, one), value in zip(entries, traces, strict=False):
        if isinstance(value, bytes) and one is not None and _trace_of(value) is not None:
            one[F_TRACE] = value


def traces_field(values: list[bytes]) -> bytes:
    """A batch entry's ``traces`` field: its requests' trace values in order (b"": none)."""
    return msgpack.packb(values, use_bin_type=False)  # str family, as ``items`` (cmsgpack writes the same)


def item_values(fields: dict[bytes, bytes]) -> tuple[bytes, bytes, bytes, bytes]:
    """One request's four values as a batch entry (and ``commit.lua``'s forwards) hold them."""
    get = fields.get
    return get(F_ID, b""), get(F_DATA, b""), get(F_REPLY, b""), get(F_DEADLINE, b"")


def entry_fields(request_id: bytes, data: bytes, reply: bytes | None, deadline_ms: int | None) -> dict[bytes, bytes]:
    """The fields of a stream entry, as producers (the gateway, a forwarding worker) write them."""
    fields = {F_ID: request_id, F_DATA: data, F_VERSION: _VERSION}
    if reply is not None:
        fields[F_REPLY] = reply
    if deadline_ms is not None:
        fields[F_DEADLINE] = str(deadline_ms).encode()
    return fields


# A success record's bytes around its id and value: msgpack of {"id": <str>, "ok": True, "value": ...}
# is these, the id's str header and bytes, and the value's own encoding (maps keep their order).
_OK_HEAD, _OK_MIDDLE = b"\x83\xa2id", b"\xa2ok\xc3\xa5value"


def ok_record(request_id: bytes, value: Any, stage: str = "", timing: bytes | None = None) -> bytes:
    """Encode a success record; a value the codec refuses becomes an error record instead,
    naming ``stage``, the stage that returned it. Joined from its parts (once per result, on the
    last stage's hot path): the same bytes as encoding the map, without building it. ``timing``:
    the request asked for its stages' timings (module docstring): the record carries them."""
    try:
        if timing is not None:
            return encode({"id": request_id.decode(), "ok": True, "value": value,
                           "timing": timing.decode("ascii", "replace")})
        if len(request_id) < 256 and request_id.isascii():  # a valid id always: str header = its length
            head = bytes((0xA0 | len(request_id),)) if len(request_id) < 32 else b"\xd9" + bytes((len(request_id),))
            return b"".join((_OK_HEAD, head, request_id, _OK_MIDDLE, encode(value)))
        return encode({"id": request_id.decode(), "ok": True, "value": value})
    except CodecError as exc:
        return error_record(request_id, E_UNENCODABLE, f"result of stage {stage!r} cannot be encoded: {exc}", stage,
                            "")


MAX_ERROR_TEXT = 65_536  # characters of an error's message, and of its traceback, that its record carries


def _error_text(text: str) -> str:
    """``text`` as an error record carries it: cut to :data:`MAX_ERROR_TEXT`, and lone surrogates (a
    file name decoded with ``surrogateescape``) escaped, which UTF-8 cannot encode."""
    if len(text) > MAX_ERROR_TEXT:
        text = f"{text[:MAX_ERROR_TEXT]}... ({len(text) - MAX_ERROR_TEXT} more characters cut)"
    return text if text.isascii() else text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_record(request_id: bytes, type_: str, message: str, stage: str, traceback: str,
                 timing: bytes | None = None, run: int | None = None) -> bytes:
    """``run``: the delivery that failed, said by a streaming stage's records (a stream's reader drops an earlier
    run's); the others say none."""
    error = {"type": _error_text(type_), "message": _error_text(message), "stage": stage,
             "traceback": _error_text(traceback)}
    record: dict[str, Any] = {"id": request_id.decode(), "ok": False, "error": error}
    if timing is not None:
        record["timing"] = timing.decode("ascii", "replace")
    if run is not None:
        record["run"] = run
    return encode(record)


def array_of(records: list[bytes]) -> bytes:
    """A reply list element: a msgpack array built from already-encoded records."""
    return array_header(len(records)) + b"".join(records)


def as_bytes(value: bytes | str) -> bytes:
    """redis-py types replies as ``bytes | str``; ours are always bytes (no decode_responses)."""
    return value if isinstance(value, bytes) else value.encode()
