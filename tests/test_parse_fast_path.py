"""The protocol's hot paths give what the plain ones give: parse_entry's (every check at once) the
same Item or the same rejection as the checks one at a time, on valid and hostile entries alike, and
so does parse_entries over a whole batch of them in any order (its reply key check is shared);
ok_record's joined bytes the msgpack of the record's map."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from broker.codec import decode, encode
from broker.keys import Keys
from broker.protocol import (
    E_UNENCODABLE,
    SECONDS_LIKE_BELOW,
    Limits,
    _parse_checked,
    deadline_passed,
    ok_record,
    parse_entries,
    parse_entry,
)

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


def _entries() -> list[tuple[bytes, dict[bytes, bytes] | None]]:
    names = list(VALUES)
    entries: list[tuple[bytes, dict[bytes, bytes] | None]] = [(b"0-0", None)]
    for n, combo in enumerate(itertools.product(*VALUES.values())):
        entries.append((b"%d-0" % n, {name: value for name, value in zip(names, combo, strict=True)
                                      if value is not None}))
    return entries


@pytest.mark.parametrize("seed", [None, 1, 2])
def test_a_batch_is_parsed_as_its_entries_one_at_a_time(seed: int | None) -> None:
    """In product order a valid reply key is followed by each invalid one; shuffled, by anything."""
    entries = _entries()
    if seed is not None:
        random.Random(seed).shuffle(entries)
    batch = parse_entries(entries, KEYS, LIMITS, NOW)
    assert len(batch) == len(entries)
    for (entry_id, fields), got in zip(entries, batch, strict=True):
        assert _as_tuple(got) == _as_tuple(_parse_checked(entry_id, fields, KEYS, LIMITS, NOW)), fields


def test_a_reply_key_checked_once_is_not_taken_for_another() -> None:
    good, bad = b"conveyor:{p}:reply:gw1", b"conveyor:{q}:reply:gw1"
    entries = [(b"1-0", {b"id": b"a", b"data": b"\x01", b"reply": good}),
               (b"1-0", {b"id": b"b", b"data": b"\x01", b"reply": bad}),
               (b"1-0", {b"id": b"c", b"data": b"\x01"}),
               (b"1-0", {b"id": b"d", b"data": b"\x01", b"reply": good})]
    first, second, third, fourth = parse_entries(entries, KEYS, LIMITS, NOW)
    assert _as_tuple(first)[0] == "Item" and _as_tuple(fourth)[0] == "Item"
    assert _as_tuple(second)[0] == "Rejected" and "reply" in second.reason  # type: ignore[union-attr]
    assert _as_tuple(third)[0] == "Item" and third.reply is None  # type: ignore[union-attr]


@pytest.mark.parametrize("request_id", [b"r", b"x" * 31, b"x" * 32, b"x" * 128, b"a.b:c_d-9", "caf\u00e9".encode()])
@pytest.mark.parametrize("value", [9, None, "text", b"\x00" * 70_000, {"k": [1, 2.5]}, np.arange(20_000.0)])
def test_ok_record_is_the_records_msgpack(request_id: bytes, value: object) -> None:
    record = ok_record(request_id, value, "S")
    assert record == encode({"id": request_id.decode(), "ok": True, "value": value})
    assert decode(record)["id"] == request_id.decode()


def test_an_unencodable_value_is_the_stages_error() -> None:
    record = decode(ok_record(b"r1", object(), "S"))
    assert record["ok"] is False and record["error"]["type"] == E_UNENCODABLE and record["error"]["stage"] == "S"


def test_a_passed_deadline_that_looks_like_seconds_says_so() -> None:
    """``date +%s`` where ms are meant: the DeadlineExceeded message says the value looks like seconds."""
    assert deadline_passed(1_700_000_000) == ("deadline passed before the stage ran (deadline_ms 1700000000 looks "
                                              "like seconds: it is milliseconds since the epoch)")
    assert "looks like seconds" in deadline_passed(SECONDS_LIKE_BELOW - 1, "before submission")
    for ms in (SECONDS_LIKE_BELOW, NOW, 0, -5):
        assert deadline_passed(ms) == "deadline passed before the stage ran"
