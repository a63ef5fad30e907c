"""Hostile input from foreign producers: whatever an entry holds, the workers neither crash nor
loop; a bad entry is dead-lettered with a precise reason and answered with an error when it
names a readable request id; good requests around it are unaffected.

One private Redis and one set of real workers (``tests.chaos_stages:hostile``: AddTen x 2, then
Halve; f(x) = (x + 10) / 2; ``CONVEYOR_MAX_PAYLOAD_BYTES=4096``) serve the whole module; every
test ends by checking that the worker processes are the very same and still answer.
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broker import codec, protocol
from broker.keys import GROUP, Keys
from broker.protocol import now_ms
from gateway import Gateway, GatewaySettings
from tests.helpers import Workers, running_workers, wait_for
from workers.embedded.server import EmbeddedRedis

pytestmark = pytest.mark.system  # worker processes (tests/conftest.py: tiers)

APP = "tests.chaos_stages:hostile"
PIPELINE = "c-hostile"
KEYS = Keys(PIPELINE)
MAX_PAYLOAD = 4096
T = 30.0
WEEK_MS = 7 * 24 * 3600 * 1000
ID_RE = re.compile(rb"[A-Za-z0-9_.:\-]{1,128}")


@dataclass
class Env:
    url: str
    client: redis.Redis
    workers: Workers
    pids: set[int]
    dead_seen: dict[int, bytes] = field(default_factory=lambda: {0: b"0-0", 1: b"0-0"})
    dead: dict[tuple[int, bytes], dict[bytes, bytes]] = field(default_factory=dict)  # (stage, entry id) -> letter

    def child_pids(self) -> set[int]:
        return {c.pid for p in self.workers.procs for c in p.children()}

    def dead_letter(self, stage: int, entry_id: bytes) -> dict[bytes, bytes] | None:
        """The dead letter of ``entry_id`` at ``stage``, reading the dead-letter stream incrementally."""
        if (stage, entry_id) not in self.dead:
            for eid, fields in self.client.xrange(KEYS.dead(stage), min=b"(" + self.dead_seen[stage]):
                self.dead_seen[stage] = eid
                self.dead[stage, fields[b"entry"]] = fields
        return self.dead.get((stage, entry_id))


@pytest.fixture(scope="module")
def env() -> Iterator[Env]:
    server = EmbeddedRedis()
    server.start()
    try:
        limit = {"CONVEYOR_MAX_PAYLOAD_BYTES": str(MAX_PAYLOAD)}
        with running_workers(server.url, APP, ["AddTen", "Halve"], **limit) as workers:
            workers.wait_ready(PIPELINE, T, workers={"AddTen": 2, "Halve": 1})
            client = redis.Redis.from_url(server.url)
            try:
                yield Env(server.url, client, workers, {c.pid for p in workers.procs for c in p.children()})
            finally:
                client.close()
    finally:
        server.stop()


def assert_unharmed(env: Env) -> None:
    """Same worker processes as at the start, and a normal request still gets its answer."""
    env.workers.check_alive()
    assert env.child_pids() == env.pids, "a worker process died\n" + env.workers.report()

    async def normal() -> list[Any]:
        async with Gateway(env.url, PIPELINE, GatewaySettings(timeout_s=T)) as gw:
            return await asyncio.gather(*(gw.predict(x) for x in range(20)))

    assert asyncio.run(asyncio.wait_for(normal(), T)) == [(x + 10) / 2 for x in range(20)]


def xadd_raw(client: redis.Redis, stage: int, pairs: list[tuple[bytes, bytes]]) -> bytes:
    """XADD exactly these field/value pairs (duplicates and all), as any Redis client could."""
    flat = [part for pair in pairs for part in pair]
    return bytes(client.execute_command("XADD", KEYS.stream(stage), "*", *flat))


def result_of(client: redis.Redis, request_id: bytes) -> dict[str, Any] | None:
    raw = client.get(KEYS.result(request_id.decode()))
    return None if raw is None else msgpack.unpackb(raw, raw=False)


def fresh_id() -> bytes:
    return f"h-{uuid.uuid4().hex}".encode()


def reply_key(request_id: bytes) -> bytes:
    return KEYS.reply(request_id.decode()).encode()


# -- one hostile entry at a time, with the exact reason ----------------------------------------

ARRAY_BAD = msgpack.packb(msgpack.ExtType(1, msgpack.packb(["<f8", [3], "C", b"\0" * 7])))
ARRAY_OBJECT = msgpack.packb(msgpack.ExtType(1, msgpack.packb(["|O", [1], "C", b"\0" * 8])))

CASES: list[tuple[str, dict[bytes, bytes], str]] = [
    # name, fields other than id and reply (None drops the field), reason the dead letter must give
    ("missing data", {}, "missing 'data'"),
    ("undecodable msgpack", {b"data": b"\xc1"}, "undecodable payload: "),
    ("truncated msgpack", {b"data": msgpack.packb([1, 2, 3])[:-1]}, "undecodable payload: "),
    ("unknown ext type", {b"data": msgpack.packb(msgpack.ExtType(9, b"x"))},
     "undecodable payload: unknown msgpack extension type 9"),
    ("array of the wrong size", {b"data": ARRAY_BAD}, "undecodable payload: array payload has 7 bytes"),
    ("object array", {b"data": ARRAY_OBJECT}, "undecodable payload: bad or non-numeric dtype in payload: '|O'"),
    ("oversized", {b"data": msgpack.packb(b"x" * MAX_PAYLOAD)},
     f"payload of {MAX_PAYLOAD + 3} bytes exceeds max_payload_bytes={MAX_PAYLOAD}"),
    ("deadline not a number", {b"deadline_ms": b"soon"}, "'deadline_ms' is not an integer: b'soon'"),
    ("deadline a float", {b"deadline_ms": b"1.7e12"}, "'deadline_ms' is not an integer"),
    ("deadline negative", {b"deadline_ms": b"-5"}, "absurd 'deadline_ms' -5"),
    ("deadline zero", {b"deadline_ms": b"0"}, "absurd 'deadline_ms' 0"),
    ("deadline in ten years", {b"deadline_ms": b"%d" % (now_ms() + 10 * 365 * 86_400_000)}, "absurd 'deadline_ms'"),
    ("deadline beyond int64", {b"deadline_ms": b"9" * 40}, "absurd 'deadline_ms'"),
    ("protocol version 2", {b"v": b"2"}, "unknown protocol version b'2'; this worker speaks v1"),
    ("protocol version empty", {b"v": b""}, "unknown protocol version b''"),
    ("a request with a batch entry's items", {b"items": protocol.batch_entry_items([b"h-x", b"\x01", b"", b""])},
     "an entry carries either 'id' and 'data' (one request) or 'items' (a batch entry), not both"),
]


@pytest.mark.parametrize(("name", "extra", "reason"), CASES, ids=[c[0] for c in CASES])
def test_bad_entry_is_dead_lettered_and_answered(env: Env, name: str, extra: dict[bytes, bytes], reason: str) -> None:
    request_id = fresh_id()
    reply = reply_key(request_id)
    fields = {b"id": request_id, b"reply": reply, b"data": codec.encode(1), b"v": b"1"}
    fields.update(extra)
    if name == "missing data":
        del fields[b"data"]
    entry_id = xadd_raw(env.client, 0, list(fields.items()))
    popped = env.client.blpop([reply], timeout=T)
    assert popped is not None, env.workers.report()
    [record] = msgpack.unpackb(popped[1], raw=False)
    assert record["id"] == request_id.decode() and record["ok"] is False
    error = record["error"]
    assert error["type"] == "DeadLettered" and error["stage"] == "AddTen"
    assert error["message"].startswith(reason), error["message"]
    assert result_of(env.client, request_id) == record  # the durable copy says the same
    letter = wait_for(lambda: env.dead_letter(0, entry_id), T, "the dead letter")
    assert letter[b"id"] == request_id and letter[b"reason"].decode() == error["message"]
    assert len(letter[b"data"]) <= 1024
    assert env.client.llen(reply) == 0  # exactly one answer


BAD_IDS = {
    "no id": None,
    "empty id": b"",
    "id with a space": b"a b",
    "id of 129 chars": b"x" * 129,
    "id not utf-8": b"\xff\xfe",
    "id ending in a newline": b"abc\n",
}


@pytest.mark.parametrize("request_id", BAD_IDS.values(), ids=BAD_IDS.keys())
def test_entry_without_a_usable_id_is_dead_lettered(env: Env, request_id: bytes | None) -> None:
    """Nobody can be answered: the entry is dead-lettered (and acked), the reason says why."""
    pairs = [(b"data", codec.encode(1))] + ([] if request_id is None else [(b"id", request_id)])
    entry_id = xadd_raw(env.client, 0, pairs)
    letter = wait_for(lambda: env.dead_letter(0, entry_id), T, "the dead letter", env.workers.report)
    assert letter[b"id"] == b"" and letter[b"stage"] == b"AddTen"
    assert letter[b"reason"] == b"missing or invalid 'id' (1-128 chars of A-Z a-z 0-9 _ . : -)"


@pytest.mark.parametrize("reply", [
    b"elsewhere:list",  # outside the pipeline's keys: workers must not write there
    b"conveyor:{other}:reply:x",  # another pipeline's reply list
    KEYS.reply("").encode(),  # the bare prefix
    KEYS.reply("x" * 300).encode(),  # too long
], ids=["foreign key", "other pipeline", "bare prefix", "too long"])
def test_bad_reply_key_is_refused_and_answered_through_the_result_key(env: Env, reply: bytes) -> None:
    request_id = fresh_id()
    entry_id = xadd_raw(env.client, 0, [(b"id", request_id), (b"data", codec.encode(1)), (b"reply", reply)])
    record = wait_for(lambda: result_of(env.client, request_id), T, "the error record", env.workers.report)
    assert record["ok"] is False and record["error"]["type"] == "DeadLettered"
    assert record["error"]["message"].startswith("invalid 'reply': must be a key starting with conveyor:{c-hostile}")
    assert env.client.exists(reply) == 0, "a worker wrote to a key the producer named"
    assert wait_for(lambda: env.dead_letter(0, entry_id), T, "the dead letter")[b"id"] == request_id


def test_wrong_type_inputs_and_a_reply_key_of_the_wrong_type(env: Env) -> None:
    """Inputs the stage's code cannot handle are its errors (not dead letters); a reply key that
    holds a string is skipped (the result key still answers) and does not fail the batch."""
    answers = {}
    for data in ("text", [1, 2], {"a": 1}, None, b"\x00"):
        request_id = fresh_id()
        xadd_raw(env.client, 0, [(b"id", request_id), (b"data", codec.encode(data)), (b"reply", reply_key(request_id))])
        answers[request_id] = data
    squatted = fresh_id()
    env.client.set(reply_key(squatted), b"not a list")
    xadd_raw(env.client, 0, [(b"id", squatted), (b"data", codec.encode(4)), (b"reply", reply_key(squatted))])
    for request_id in answers:
        popped = env.client.blpop([reply_key(request_id)], timeout=T)
        assert popped is not None, env.workers.report()
        [record] = msgpack.unpackb(popped[1], raw=False)
        assert record["ok"] is False and record["error"]["type"] == "TypeError" and record["error"]["stage"] == "AddTen"
        assert "Traceback" in record["error"]["traceback"]
    assert wait_for(lambda: result_of(env.client, squatted), T, "the squatted request's answer")["value"] == 7.0
    assert env.client.get(reply_key(squatted)) == b"not a list"


def test_a_request_id_sent_twice_gets_one_answer(env: Env) -> None:
    """A foreign producer retries with the same id (and different data): both run, the first answer
    to be written wins, and only it is pushed to the reply list."""
    request_id = fresh_id()
    reply = reply_key(request_id)
    for x in (2, 4):
        xadd_raw(env.client, 0, [(b"id", request_id), (b"data", codec.encode(x)), (b"reply", reply)])
    wait_for(lambda: all(env.client.xlen(KEYS.stream(i)) == 0 for i in (0, 1)), T, "both copies to be processed")
    wait_for(lambda: all(env.client.xpending(KEYS.stream(i), GROUP)["pending"] == 0 for i in (0, 1)), T, "acks")
    elements = env.client.lrange(reply, 0, -1)
    assert len(elements) == 1
    [record] = msgpack.unpackb(elements[0], raw=False)
    assert record["value"] in (6.0, 7.0) and result_of(env.client, request_id) == record


def test_hostile_cases_left_the_workers_unharmed(env: Env) -> None:
    assert_unharmed(env)


# -- property: random entries -------------------------------------------------------------------

HOSTILE_BYTES = st.binary(max_size=40)
VALUES = st.one_of(st.integers(-1000, 1000), st.floats(allow_nan=False, allow_infinity=False, width=32),
                   st.text(max_size=10), st.lists(st.integers(0, 9), max_size=3), st.none(), st.booleans())


@st.composite
def hostile_entries(draw: st.DrawFn) -> dict[str, Any]:
    """An entry as a list of (field, value) pairs, plus the stage stream it is written to."""
    pairs: list[tuple[bytes, bytes]] = []
    request_id = fresh_id()
    kind = draw(st.sampled_from(["valid", "valid", "valid", "absent", "hostile"]))
    if kind == "hostile":
        hostile = draw(st.one_of(HOSTILE_BYTES, st.text(max_size=140).map(str.encode),
                                 st.sampled_from([b"\n", b" ", b"\x00", "é".encode()]).map(lambda t: fresh_id() + t)))
        request_id = hostile if not ID_RE.fullmatch(hostile) else fresh_id()
    if kind != "absent":
        pairs.append((b"id", request_id))
    data = draw(st.one_of(
        VALUES.map(codec.encode), VALUES.map(codec.encode), st.none(), HOSTILE_BYTES,
        st.just(b"\x00" * (MAX_PAYLOAD + 1)),
        st.just(codec.encode(np.arange(3, dtype=np.int16))),
    ))
    if data is not None:
        pairs.append((b"data", data))
    reply = draw(st.one_of(st.none(), st.just(reply_key(fresh_id())), HOSTILE_BYTES,
                           HOSTILE_BYTES.map(lambda b: KEYS.reply("").encode() + b)))
    if reply is not None:
        pairs.append((b"reply", reply))
    deadline = draw(st.one_of(
        # relative to now: expired, or far enough ahead not to expire on the way to the worker
        st.none(), st.just(b""), st.one_of(st.integers(-10**6, 0), st.integers(5000, 10**7)).map(lambda d: ("now", d)),
        st.integers(-(2**70), 2**70).map(lambda n: str(n).encode()), HOSTILE_BYTES,
    ))
    if deadline is not None:
        pairs.append((b"deadline_ms", deadline))  # type: ignore[arg-type]
    version = draw(st.one_of(st.none(), st.just(b"1"), HOSTILE_BYTES))
    if version is not None:
        pairs.append((b"v", version))
    pairs += draw(st.lists(st.tuples(st.binary(min_size=1, max_size=10), HOSTILE_BYTES), max_size=2))
    pairs = draw(st.permutations(pairs))
    if pairs and draw(st.integers(0, 9)) == 0:  # a field named twice, with another value: the last one counts
        name = draw(st.sampled_from([k for k, _ in pairs]))
        value = draw(HOSTILE_BYTES)
        pairs.append((name, fresh_id() if name == b"id" and ID_RE.fullmatch(value) else value))
    if not pairs:
        pairs = [(b"x", b"")]  # XADD needs a field
    return {"pairs": pairs, "stage": draw(st.sampled_from([0, 0, 0, 1]))}


EXPIRED = "expired"


def deadline_verdict(raw: bytes, at_ms: int) -> str | None:
    """A rejection reason, EXPIRED (valid, but DeadlineExceeded), or None."""
    if not raw:
        return None
    try:
        deadline = int(raw)
    except ValueError:
        return "'deadline_ms' is not an integer"
    if deadline <= 0 or deadline > at_ms + WEEK_MS:
        return "absurd 'deadline_ms'"
    return EXPIRED if deadline <= at_ms else None


BATCH = "batch entry"  # read as several requests: not checked one by one here (assert_unharmed still is)


def batch_verdict(fields: dict[bytes, bytes]) -> str:
    """An entry with ``items``: a batch entry (docs/protocol.md), or one the reader keeps whole and rejects."""
    if b"id" in fields:
        return "an entry carries either 'id' and 'data'"
    if protocol.expand(b"0-0", fields)[0][1] is not fields:
        return BATCH
    return "unknown protocol version" if fields.get(b"v", b"1") != b"1" else "malformed batch entry"


def expected_rejection(fields: dict[bytes, bytes], at_ms: int) -> str | None:
    """What the protocol says about an entry, in its order of checks; None when it is valid."""
    if b"items" in fields:
        return batch_verdict(fields)
    if not ID_RE.fullmatch(fields.get(b"id", b"")):
        return "missing or invalid 'id'"
    prefix = KEYS.reply("").encode()
    reply = fields.get(b"reply")
    if reply is not None and not (reply.startswith(prefix) and len(prefix) < len(reply) <= 256):
        return "invalid 'reply'"
    if fields.get(b"v", b"1") != b"1":
        return "unknown protocol version"
    if b"data" not in fields:
        return "missing 'data'"
    if len(fields[b"data"]) > MAX_PAYLOAD:
        return "payload of"
    verdict = deadline_verdict(fields.get(b"deadline_ms", b""), at_ms)
    if verdict is not None:
        return None if verdict == EXPIRED else verdict  # expired: answered DeadlineExceeded, not decoded
    try:
        codec.decode(fields[b"data"])
    except codec.CodecError:
        return "undecodable payload"
    return None


def check_one(env: Env, entry: dict[str, Any]) -> None:
    stage = entry["stage"]
    at = now_ms()
    pairs = [(k, b"%d" % (at + v[1]) if isinstance(v, tuple) else v) for k, v in entry["pairs"]]
    fields = dict(pairs)
    rejection = expected_rejection(fields, at)
    entry_id = xadd_raw(env.client, stage, pairs)
    request_id = fields.get(b"id", b"")
    diagnostics = lambda: f"{pairs!r} at stage {stage}\n{env.workers.report()}"  # noqa: E731
    if rejection == BATCH:
        return
    if rejection is not None:
        letter = wait_for(lambda: env.dead_letter(stage, entry_id), 10, "a dead letter", diagnostics)
        assert letter[b"reason"].decode().startswith(rejection), (letter, pairs)
        if not ID_RE.fullmatch(request_id) or b"id" not in fields:  # nobody to tell
            return
        record = wait_for(lambda: result_of(env.client, request_id), 10, "the error record", diagnostics)
        assert record["error"]["type"] == "DeadLettered" and record["error"]["message"] == letter[b"reason"].decode()
    else:
        record = wait_for(lambda: result_of(env.client, request_id), 10, "an answer", diagnostics)
        assert record["id"] == request_id.decode()
        assert record["ok"] or record["error"]["type"] != "DeadLettered", (record, pairs)
        assert env.dead_letter(stage, entry_id) is None
        if record["ok"]:
            x = codec.decode(fields[b"data"])
            if isinstance(x, int) and not isinstance(x, bool):
                assert record["value"] == ((x + 10) / 2 if stage == 0 else x / 2)
    reply = fields.get(b"reply", b"")
    if reply.startswith(KEYS.reply("h-").encode()):  # one of ours, fresh: exactly this answer was pushed
        elements = env.client.lrange(reply, 0, -1)
        assert [msgpack.unpackb(e, raw=False) for e in elements] == [[record]], (elements, pairs)


def test_random_hostile_entries_never_harm_the_workers(env: Env) -> None:
    started = time.monotonic()

    @settings(max_examples=250, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(entry=hostile_entries())
    def throw(entry: dict[str, Any]) -> None:
        check_one(env, entry)

    throw()
    print(f"\n250 random entries checked in {time.monotonic() - started:.1f} s")
    assert_unharmed(env)
