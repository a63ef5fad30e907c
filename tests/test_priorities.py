"""Priorities: a pipeline of ``priority_levels`` N serves its higher levels first at every stage.

Real redis-server, real ``conveyor worker`` processes (tests/priority_stages.py). A stage's
``Record`` holds on a gate input while a backlog of every level builds up behind it, then the test
releases it and reads the order the stage ran its inputs in. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import functools
import json
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any, cast

import msgpack
import pytest
import redis

from broker.keys import Keys
from broker.levels import stream_level
from broker.registry import register
from broker.spec import decode_spec, encode_spec
from broker.submit import Submitter
from gateway import Gateway, Overloaded
from gateway.client.settings import GatewaySettings
from tests.helpers import Workers, running_workers, wait_for
from tests.ops_stages import Proc, exchange, free_port, http_request, start_conveyor, status_code, stop_all
from tests.priority_stages import plain
from workers.embedded.server import EmbeddedRedis

T = 30.0
APP = "tests.priority_stages"


def stream_len(client: redis.Redis, key: str) -> int:
    return int(client.xlen(key)) if client.exists(key) else 0


def hold(client: redis.Redis, pipeline: str, stage: int) -> None:
    """Wait until the stage's worker holds on its gate input (sent by the caller)."""
    wait_for(lambda: client.exists(f"t:{pipeline}:held:{stage}"), T, f"stage {stage} of {pipeline} held")


def release(client: redis.Redis, pipeline: str, stage: int) -> None:
    client.rpush(f"t:{pipeline}:gate:{stage}", 1)


def order(client: redis.Redis, pipeline: str, stage: int, count: int) -> list[str]:
    key = f"t:{pipeline}:order:{stage}"
    wait_for(lambda: client.llen(key) >= count, T, f"{count} inputs run at stage {stage}")
    return [v.decode() for v in client.lrange(key, 0, -1)]


@pytest.fixture(scope="module")
def server(redis_server: EmbeddedRedis) -> Iterator[str]:
    client = redis.Redis.from_url(redis_server.url)
    try:
        client.flushall()  # the session's server: this module's workers run on it until its end
    finally:
        client.close()
    yield redis_server.url


@pytest.fixture(scope="module")
def ordered(server: str) -> Iterator[Workers]:
    with running_workers(server, f"{APP}:ordered", ["Record", "Record1"]) as group:
        group.wait_ready("t-prio", T)
        yield group


@pytest.fixture
def client(server: str) -> Iterator[redis.Redis]:
    c = redis.Redis.from_url(server)
    try:
        yield c
    finally:
        c.close()


async def submit_all(url: str, pipeline: str, batches: list[tuple[list[str], int]]) -> list[Any]:
    """Every value of each ``(values, priority)`` in order, one turn each; their answers."""
    async with Gateway(url, pipeline, GatewaySettings(timeout_s=T)) as gw:
        futures: list[Any] = []
        for values, priority in batches:
            futures += [gw.submit(v, priority=priority) for v in values]
            await asyncio.sleep(0)  # the flusher's turn: each batch reaches Redis in order
        return list(await asyncio.wait_for(asyncio.gather(*futures), T))


def run_with_gate(url: str, pipeline: str, stage: int, backlog: list[tuple[list[str], int]],
                  queued: dict[str, int]) -> list[Any]:
    """Hold ``stage`` on its gate, submit ``backlog``, wait until Redis holds ``queued`` (stream -> XLEN),
    release the gate; the answers."""
    client = redis.Redis.from_url(url)
    answers: list[Any] = []
    try:
        thread = threading.Thread(target=lambda: answers.extend(asyncio.run(submit_all(
            url, pipeline, [([f"gate{stage}"], 0)]))), daemon=True)
        thread.start()
        hold(client, pipeline, stage)
        done: list[Any] = []
        second = threading.Thread(target=lambda: done.extend(asyncio.run(submit_all(url, pipeline, backlog))),
                                  daemon=True)
        second.start()
        for stream, n in queued.items():
            wait_for(lambda s=stream, n=n: stream_len(client, s) >= n, T, f"{n} entries in {stream}")
        release(client, pipeline, stage)
        second.join(T)
        thread.join(T)
        assert not second.is_alive() and not thread.is_alive(), "answers did not come in time"
        return done
    finally:
        client.close()


