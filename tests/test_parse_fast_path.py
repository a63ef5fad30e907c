"""The protocol's hot paths give what the plain ones give: parse_entry's (every check at once) the
same Item or the same rejection as the checks one at a time, on valid and hostile entries alike;
ok_record's joined bytes the msgpack of the record's map."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from broker.codec import decode, encode
from broker.keys import Keys
from broker.protocol import E_UNENCODABLE, Limits, _parse_checked, ok_record, parse_entry

pytestmark = pytest.mark.unit

KEYS = Keys("p")
NOW = 1_700_000_000_000
LIMITS = Limits(max_payload_bytes=8)
VALUES: dict[bytes, list[bytes | None]] = {
    b"id": [None, b"req-1", b"", b"a b", b"x" * 128, b"x" * 129, b"r\n"],
    b"data": [None, b"\x01", b"", b"x" * 8, b"x" * 9],
    b"reply": [None, b"conveyor:{p}:reply:gw1", b"conveyor:reply:gw1", b"", b"conveyor:{p}:reply:",
               b"conveyor:{q}:reply:gw1", b"conveyor:{p}:reply:" + b"x" * 300],
    b"deadline_ms": [None, b"", b"%d" % (NOW + 5), b"0", b"-3", b"soon", b"%d" % (NOW + 10**10)],
    b"v": [None, b"1", b"2", b""],
}


def _as_tuple(x: object) -> tuple[object, ...]:
    return (type(x).__name__, *(getattr(x, f) for f in x.__slots__))  # type: ignore[attr-defined]


def test_fast_path_agrees_with_the_checks_one_at_a_time() -> None:
    names = list(VALUES)
    for combo in itertools.product(*VALUES.values()):
        fields = {name: value for name, value in zip(names, combo, strict=True) if value is not None}
        fast, checked = parse_entry(b"1-0", fields, KEYS, LIMITS, NOW), _parse_checked(b"1-0", fields, KEYS, LIMITS,
                                                                                         NOW)
        assert _as_tuple(fast) == _as_tuple(checked), fields
    assert _as_tuple(parse_entry(b"1-0", None, KEYS, LIMITS, NOW)) == _as_tuple(
        _parse_checked(b"1-0", None, KEYS, LIMITS, NOW))


@pytest.mark.parametrize("request_id", [b"r", b"x" * 31, b"x" * 32, b"x" * 128, b"a.b:c_d-9", "caf\u00e9".encode()])
@pytest.mark.parametrize("value", [9, None, "text", b"\x00" * 70_000, {"k": [1, 2.5]}, np.arange(20_000.0)])
def test_ok_record_is_the_records_msgpack(request_id: bytes, value: object) -> None:
    record = ok_record(request_id, value, "S")
    assert record == encode({"id": request_id.decode(), "ok": True, "value": value})
    assert decode(record)["id"] == request_id.decode()


def test_an_unencodable_value_is_the_stages_error() -> None:
    record = decode(ok_record(b"r1", object(), "S"))
    assert record["ok"] is False and record["error"]["type"] == E_UNENCODABLE and record["error"]["stage"] == "S"
