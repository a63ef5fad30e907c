"""A foreign producer: another service that speaks to a pipeline with raw Redis commands only.

It knows the documented key names and the msgpack wire format, nothing of conveyor's code:
one XADD to submit, one BLPOP (or a GET of the result key) to read the answer.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import redis

from tests.helpers import Workers, read_pipeline_status, running_workers, wait_for
from workers.embedded.server import EmbeddedRedis

pytestmark = pytest.mark.system  # worker processes (tests/conftest.py: tiers)

PIPELINE = "t-foreign"  # tests/stages.py: AddOne then Guard, f(x) = 2 (x + 1), refuses x = 99
STREAM0 = "conveyor:{t-foreign}:stream:0"
MAX_BACKLOG = "conveyor:{t-foreign}:max_backlog"
SUBMIT_LUA = (Path(__file__).parent.parent / "broker" / "submit.lua").read_text()  # the text a producer EVALs
DEAD0 = "conveyor:{t-foreign}:dead:0"
T = 30.0


def result_key(request_id: str) -> str:
    return f"conveyor:{{t-foreign}}:result:{request_id}"


def reply_key(name: str) -> str:
    return f"conveyor:{{t-foreign}}:reply:{name}"


@pytest.fixture(scope="module")
def workers(redis_server: EmbeddedRedis) -> Iterator[Workers]:
    """One set of workers for the module (starting and stopping them is most of the cost).

    Tests here use ``redis_client`` from this module, not conftest's: that one empties the
    server, which would pull the consumer group from under these workers. Every test uses
    request ids and reply keys of its own instead.
    """
    client = redis.Redis.from_url(redis_server.url)
    try:
        client.flushall()
    finally:
        client.close()
    with running_workers(redis_server.url, "tests.stages:foreign", ["AddOne", "Guard"]) as group:
        group.wait_ready(PIPELINE, T)
        yield group


@pytest.fixture
def redis_client(workers: Workers) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(workers.redis_url)
    try:
        yield client
    finally:
        client.close()


def submit(client: redis.Redis, request_id: str, x: Any, reply: str | None = None) -> None:
    fields: dict[str, Any] = {"id": request_id, "data": msgpack.packb(x, use_bin_type=True),
                              "deadline_ms": int(time.time() * 1000) + 30_000}
    if reply is not None:
        fields["reply"] = reply
    client.xadd(STREAM0, fields)


def pop_records(client: redis.Redis, reply: str) -> list[dict[str, Any]]:
    popped = client.blpop([reply], timeout=T)
    assert popped is not None, f"no reply on {reply} within {T}s"
    records = msgpack.unpackb(popped[1], raw=False)
    assert isinstance(records, list)
    return records


def test_xadd_then_blpop(workers: Workers, redis_client: redis.Redis) -> None:
    request_id = f"foreign-{uuid.uuid4().hex}"
    reply = reply_key("svc-1")
    submit(redis_client, request_id, 5, reply)
    records = pop_records(redis_client, reply)
    assert records == [{"id": request_id, "ok": True, "value": 12}]
    # The result key holds the same record, as a plain msgpack map, with a TTL.
    raw = redis_client.get(result_key(request_id))
    assert raw is not None and msgpack.unpackb(raw, raw=False) == records[0]
    assert redis_client.pttl(result_key(request_id)) > 0


def test_many_requests_on_one_reply_key(workers: Workers, redis_client: redis.Redis) -> None:
    reply = reply_key("svc-many")
    ids = {f"m-{i}": i for i in range(50)}
    pipe = redis_client.pipeline(transaction=False)
    for request_id, x in ids.items():
        submit(pipe, request_id, x, reply)  # type: ignore[arg-type]
    pipe.execute()
    answers: dict[str, Any] = {}
    while len(answers) < len(ids):  # one element per batch: records of several requests each
        for record in pop_records(redis_client, reply):
            assert record["ok"] is True
            answers[record["id"]] = record["value"]
    assert answers == {request_id: 2 * (x + 1) for request_id, x in ids.items()}


def test_without_a_reply_key_the_result_key_answers(workers: Workers, redis_client: redis.Redis) -> None:
    request_id = "no-reply-1"
    replies_before = set(redis_client.keys(reply_key("*")))
    submit(redis_client, request_id, 20)
    raw = wait_for(lambda: redis_client.get(result_key(request_id)), T, "the result key", workers.report)
    assert msgpack.unpackb(raw, raw=False) == {"id": request_id, "ok": True, "value": 42}
    assert set(redis_client.keys(reply_key("*"))) <= replies_before  # nobody asked for a push: none was made


def test_a_raising_stage_answers_an_error_record(workers: Workers, redis_client: redis.Redis) -> None:
    request_id = "boom-1"
    reply = reply_key("svc-err")
    submit(redis_client, request_id, 99, reply)
    [record] = pop_records(redis_client, reply)
    assert record["id"] == request_id and record["ok"] is False and "value" not in record
    error = record["error"]
    assert set(error) == {"type", "message", "stage", "traceback"}
    assert error["type"] == "ValueError"
    assert error["message"] == "guard refuses 100"
    assert error["stage"] == "Guard"
    assert "Traceback" in error["traceback"] and "ValueError: guard refuses 100" in error["traceback"]
    assert msgpack.unpackb(redis_client.get(result_key(request_id)), raw=False) == record


def test_an_entry_without_an_id_is_dead_lettered(workers: Workers, redis_client: redis.Redis) -> None:
    entry = redis_client.xadd(STREAM0, {"data": msgpack.packb(1)})
    dead = wait_for(lambda: [f for _, f in redis_client.xrange(DEAD0) if f[b"entry"] == entry], T,
                    "a dead letter", workers.report)
    assert len(dead) == 1 and b"'id'" in dead[0][b"reason"] and dead[0][b"stage"] == b"AddOne"
    # and the pipeline is not stuck behind it
    reply = reply_key("svc-after")
    submit(redis_client, "after-1", 1, reply)
    assert pop_records(redis_client, reply) == [{"id": "after-1", "ok": True, "value": 4}]


def test_an_undecodable_payload_gets_an_error_record(workers: Workers, redis_client: redis.Redis) -> None:
    reply = reply_key("svc-bad")
    redis_client.xadd(STREAM0, {"id": "bad-payload", "data": b"\xc1", "reply": reply})  # 0xc1: never valid msgpack
    [record] = pop_records(redis_client, reply)
    assert record["id"] == "bad-payload" and record["ok"] is False
    assert record["error"]["type"] == "DeadLettered" and "undecodable" in record["error"]["message"]


def test_a_passed_deadline_is_answered_without_running_the_stage(workers: Workers, redis_client: redis.Redis) -> None:
    reply = reply_key("svc-late")
    redis_client.xadd(STREAM0, {"id": "late-1", "data": msgpack.packb(1), "reply": reply,
                                "deadline_ms": int(time.time() * 1000) - 1})
    [record] = pop_records(redis_client, reply)
    assert record["id"] == "late-1" and record["ok"] is False
    assert record["error"]["type"] == "DeadlineExceeded" and record["error"]["stage"] == "AddOne"
    assert "looks like seconds" not in record["error"]["message"]


def test_a_deadline_in_seconds_is_answered_with_a_hint(workers: Workers, redis_client: redis.Redis) -> None:
    """``deadline_ms`` set from ``time.time()`` or ``date +%s`` (seconds) is long past as ms: the answer
    was a bare DeadlineExceeded; it now says the value looks like seconds."""
    reply = reply_key("svc-seconds")
    redis_client.xadd(STREAM0, {"id": "seconds-1", "data": msgpack.packb(1), "reply": reply,
                                "deadline_ms": 1700000000})
    [record] = pop_records(redis_client, reply)
    assert record["id"] == "seconds-1" and record["error"]["type"] == "DeadlineExceeded"
    assert record["error"]["message"] == ("deadline passed before the stage ran (deadline_ms 1700000000 looks like "
                                          "seconds: it is milliseconds since the epoch)")


def test_a_reply_key_of_another_type_is_skipped_not_fatal(workers: Workers, redis_client: redis.Redis) -> None:
    reply = reply_key("svc-wrong-type")
    redis_client.set(reply, "not a list")
    submit(redis_client, "wrong-type-1", 3, reply)
    raw = wait_for(lambda: redis_client.get(result_key("wrong-type-1")), T, "the result key", workers.report)
    assert msgpack.unpackb(raw, raw=False) == {"id": "wrong-type-1", "ok": True, "value": 8}
    assert redis_client.get(reply) == b"not a list"
    wait_for(lambda: "WRONGTYPE" in workers.report() and "not a list" in workers.report(), T,
             "the worker saying the reply key is no list")
    workers.check_alive()
    # and the workers go on serving
    submit(redis_client, "wrong-type-2", 4, reply_key("svc-after-wrong-type"))
    assert pop_records(redis_client, reply_key("svc-after-wrong-type"))[0]["value"] == 10


@pytest.mark.parametrize("x", [1, 99], ids=["answered", "stage-error"])
def test_an_unreadable_trace_value_is_ignored_not_fatal(workers: Workers, redis_client: redis.Redis, x: int) -> None:
    """A ``trace`` value that asks for timings but is not ASCII (docs/protocol.md: a value that cannot
    be read is ignored) is answered untraced, without timings, by the same workers: none of them
    dies on it (their result record could not carry it), the value that fails in a stage included."""
    reply = reply_key(f"svc-bad-trace-{x}")
    fields = {"id": f"bad-trace-{x}", "data": msgpack.packb(x), "reply": reply, "trace": b"- t \xff",
              "deadline_ms": int(time.time() * 1000) + 30_000}
    redis_client.xadd(STREAM0, fields)  # type: ignore[arg-type]
    [record] = pop_records(redis_client, reply)
    assert record["id"] == f"bad-trace-{x}" and "timing" not in record
    assert record["ok"] is True if x == 1 else record["error"]["type"] == "ValueError"  # the stage's, not a crash's
    workers.check_alive()
    submit(redis_client, f"after-bad-trace-{x}", 2, reply)
    assert pop_records(redis_client, reply) == [{"id": f"after-bad-trace-{x}", "ok": True, "value": 6}]


def test_a_reused_request_id_is_counted_where_operators_look(workers: Workers, redis_client: redis.Redis) -> None:
    """The second run of a reused id writes no result and pushes nothing (its caller waits in vain): the
    workers counted it in P:counts only; now `conveyor status --json` and /metrics show it per stage."""
    request_id, reply = f"reused-{uuid.uuid4().hex[:8]}", reply_key(f"reused-{uuid.uuid4().hex[:8]}")
    submit(redis_client, request_id, 1, reply)
    assert [r["value"] for r in pop_records(redis_client, reply)] == [4]
    before = asyncio.run(read_pipeline_status(workers.redis_url, PIPELINE)).stages[-1].results_kept
    submit(redis_client, request_id, 2, reply)  # the same id again, within result_ttl_ms
    wait_for(lambda: asyncio.run(read_pipeline_status(workers.redis_url, PIPELINE)).stages[-1].results_kept > before,
             T, "the last stage's results_kept to count the reused id")
    assert msgpack.unpackb(redis_client.get(result_key(request_id)), raw=False)["value"] == 4  # the first answer


@pytest.mark.parametrize("entries", ["", "2"], ids=["single-entries", "batch-entries"])
def test_submit_lua_without_a_reply_key_answers_in_the_result_key(workers: Workers, redis_client: redis.Redis,
                                                                  entries: str) -> None:
    """A request submitted through submit.lua with no reply key and no deadline (empty arguments): the
    script writes them as empty fields on a single entry, which workers dead-lettered as an invalid
    'reply', while the same request in a batch entry was answered. Both are now served, answered in
    the result key only."""
    tag = uuid.uuid4().hex[:8]
    ids = [f"no-reply-lua-{tag}-{i}" for i in range(3)]
    args: list[Any] = []
    for i, request_id in enumerate(ids):
        args += [request_id, msgpack.packb(i), "", ""]
    assert redis_client.eval(SUBMIT_LUA, 2, STREAM0, MAX_BACKLOG, len(ids), "", *args, entries) == len(ids)
    for i, request_id in enumerate(ids):
        raw = wait_for(lambda rid=request_id: redis_client.get(result_key(rid)), T, "the result key", workers.report)
        assert msgpack.unpackb(raw, raw=False) == {"id": request_id, "ok": True, "value": 2 * (i + 1)}
    assert not [f for _, f in redis_client.xrange(DEAD0) if f.get(b"id") in {i.encode() for i in ids}]


def test_a_reply_key_over_the_documented_length_is_refused_saying_so(workers: Workers,
                                                                     redis_client: redis.Redis) -> None:
    """docs/protocol.md: a reply key holds at most 256 bytes. One longer, under the right prefix, was refused
    with a message saying only that it must start with that prefix, which it did."""
    request_id = f"long-reply-{uuid.uuid4().hex[:8]}"
    reply = reply_key("r" * 256)
    submit(redis_client, request_id, 1, reply)
    raw = wait_for(lambda: redis_client.get(result_key(request_id)), T, "the error record", workers.report)
    error = msgpack.unpackb(raw, raw=False)["error"]
    assert error["type"] == "DeadLettered" and "at most 256 bytes" in error["message"], error
    assert redis_client.exists(reply) == 0