def test_higher_level_first_and_fifo_within_a_level(ordered: Workers, client: redis.Redis) -> None:
    low = [f"d{i}" for i in range(6)]
    high = [f"p{i}" for i in range(6)]
    p = Keys("t-prio")
    answers = run_with_gate(ordered.redis_url, "t-prio", 0, [(low, 0), (high, 1)],
                            {p.stream(0): 1 + len(low), p.at_level(1).stream(0): len(high)})
    assert answers == low + high
    assert order(client, "t-prio", 0, 12)[-12:] == high + low


def test_priority_travels_to_the_next_stage(ordered: Workers, client: redis.Redis) -> None:
    """Stage 1 holds: stage 0 forwards each request into its own level's stream of stage 1."""
    client.delete("t:t-prio:order:1")
    low = [f"e{i}" for i in range(5)]
    high = [f"q{i}" for i in range(5)]
    p = Keys("t-prio")
    answers = run_with_gate(ordered.redis_url, "t-prio", 1, [(low, 0), (high, 1)],
                            {p.stream(1): 1 + len(low), p.at_level(1).stream(1): len(high)})
    assert answers == low + high
    assert order(client, "t-prio", 1, 10)[-10:] == high + low


@pytest.mark.parametrize("fill", [True, False], ids=["fill", "no-fill"])
def test_a_higher_levels_batch_is_filled_from_the_levels_below(server: str, client: redis.Redis, fill: bool) -> None:
    """A batched stage holds while 6 default-level requests and 1 of priority 1 queue: released, it runs
    the priority-1 request at the head of one batch with the six (``--fill-levels``, the default), or
    alone and then the six (``--no-fill-levels``). Either way each part moves on at its own level: the
    next stage, held meanwhile, runs the priority-1 request first."""
    pipeline, p = "t-prio-fill", Keys("t-prio-fill")
    client.delete(*(f"t:{pipeline}:{what}" for what in ("batches:0", "order:1")))
    low, high = [f"d{i}" for i in range(6)], ["p0"]
    with running_workers(server, f"{APP}:filled", ["RecordBatches", "Record1"],
                         CONVEYOR_FILL_LEVELS="1" if fill else "0") as group:
        group.wait_ready(pipeline, T)
        answers: dict[str, list[Any]] = {}

        def submit(name: str, batches: list[tuple[list[str], int]]) -> threading.Thread:
            def send() -> None:
                answers[name] = asyncio.run(submit_all(server, pipeline, batches))

            thread = threading.Thread(target=send, daemon=True)
            thread.start()
            return thread

        threads = [submit("gate1", [(["gate1"], 0)])]
        hold(client, pipeline, 1)
        threads.append(submit("gate0", [(["gate0"], 0)]))
        hold(client, pipeline, 0)
        threads.append(submit("backlog", [(low, 0), (high, 1)]))
        for stream, n in ((p.stream(0), 1 + len(low)), (p.at_level(1).stream(0), len(high))):
            wait_for(lambda s=stream, n=n: stream_len(client, s) >= n, T, f"{n} entries in {stream}")
        release(client, pipeline, 0)
        def done(stream: str) -> bool:
            return not client.xpending(stream, "workers")["pending"] and not client.xinfo_groups(stream)[0]["lag"]

        for stream in (p.stream(0), p.at_level(1).stream(0)):  # stage 0 committed all: stage 1 holds them
            wait_for(functools.partial(done, stream), T, f"stage 0 done with {stream}")
        release(client, pipeline, 1)
        for thread in threads:
            thread.join(T)
        ran_next = order(client, pipeline, 1, 8)
    assert answers == {"gate1": ["gate1"], "gate0": ["gate0"], "backlog": low + high}
    batches = [json.loads(b) for b in client.lrange(f"t:{pipeline}:batches:0", 0, -1)]
    assert batches == [["gate1"], *([high + low] if fill else [high, low])]
    assert ran_next == [*high, "gate0", *low]


def test_a_lone_higher_level_request_on_an_idle_worker_does_not_wait_the_window(server: str) -> None:
    """``batch_policy="deadline"``, a window of 3 s for 8 items: a lone priority-1 request reaching the idle
    worker (its blocking read on every level) runs at once, as a batch holding a higher level's entries does
    on the non-blocking reads; it used to wait the whole window, as a default-level one does."""
    pipeline = "t-prio-window"
    with running_workers(server, f"{APP}:windowed", ["Window"]) as group:
        group.wait_ready(pipeline, T)

        async def lone() -> list[float]:
            async with Gateway(server, pipeline, GatewaySettings(timeout_s=T)) as gw:
                took = []
                for i in range(3):
                    started = time.perf_counter()
                    assert await asyncio.wait_for(gw.predict(f"p{i}", priority=1), T) == f"p{i}"
                    took.append(time.perf_counter() - started)
                return took

        took = asyncio.run(lone())
    assert max(took) < 1.0, took  # the window is 3 s


def test_a_foreign_producer_adds_to_a_level_stream(ordered: Workers, client: redis.Redis) -> None:
    rid, reply = uuid.uuid4().hex, f"conveyor:{{t-prio}}:reply:{uuid.uuid4().hex}"
    client.xadd("conveyor:{t-prio}:stream:0:p1", {"id": rid, "data": msgpack.packb("foreign"), "reply": reply,
                                                 "deadline_ms": int(time.time() * 1000) + 30_000})
    popped = client.blpop([reply], timeout=T)
    assert popped is not None
    assert msgpack.unpackb(popped[1]) == [{"id": rid, "ok": True, "value": "foreign"}]


def test_http_header_and_oip_parameters(ordered: Workers, client: redis.Redis, tmp_path: Any) -> None:
    port = free_port()
    procs: list[Proc] = [start_conveyor(tmp_path, "gateway", "gateway", "t-prio", "--redis", ordered.redis_url,
                                        "--port", str(port), redis_url=ordered.redis_url)]
    try:
        wait_for(lambda: status_code(port, "/readyz") == 200, T, "the gateway ready")
        client.delete("t:t-prio:order:0")
        replies: dict[str, Any] = {}

        def call(name: str, path: str, body: bytes, headers: dict[str, str], timeout_s: float = T) -> None:
            replies[name] = exchange(port, http_request("POST", path, body, {"content-type": "application/json",
                                                                            **headers}), "POST", timeout_s)

        infer = "/v2/models/t-prio/infer"

        def oip(value: str, parameters: dict[str, int]) -> bytes:
            return json.dumps({"inputs": [{"name": "x", "datatype": "BYTES", "shape": [1], "data": [value]}],
                               "parameters": parameters}).encode()

        gate = threading.Thread(target=call, args=("gate", "/v1/predict", b'"gate0"', {}), daemon=True)
        gate.start()
        hold(client, "t-prio", 0)
        # parameters.timeout, in microseconds: a 504 long before the gateway's default of 30 s
        call("timeout", infer, oip("late", {"timeout": 300_000}), {}, timeout_s=10.0)
        assert replies["timeout"].status == 504, replies["timeout"].body
        threads = [threading.Thread(target=call, args=args, daemon=True) for args in (
            ("low", "/v1/predict", b'"low"', {}),
            ("header", "/v1/predict", b'"header"', {"x-conveyor-priority": "1"}),
            ("oip", infer, oip("oip", {"priority": 1}), {}))]
        for thread in threads:
            thread.start()
        p = Keys("t-prio")
        wait_for(lambda: stream_len(client, p.at_level(1).stream(0)) == 2, T, "two requests at level 1")
        wait_for(lambda: stream_len(client, p.stream(0)) >= 3, T, "the gate, 'late' and 'low' at the default level")
        release(client, "t-prio", 0)
        for thread in [*threads, gate]:
            thread.join(T)
        assert {name: r.status for name, r in replies.items()} == {"gate": 200, "timeout": 504, "low": 200,
                                                                    "header": 200, "oip": 200}
        ran = [x for x in order(client, "t-prio", 0, 3) if x != "late"]  # 'late' ran too: a stage skips it
        assert set(ran[:2]) == {"header", "['oip']"} and ran[2] == "low", ran
        bad = exchange(port, http_request("POST", "/v1/predict", b"1", {"content-type": "application/json",
                                                                        "x-conveyor-priority": "high"}), "POST")
        assert bad.status == 400
        bad = exchange(port, http_request("POST", infer, oip("x", {"priority": -1}),
                                          {"content-type": "application/json"}), "POST")
        assert bad.status == 400
    finally:
        stop_all(procs)


def test_oip_parameters_priority_wins_over_the_header_and_a_bad_header_is_refused(
        ordered: Workers, client: redis.Redis, tmp_path: Any) -> None:
    """``parameters.priority: 0`` with ``X-Conveyor-Priority: 1`` is the default level (the parameter wins,
    0 included), on infer and generate alike; a malformed header is a 400 whatever the parameter says."""
    port = free_port()
    procs: list[Proc] = [start_conveyor(tmp_path, "gateway", "gateway", "t-prio", "--redis", ordered.redis_url,
                                        "--port", str(port), redis_url=ordered.redis_url)]
    p = Keys("t-prio")
    try:
        wait_for(lambda: status_code(port, "/readyz") == 200, T, "the gateway ready")
        replies: dict[str, Any] = {}

        def call(name: str, path: str, body: bytes, headers: dict[str, str]) -> None:
            replies[name] = exchange(port, http_request("POST", path, body, {"content-type": "application/json",
                                                                            **headers}), "POST", T)

        infer, generate = "/v2/models/t-prio/infer", "/v2/models/t-prio/generate"

        def tensor(value: str, parameters: dict[str, int]) -> bytes:
            return json.dumps({"inputs": [{"name": "x", "datatype": "BYTES", "shape": [1], "data": [value]}],
                               "parameters": parameters}).encode()

        def text(value: str, parameters: dict[str, int]) -> bytes:
            return json.dumps({"x": value, "parameters": parameters}).encode()

        for name, path, body in (("infer-bad", infer, tensor("b1", {"priority": 2})),
                                 ("generate-bad", generate, text("b2", {"priority": 2}))):
            call(name, path, body, {"x-conveyor-priority": "abc"})
            assert replies[name].status == 400, (name, replies[name].body)
            assert b"x-conveyor-priority must be an integer" in replies[name].body.lower()
        gate = threading.Thread(target=call, args=("gate", "/v1/predict", b'"gate0"', {}), daemon=True)
        gate.start()
        hold(client, "t-prio", 0)
        before = (stream_len(client, p.stream(0)), stream_len(client, p.at_level(1).stream(0)))
        threads = [threading.Thread(target=call, args=(name, path, body, {"x-conveyor-priority": "1"}), daemon=True)
                   for name, path, body in (("infer", infer, tensor("i0", {"priority": 0})),
                                            ("generate", generate, text("g0", {"priority": 0})))]
        for thread in threads:
            thread.start()

        def queued() -> int:
            return stream_len(client, p.stream(0)) + stream_len(client, p.at_level(1).stream(0)) - sum(before)

        wait_for(lambda: queued() >= 2, T, "both requests queued")
        assert (stream_len(client, p.stream(0)) - before[0], stream_len(client, p.at_level(1).stream(0))) == (2, 0)
        release(client, "t-prio", 0)
        for thread in [*threads, gate]:
            thread.join(T)
        assert {name: r.status for name, r in replies.items() if not name.endswith("-bad")} == {
            "gate": 200, "infer": 200, "generate": 200}
    finally:
        stop_all(procs)


def test_starvation_guard_serves_the_default_level(server: str, client: redis.Redis) -> None:
    """fair_after=2: after two batches of level 1 in a row, one of the default level."""
    with running_workers(server, f"{APP}:fair", ["Record"]) as group:
        group.wait_ready("t-prio-fair", T)
        low = [f"d{i}" for i in range(3)]
        high = [f"p{i}" for i in range(8)]
        p = Keys("t-prio-fair")
        run_with_gate(server, "t-prio-fair", 0, [(low, 0), (high, 1)],
                      {p.stream(0): 1 + len(low), p.at_level(1).stream(0): len(high)})
        ran = order(client, "t-prio-fair", 0, 11)
    assert ran == ["p0", "p1", "d0", "p2", "p3", "d1", "p4", "p5", "d2", "p6", "p7"]


@pytest.mark.parametrize("levels,priority,level", [(2, 1, 1), (3, 2, 2), (2, 2, 0)],
                         ids=["level-1", "level-2-of-3", "above-the-levels"])
def test_a_priority_given_before_the_pipeline_is_registered_is_kept(server: str, client: redis.Redis, levels: int,
                                                                    priority: int, level: int) -> None:
    """A request made while the gateway does not know the pipeline yet (one level, then) waits for its
    registration, then goes to its priority's stream as the registered spec says (a priority above the levels:
    the default level's); it used to go to the default level's whatever its priority."""
    from tests.priority_stages import Record
    from workers import Pipeline

    name = f"t-prio-late{levels}{priority}"
    pipeline = Pipeline(name, priority_levels=levels).add(Record, pipeline=name, stage=0)
    keys = pipeline.keys
    streams = [k.stream(0) for k in keys.levels(levels)]

    async def scenario() -> None:
        async with Gateway(server, name, GatewaySettings(timeout_s=T)) as gw:
            future = gw.submit("x", priority=priority)
            assert not gw.registration.registered  # it waits for the registration
            await asyncio.to_thread(register, client, name, [(k, k.stream(0)) for k in keys.levels(levels)],
                                    encode_spec(pipeline.describe()), None)
            await asyncio.to_thread(wait_for, lambda: sum(stream_len(client, s) for s in streams) == 1, T,
                                    "the request added")
            cast_future = cast("asyncio.Future[Any]", future)
            cast_future.cancel()
            await asyncio.gather(cast_future, return_exceptions=True)

    asyncio.run(asyncio.wait_for(scenario(), 2 * T))
    assert {s: stream_len(client, s) for s in streams} == {s: int(s == keys.at_level(level).stream(0))
                                                           for s in streams}


def test_admission_per_level_refuses_the_lowest_first(server: str, client: redis.Redis) -> None:
    """max_backlog=3 for every level; a level's backlog counts the levels above it."""
    from tests.priority_stages import Record
    from workers import Pipeline

    pipeline = Pipeline("t-prio-adm", priority_levels=2).add(Record, pipeline="t-prio-adm", stage=0, max_backlog=3)
    keys = pipeline.keys
    register(client, pipeline.name, [(k, k.stream(0)) for k in keys.levels(2)], encode_spec(pipeline.describe()), 3)

    async def scenario() -> list[str]:
        outcomes: list[str] = []
        async with Gateway(server, "t-prio-adm", GatewaySettings(timeout_s=T)) as gw:
            async def one(priority: int) -> None:
                future = gw.submit("x", priority=priority)
                try:
                    await asyncio.wait_for(asyncio.shield(future), 0.5)
                except Overloaded:
                    outcomes.append(f"refused {priority}")
                    return
                except TimeoutError:
                    pass  # admitted: no worker answers it
                outcomes.append(f"admitted {priority}")
            for priority in (0, 0, 1, 1, 0, 1, 1):
                await one(priority)
        return outcomes

    assert asyncio.run(scenario()) == ["admitted 0", "admitted 0", "admitted 1", "admitted 1", "refused 0",
                                       "admitted 1", "refused 1"]
    assert stream_len(client, keys.stream(0)) == 2 and stream_len(client, keys.at_level(1).stream(0)) == 3


def test_unchanged_without_priorities(server: str, client: redis.Redis) -> None:
    """A pipeline without levels: the same spec, keys and submit call as before; a priority asked of it
    goes to the default level (Triton: a priority past the levels is the default)."""
    assert decode_spec(encode_spec(plain.describe()))[0].priority_levels == 1
    assert b"priority_levels" not in encode_spec(plain.describe())
    keys = Keys("t-prio-none")
    assert keys.levels(1) == [keys] and keys.stream(0) == "conveyor:{t-prio-none}:stream:0"
    args = Submitter(keys, b"r").arguments([(b"i", b"d", b"9", b"")], [])
    assert args[2:5] == [b"2", b"conveyor:{t-prio-none}:stream:0", b"conveyor:{t-prio-none}:max_backlog"]
    assert len(args) == 11  # no optional tail
    with running_workers(server, f"{APP}:plain", ["Record"]) as group:
        group.wait_ready("t-prio-none", T)

        async def both() -> list[Any]:
            async with Gateway(server, "t-prio-none", GatewaySettings(timeout_s=T)) as gw:
                return list(await asyncio.gather(gw.predict(1), gw.predict(2, priority=1)))

        assert asyncio.run(both()) == [1, 2]
    assert list(client.scan_iter(match="conveyor:{t-prio-none}:stream:*:p*")) == []


@pytest.mark.unit
def test_stream_level_follows_triton() -> None:
    assert [stream_level(p, 3) for p in (0, 1, 2, 3, 4)] == [0, 1, 2, 0, 0]
    assert [stream_level(p, 1) for p in (0, 1, 5)] == [0, 0, 0]
    for bad in (-1, True, 1.5, "1"):
        with pytest.raises(ValueError):
            stream_level(bad, 2)  # type: ignore[arg-type]
    assert [k.stream(2) for k in Keys("p").levels(3)] == ["conveyor:{p}:stream:2:p1", "conveyor:{p}:stream:2:p2",
                                                          "conveyor:{p}:stream:2"]


@pytest.mark.unit
def test_a_batch_of_several_levels_is_one_commit_unless_two_carry_stats() -> None:
    """The levels' commits of one batch go as one call of the lowest level's lane (the others' streams,
    acks and forwards as its level parts; their results and dead letters with its own), or of the lane
    whose stats are due; each on its own when two carry stats or one puts items back."""
    from types import SimpleNamespace

    from broker.commit import Commit
    from workers.loop.priorities import one_commit

    def lane(level: int) -> Any:
        keys = Keys("p").at_level(level)
        return SimpleNamespace(committer=SimpleNamespace(streams=(keys.stream(0), keys.stream(1))))

    high, low = lane(1), lane(0)
    part, main = Commit(acks=[b"1-0"]), Commit(acks=[b"2-0"])
    part.publish(b"k", b"record", None)
    part.dead_letter(b"1-1", b"r", "bad", b"")
    assert one_commit([(high, part), (low, main)]) == (low, main)
    assert main.level_parts == [("conveyor:{p}:stream:0:p1", "conveyor:{p}:stream:1:p1", part)]
    assert main.results == part.results and main.dead == part.dead

    stats = (b"1", b"0.5", b"", b"")
    part, main = Commit(acks=[b"1-0"], stats=stats), Commit(acks=[b"2-0"])
    assert one_commit([(high, part), (low, main)]) == (high, part)
    assert part.level_parts == [("conveyor:{p}:stream:0", "conveyor:{p}:stream:1", main)]

    assert one_commit([(high, Commit(stats=stats)), (low, Commit(stats=stats))]) is None
    assert one_commit([(high, Commit(back=[b"r", b"x", b"", b""])), (low, Commit())]) is None


@pytest.mark.unit
def test_a_priority_header_past_every_level_is_the_default_however_long() -> None:
    """docs/operations.md: any value above the pipeline's levels is the default level; 20 digits was a 400."""
    from broker.levels import stream_level
    from gateway.http.predict import PRIORITY_HEADER, priority_of
    from gateway.http.types import HttpError

    assert stream_level(priority_of({PRIORITY_HEADER: b"9" * 30}), 3) == 0
    assert priority_of({PRIORITY_HEADER: b"2"}) == 2 and priority_of({}) == 0
    for bad in (b"-1", b"high", b"1.5", b""):
        with pytest.raises(HttpError, match="must be an integer >= 0"):
            priority_of({PRIORITY_HEADER: bad})
