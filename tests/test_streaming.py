"""Streaming answers and cancellation, through real workers and a real Redis (tests/stream_stages.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import redis

from broker import codec, protocol
from broker.keys import Keys
from gateway import Gateway, GatewaySettings, Overloaded, StageError
from tests.helpers import read_pipeline_status, running_workers, wait_for
from workers import END, Pipeline, PipelineError
from workers.stage import Stage

pytestmark = pytest.mark.system  # worker processes (tests/conftest.py: tiers)

APP = "tests.stream_stages"


async def _collect(chunks: AsyncIterator[Any]) -> list[Any]:
    return [chunk async for chunk in chunks]


def _runs(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def test_chunks_arrive_in_order_then_the_stream_ends(redis_url: str, tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    with running_workers(redis_url, f"{APP}:words", ["Words"], STREAM_RUNS=str(runs)) as workers:
        workers.wait_ready("t-words")

        async def scenario() -> tuple[list[list[str]], list[str], StageError]:
            async with Gateway(redis_url, "t-words", GatewaySettings(timeout_s=10)) as gw:
                texts = [" ".join(f"w{i}-{j}" for j in range(i)) for i in range(1, 30)]
                streams = await asyncio.gather(*(_collect(gw.stream(text)) for text in texts))
                first: list[str] = []
                with pytest.raises(StageError) as failed:
                    async for chunk in gw.stream("x boom y"):
                        first.append(chunk)
                with pytest.raises(ValueError, match=r"use Gateway\.stream"):
                    await gw.predict("a b")
                assert await _collect(gw.stream("once", request_id="s-1")) == ["once"]
                # An id used again within result_ttl_ms is refused, as predict's (its first run may be going on)
                with pytest.raises(ValueError, match="'s-1' was answered, cancelled or timed out a moment ago"):
                    await asyncio.wait_for(_collect(gw.stream("twice", request_id="s-1")), 5)
                return streams, first, failed.value

        streams, first, error = asyncio.run(scenario())
        assert streams == [[f"w{i}-{j}" for j in range(i)] for i in range(1, 30)]
        assert first == ["x"] and error.type == "RuntimeError" and "boom in the middle" in error.message


def test_a_batched_stream_lets_short_answers_leave_early(redis_url: str) -> None:
    with running_workers(redis_url, f"{APP}:counts", ["Count"]) as workers:
        workers.wait_ready("t-counts")

        async def scenario() -> list[list[int]]:
            async with Gateway(redis_url, "t-counts", GatewaySettings(timeout_s=10)) as gw:
                return list(await asyncio.gather(*(_collect(gw.stream(n)) for n in [5, 0, 3, 1, 12, 7])))

        assert asyncio.run(scenario()) == [list(range(n)) for n in [5, 0, 3, 1, 12, 7]]


def test_a_batched_stream_that_fails_at_its_start_fails_only_the_bad_items(redis_url: str, tmp_path: Path) -> None:
    """Every item of the batch got the bad one's error, its message quoting another caller's input."""
    runs = tmp_path / "runs"
    with running_workers(redis_url, f"{APP}:checked_counts", ["CheckedCount"], STREAM_RUNS=str(runs)) as workers:
        workers.wait_ready("t-checked-counts")

        async def scenario() -> list[Any]:
            async with Gateway(redis_url, "t-checked-counts", GatewaySettings(timeout_s=10)) as gw:
                return list(await asyncio.gather(*(_collect(gw.stream(n)) for n in [3, {"ssn": "123"}, 2]),
                                                 return_exceptions=True))

        good, bad, other = asyncio.run(scenario())
    assert _runs(runs)[0] == "checked 3" and _runs(runs).count("batch 1") == 2  # one read; its good halves ran
    assert good == [0, 1, 2] and other == [0, 1]
    assert isinstance(bad, StageError) and bad.type == "TypeError" and "ssn" in bad.message


def test_a_batched_stream_that_changed_its_items_before_failing_runs_the_good_ones_as_they_arrived(
        redis_url: str) -> None:
    """Its halves ran on the lists the failed start had changed: two start tokens for every good item."""
    with running_workers(redis_url, f"{APP}:tokens", ["Tokens"]) as workers:
        workers.wait_ready("t-tokens")

        async def scenario() -> list[Any]:
            async with Gateway(redis_url, "t-tokens", GatewaySettings(timeout_s=10)) as gw:
                return list(await asyncio.gather(*(_collect(gw.stream(ids)) for ids in [[1, 2], [-1], [3]]),
                                                 return_exceptions=True))

        good, bad, other = asyncio.run(scenario())
    assert good == [101, 1, 2] and other == [101, 3], (good, other)
    assert isinstance(bad, StageError) and bad.message == "negative token id"


def test_a_stream_left_early_closes_the_stages_generator(redis_url: str, tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    text = " ".join(f"w{j}" for j in range(200))  # 200 words, 50 ms apart: 10 s if never closed
    with running_workers(redis_url, f"{APP}:slow_words", ["Words"], STREAM_RUNS=str(runs)) as workers:
        workers.wait_ready("t-slow-words")

        async def scenario() -> list[str]:
            async with Gateway(redis_url, "t-slow-words", GatewaySettings(timeout_s=30)) as gw:
                got: list[str] = []
                async for chunk in gw.stream(text):
                    got.append(chunk)
                    if len(got) == 3:
                        break  # the caller leaves: the request is cancelled
                await asyncio.to_thread(wait_for, lambda: f"closed {text}" in _runs(runs), 5,
                                        "the stage's generator was closed")
                # The worker serves the next stream at once: it did not run the left one to its end.
                again = [c async for c in gw.stream("a b")]
                return got + again

        assert asyncio.run(scenario()) == ["w0", "w1", "w2", "a", "b"]
        assert f"end {text}" not in _runs(runs)


@pytest.mark.parametrize("pipeline", ["t-slow", "t-slow-parts"])
def test_cancelled_callers_items_never_reach_predict(redis_url: str, redis_client: redis.Redis, tmp_path: Path,
                                                     pipeline: str) -> None:
    """A backlog of a slow stage (0.1 s per item) whose callers cancel their tasks: the items left in
    the stream are dropped (acked, counted), not run. Partitioned too: there a request is submitted by
    a task of the gateway (round robin), which cancelled nothing."""
    runs = tmp_path / "runs"
    app = f"{APP}:{'slow' if pipeline == 't-slow' else 'slow_parts'}"
    with running_workers(redis_url, app, ["Slow"], STREAM_RUNS=str(runs)) as workers:
        workers.wait_ready(pipeline)

        async def scenario() -> None:
            async with Gateway(redis_url, pipeline, GatewaySettings(timeout_s=30)) as gw:
                assert await gw.predict("warm") == "warm"  # the worker has measured its batches: slow
                tasks = [asyncio.ensure_future(gw.predict(i)) for i in range(40)]
                await asyncio.to_thread(wait_for, lambda: "ran 0" in _runs(runs), 10, "the first item started")
                for task in tasks:
                    task.cancel()
                left = [r for r in await asyncio.gather(*tasks, return_exceptions=True)
                        if isinstance(r, asyncio.CancelledError)]
                assert len(left) >= 38 and gw.hub.cancels == len(left) and not gw.hub.requests
                assert await gw.predict("after", timeout_s=10) == "after"  # behind them in the stream

        asyncio.run(scenario())
        ran = [line for line in _runs(runs) if line.startswith("ran ") and line not in ("ran warm", "ran after")]
        assert ran and len(ran) <= 2, ran  # the one running when they left, perhaps the one read next
        # Counted where status and /metrics read them (with the worker's next heartbeat).
        parts = Keys(pipeline).partitions(1 if pipeline == "t-slow" else 2)

        def cancelled() -> int:
            return sum(int(redis_client.hget(k.counts(0), "cancelled") or 0) for k in parts)

        wait_for(lambda: cancelled() >= 40 - len(ran), 5, "the cancelled items counted in P:counts:0")
        status = asyncio.run(read_pipeline_status(redis_url, pipeline))
        assert status.stages[0].cancelled >= 40 - len(ran)


def test_a_caller_id_that_timed_out_is_refused_again_and_its_first_run_dropped(redis_url: str, tmp_path: Path) -> None:
    """A retry under the id of a request that timed out took that request's answer (its stale
    DeadlineExceeded, or the result of the first input); and a deadline entry of the first expired it."""
    runs = tmp_path / "runs"
    with running_workers(redis_url, f"{APP}:slow", ["Slow"], STREAM_RUNS=str(runs)) as workers:
        workers.wait_ready("t-slow")

        async def scenario() -> None:
            async with Gateway(redis_url, "t-slow", GatewaySettings(timeout_s=30)) as gw:
                ahead = [asyncio.ensure_future(gw.predict(f"ahead {i}")) for i in range(10)]  # ~1 s of work
                with pytest.raises(TimeoutError):
                    await gw.predict("first", request_id="mine", timeout_s=0.3)
                with pytest.raises(ValueError, match="'mine' was answered, cancelled or timed out a moment ago"):
                    await gw.predict("second", request_id="mine")
                assert [await task for task in ahead] == [f"ahead {i}" for i in range(10)]
                assert await gw.predict("after", timeout_s=10) == "after"  # behind "first" in the stream

        asyncio.run(scenario())
        assert "ran first" not in _runs(runs) and "ran second" not in _runs(runs)


@pytest.mark.parametrize("first_timeout_s", [0.002, 0.12])  # before its first chunk, and in its middle
def test_a_stream_under_a_caller_id_that_timed_out_is_refused_again(redis_url: str, first_timeout_s: float) -> None:
    """As predict: a stream retried under the id of one that timed out took the first run's chunks or
    its stale DeadlineExceeded ("chunk 0 of the stream is missing ... Redis lost part of it")."""
    with running_workers(redis_url, f"{APP}:slow_words", ["Words"]) as workers:
        workers.wait_ready("t-slow-words")

        async def scenario() -> None:
            async with Gateway(redis_url, "t-slow-words", GatewaySettings(timeout_s=30)) as gw:
                with pytest.raises(TimeoutError):
                    async for _ in gw.stream("a b c d e f g h", request_id="again", timeout_s=first_timeout_s):
                        pass
                with pytest.raises(ValueError, match="'again' was answered, cancelled or timed out a moment ago"):
                    async for _ in gw.stream("x y", request_id="again"):
                        pass
                assert [chunk async for chunk in gw.stream("x y", request_id="fresh")] == ["x", "y"]

        asyncio.run(scenario())


def test_cancelling_a_submit_future_cancels_its_request(redis_url: str, tmp_path: Path) -> None:
    """``gw.submit(x).cancel()`` left the request in flight (counted against max_in_flight) and run by the
    workers; only ``gw.cancel(future)`` or a cancelled ``predict`` task cancelled it."""
    runs = tmp_path / "runs"
    with running_workers(redis_url, f"{APP}:slow", ["Slow"], STREAM_RUNS=str(runs)) as workers:
        workers.wait_ready("t-slow")

        async def scenario() -> None:
            async with Gateway(redis_url, "t-slow", GatewaySettings(timeout_s=30)) as gw:
                ahead = gw.submit("ahead")  # 0.1 s of work before the others
                futures = [gw.submit(f"left {i}") for i in range(10)]
                for future in futures:
                    assert future.cancel()
                assert gw.in_flight == 1 and gw.hub.cancels == 10
                assert await ahead == "ahead"
                assert await gw.predict("after", timeout_s=10) == "after"  # behind the cancelled ones

        asyncio.run(scenario())
        assert "ran left" not in _runs(runs)


def test_only_the_last_stage_may_stream() -> None:
    class Gen(Stage):
        def predict(self, x: object) -> object:
            yield x

    class Plain(Stage):
        def predict(self, x: object) -> object:
            return x

    Pipeline("ok").add(Plain).add(Gen)
    with pytest.raises(PipelineError, match=r"stage Gen streams .* must be the last stage"):
        Pipeline("no").add(Gen).add(Plain)
    assert END is not None and repr(END) == "END"


def test_a_continuous_stage_takes_new_items_into_its_running_batch(redis_url: str, tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    with running_workers(redis_url, f"{APP}:growing", ["Growing"], STREAM_RUNS=str(runs)) as workers:
        workers.wait_ready("t-growing")

        async def scenario() -> tuple[list[list[int]], list[int]]:
            ended: list[int] = []

            async def one(gw: Gateway, n: int) -> list[int]:
                got = await _collect(gw.stream(n))
                ended.append(n)
                return got

            async with Gateway(redis_url, "t-growing", GatewaySettings(timeout_s=20)) as gw:
                first = gw.stream(40)  # 40 steps of 20 ms: the batch runs ~0.8 s
                got = [await anext(first)]
                longs = [asyncio.ensure_future(one(gw, n)) for n in (30, 35)]
                shorts = [asyncio.ensure_future(one(gw, n)) for n in (2, 3, 4)]  # join while it runs
                rest = await asyncio.gather(_collect(first), *longs, *shorts)
                return [got + rest[0], *rest[1:]], ended

        streams, ended = asyncio.run(scenario())
    assert streams == [list(range(n, 0, -1)) for n in (40, 30, 35, 2, 3, 4)]
    assert set(ended[:3]) == {2, 3, 4}  # the short ones left the batch first
    assert _runs(runs).count("generator start") == 1  # every item joined the one running generator


@pytest.mark.parametrize("ender", ["boom", "end"])
def test_items_that_would_join_a_continuous_generator_that_ended_get_a_new_one(redis_url: str, tmp_path: Path,
                                                                                 ender: str) -> None:
    """A continuous generator that raised (or returned) takes no more items: those read after its end
    start a new one and stream whole. They used to be stepped on the ended generator, whose
    StopIteration ended them at once: an empty stream and "ok", with no error anywhere."""
    runs = tmp_path / "runs"
    with running_workers(redis_url, f"{APP}:fragile", ["Fragile"], STREAM_RUNS=str(runs)) as workers:
        workers.wait_ready("t-fragile")

        async def scenario() -> tuple[Any, list[list[Any]]]:
            async with Gateway(redis_url, "t-fragile", GatewaySettings(timeout_s=20)) as gw:
                doomed = asyncio.ensure_future(_collect(gw.stream(ender)))
                await asyncio.to_thread(wait_for, lambda: "ending" in _runs(runs), 10, "the generator's end")
                joiners = await asyncio.gather(*(_collect(gw.stream(n)) for n in (3, 4)))
                first = await asyncio.gather(doomed, return_exceptions=True)
                return first[0], joiners

        first, joiners = asyncio.run(scenario())
    assert joiners == [[3, 2, 1], [4, 3, 2, 1]]
    assert isinstance(first, StageError) if ender == "boom" else first == ["b"]
    assert _runs(runs).count("generator start") == 2


def test_a_traced_request_that_joins_a_continuous_batch_has_its_stage_spans(redis_url: str, tmp_path: Path) -> None:
    """Items that join a running continuous batch are measured as its first ones are: their wait and
    predict spans, the predict spans sharing the call's batch id (they had none: only the gateway's)."""
    import time

    from broker import tracing
    from gateway.client.trace_context import CURRENT, RequestTrace
    from tests.otlp_receiver import Receiver

    runs = tmp_path / "runs"
    with Receiver() as receiver, running_workers(
            redis_url, f"{APP}:growing", ["Growing"], STREAM_RUNS=str(runs), OTEL_BSP_SCHEDULE_DELAY="100",
            OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint) as workers:
        workers.wait_ready("t-growing")

        async def traced(gw: Gateway, n: int, trace_id: bytes) -> list[Any]:
            CURRENT.set(RequestTrace(trace_id, bytes(range(1, 9)), b"", True,
                                     tracing.traceparent(trace_id, bytes(range(1, 9))), time.time_ns()))
            return await _collect(gw.stream(n))

        async def scenario() -> list[list[Any]]:
            async with Gateway(redis_url, "t-growing", GatewaySettings(timeout_s=20)) as gw:
                async def first_one(n: int) -> list[Any]:  # 30 steps of 20 ms, traced when a trace id is given
                    if traced_first:
                        CURRENT.set(RequestTrace(b"\x0a" * 16, bytes(range(1, 9)), b"", True,
                                                 tracing.traceparent(b"\x0a" * 16, bytes(range(1, 9))), time.time_ns()))
                    chunks = gw.stream(n)
                    started.set()
                    return [await anext(chunks)] + await _collect(chunks)

                started = asyncio.Event()
                first = asyncio.ensure_future(first_one(30))
                await started.wait()
                await asyncio.to_thread(wait_for, lambda: "generator start" in _runs(runs), 10, "the first item's run")
                joiner = await traced(gw, 3, b"\x0b" * 16)
                return [await first, joiner]

        for traced_first in (False, True):  # its call's first item traced too: its spans and the joiner's
            runs.unlink(missing_ok=True)
            streams = asyncio.run(scenario())
            assert streams == [list(range(30, 0, -1)), [3, 2, 1]]
            assert _runs(runs).count("generator start") == 1  # it joined the running generator
            spans = receiver.wait(lambda spans: sum(s.trace_id == "0b" * 16 for s in spans) >= 2, 10,
                                  "the joiner's wait and predict spans")
            mine = {s.name: s for s in spans if s.trace_id == "0b" * 16}
            assert set(mine) == {"Growing wait", "Growing predict"}
            assert all(s.parent_id == "0102030405060708" for s in mine.values())
            assert mine["Growing wait"].end_ns <= mine["Growing predict"].start_ns + 1_000_000
            if traced_first:
                firsts = receiver.wait(lambda spans: sum(s.trace_id == "0a" * 16 for s in spans) >= 2, 10,
                                       "the first item's spans")
                predict = next(s for s in firsts if s.trace_id == "0a" * 16 and s.name == "Growing predict")
                batch_id = mine["Growing predict"].attributes["conveyor.batch.id"]
                assert predict.attributes["conveyor.batch.id"] == batch_id  # one call
            receiver.spans.clear()


def test_continuous_needs_a_streaming_batched_stage() -> None:
    class Plain(Stage):
        batch_size = 4

        def predict(self, xs: list[object]) -> list[object]:
            return xs

    with pytest.raises(PipelineError, match="continuous=True needs a streaming batched predict"):
        Pipeline("no").add(Plain, continuous=True)


def test_streams_and_cancels_on_a_redis_cluster(cluster_url: str, tmp_path: Path) -> None:
    """The chunks' pipeline, the markers' MGET and cancel.lua on a cluster client: every key of a request
    is in its partition's slot."""
    runs = tmp_path / "runs"
    text = " ".join(f"w{j}" for j in range(200))
    with running_workers(cluster_url, f"{APP}:slow_words", ["Words"], STREAM_RUNS=str(runs)) as workers:
        workers.wait_ready("t-slow-words")

        async def scenario() -> list[str]:
            async with Gateway(cluster_url, "t-slow-words", GatewaySettings(timeout_s=30)) as gw:
                got = await _collect(gw.stream("a b c"))
                async for chunk in gw.stream(text):
                    got.append(chunk)
                    break  # leaves: cancel.lua on the cluster, the worker's step reads the marker
                await asyncio.to_thread(wait_for, lambda: f"closed {text}" in _runs(runs), 5,
                                        "the stage's generator was closed")
                return got

        assert asyncio.run(scenario()) == ["a", "b", "c", "w0"]


def test_a_gateway_closes_while_its_cancels_are_on_their_way(redis_url: str) -> None:
    """A request cancelled just before its gateway closes: the cancel's script call is cut by the close
    (redis-py reports that as a connection error); the gateway still closes, at once, every time."""
    with running_workers(redis_url, f"{APP}:slow", ["Slow"]) as workers:
        workers.wait_ready("t-slow")

        async def cycle() -> None:
            async with Gateway(redis_url, "t-slow", GatewaySettings(timeout_s=30)) as gw:
                task = asyncio.ensure_future(gw.predict("left"))
                while not gw.hub.requests:
                    await asyncio.sleep(0)
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                await asyncio.sleep(0)  # the canceller's call under way as the gateway closes

        async def cycles() -> None:
            for _ in range(30):
                await asyncio.wait_for(cycle(), 5)

        asyncio.run(cycles())


def test_a_continuous_stage_told_to_stop_under_load_stops(redis_url: str) -> None:
    """A continuous stage (new items join the running batch between steps) under a steady load of short
    streams, its worker told to stop (SIGTERM, as a scale-down or any stop sends it). Its batch kept admitting
    joiners after the stop was asked, so under load it never ended: a scale-down never took effect (the
    supervisor counted one worker fewer, the process ran on), and a supervisor's stop SIGKILLed it after
    ``grace_s``, its streams run again. Once stopping, no item joins: the batch ends and the worker exits."""
    with running_workers(redis_url, f"{APP}:growing", [("Growing", 1)]) as workers:
        workers.wait_ready("t-growing")
        supervisor = workers.stage("Growing")

        async def scenario() -> bool:
            async with Gateway(redis_url, "t-growing", GatewaySettings(timeout_s=20)) as gw:
                end = asyncio.get_running_loop().time() + 7.0
                started = asyncio.Event()

                async def caller() -> None:
                    while asyncio.get_running_loop().time() < end:
                        assert [chunk async for chunk in gw.stream(5)] == [5, 4, 3, 2, 1]
                        started.set()

                load = asyncio.gather(*(caller() for _ in range(12)))  # more callers than its 8 slots
                await asyncio.wait_for(started.wait(), 30.0)
                (child,) = supervisor.children()
                child.terminate()
                gone = await asyncio.to_thread(lambda: psutil.wait_procs([child], timeout=4.0)[1] == [])
                await asyncio.wait_for(load, 30.0)  # every stream still answered, whole
                return gone

        assert asyncio.run(scenario()), "the worker still ran 4 s after its SIGTERM, under load"


def test_a_continuous_batch_fed_by_joiners_outlives_its_first_items_deadlines(redis_url: str) -> None:
    """A live batch under a steady load runs past the deadlines of the items it started with, serving those
    that joined since: it is not stuck while their deadlines are ahead. It used to be: the supervisor
    replaced its worker mid-stream (``stuck_grace_s`` after the first items' deadlines), cutting every
    stream it served."""
    with running_workers(redis_url, f"{APP}:watched_growing", ["Growing"]) as workers:
        workers.wait_ready("t-watched-growing")
        before = {c.pid for c in workers.procs[0].children()}

        async def scenario() -> list[Any]:
            async with Gateway(redis_url, "t-watched-growing", GatewaySettings(timeout_s=2)) as gw:
                async def relay(k: int) -> list[Any]:
                    """Stream k (25 steps of 20 ms); the next starts at its 10th chunk: one live batch ~5 s."""
                    got, after = [], None
                    async for chunk in gw.stream(25):
                        got.append(chunk)
                        if len(got) == 10 and k < 24:
                            after = asyncio.ensure_future(relay(k + 1))
                    rest = await after if after is not None else []
                    return [got, *rest]

                return list(await asyncio.gather(relay(0), return_exceptions=True))

        outcome = asyncio.run(scenario())[0]
        assert not isinstance(outcome, BaseException), repr(outcome)
        assert outcome == [list(range(25, 0, -1))] * 25
        assert {c.pid for c in workers.procs[0].children()} == before  # never replaced


def test_a_continuous_stage_runs_an_entry_delivered_again_alone(redis_url: str, redis_client: redis.Redis,
                                                                tmp_path: Path) -> None:
    """An entry whose worker died runs again alone (it may be what killed it): new items do not join its live
    batch, where they would die with it, their streams cut. They used to."""
    runs = tmp_path / "runs"
    with running_workers(redis_url, f"{APP}:doomed", ["Doomed"], STREAM_RUNS=str(runs)) as workers:
        workers.wait_ready("t-doomed")
        keys = Keys("t-doomed")  # the poison comes from a producer that reads nothing (no reply, no cancel)
        redis_client.xadd(keys.stream(0), {"id": "poison-1", "data": b"\xa6poison", "v": 1,
                                           "deadline_ms": protocol.now_ms() + 60_000})

        async def scenario() -> list[Any]:
            async with Gateway(redis_url, "t-doomed", GatewaySettings(timeout_s=30)) as gw:
                await asyncio.to_thread(wait_for, lambda: _runs(runs).count("poison run") == 2, 20,
                                        "the poison's run again")
                return list(await asyncio.gather(*(_collect(gw.stream(n)) for n in (40, 41, 42)),
                                                 return_exceptions=True))

        streams = asyncio.run(scenario())
        workers.wait_ready("t-doomed", 30)
    assert streams == [list(range(n, 0, -1)) for n in (40, 41, 42)]


def test_a_stream_past_its_deadline_ends_with_deadline_exceeded_for_a_foreign_reader(
        redis_url: str, redis_client: redis.Redis) -> None:
    """A producer of its own reads its reply list until the record without ``seq`` (docs/protocol.md): a stream
    whose deadline passes mid-way ends with a DeadlineExceeded record, also kept in its result key. It used to
    stop in silence, its reader blocked for ever and no result written."""
    text = " ".join(f"w{j}" for j in range(200))  # 200 words, 50 ms apart: 10 s, its deadline 0.5 s away
    with running_workers(redis_url, f"{APP}:slow_words", ["Words"]) as workers:
        workers.wait_ready("t-slow-words")
        keys = Keys("t-slow-words")
        reply = keys.reply("foreign")
        redis_client.xadd(keys.stream(0), {"id": "foreign-1", "data": codec.encode(text), "reply": reply, "v": 1,
                                           "deadline_ms": protocol.now_ms() + 500})
        chunks: list[Any] = []
        end: dict[str, Any] | None = None
        while end is None:
            popped = redis_client.blpop([reply], timeout=3)  # under the client's socket timeout
            assert popped is not None, f"no end record after {len(chunks)} chunks"
            for record in codec.decode(popped[1]):
                chunks += [record["chunk"]] if "seq" in record else []
                end = end if "seq" in record else record
        assert 0 < len(chunks) < 200 and chunks == [f"w{j}" for j in range(len(chunks))]
        assert end["ok"] is False and end["error"]["type"] == "DeadlineExceeded" and end["run"] == 1, end
        assert f"after {len(chunks)} chunks of the stream" in end["error"]["message"]
        wait_for(lambda: redis_client.get(keys.result_key(b"foreign-1")) is not None, 5, "the result key")
        assert codec.decode(redis_client.get(keys.result_key(b"foreign-1")))["error"]["type"] == "DeadlineExceeded"


def test_a_continuous_batch_acks_its_items_as_their_streams_end(redis_url: str, redis_client: redis.Redis,
                                                                tmp_path: Path) -> None:
    """12 callers, each streaming one short answer after another, keep one live batch of 8 slots going; with
    ``max_backlog=16`` none is refused. The batch's entries used to be acked only at its end: those whose
    streams had ended stayed in the stream, counted by the admission, and callers got Overloaded at once."""
    runs = tmp_path / "runs"
    with running_workers(redis_url, f"{APP}:bounded_growing", ["Growing"], STREAM_RUNS=str(runs)) as workers:
        workers.wait_ready("t-bounded-growing")

        async def caller(gw: Gateway, until: float) -> list[Any]:
            outcomes: list[Any] = []
            while asyncio.get_running_loop().time() < until:
                try:
                    outcomes.append(await _collect(gw.stream(4)))
                except Overloaded as exc:
                    outcomes.append(f"{exc} xlen={redis_client.xlen(Keys('t-bounded-growing').stream(0))}")
            return outcomes

        async def scenario() -> list[Any]:
            async with Gateway(redis_url, "t-bounded-growing", GatewaySettings(timeout_s=10)) as gw:
                until = asyncio.get_running_loop().time() + 3
                return [o for outcomes in await asyncio.gather(*(caller(gw, until) for _ in range(12)))
                        for o in outcomes]

        outcomes = asyncio.run(scenario())
    assert len(outcomes) > 24 and all(o == [4, 3, 2, 1] for o in outcomes), [o for o in outcomes if o != [4, 3, 2, 1]]
    assert redis_client.xlen(Keys("t-bounded-growing").stream(0)) == 0


def test_a_joiner_answered_at_admission_is_answered_and_acked_while_the_live_batch_runs(
        redis_url: str, redis_client: redis.Redis) -> None:
    """An entry read between a live batch's steps whose item is past its deadline is answered (and acked) at once,
    not when the batch ends: under a steady load a continuous batch may never end."""
    keys = Keys("t-growing")
    with running_workers(redis_url, f"{APP}:growing", ["Growing"]) as workers:
        workers.wait_ready("t-growing")

        async def scenario() -> tuple[list[Any], float]:
            async with Gateway(redis_url, "t-growing", GatewaySettings(timeout_s=20)) as gw:
                long = asyncio.ensure_future(_collect(gw.stream(150)))  # 150 steps of 20 ms: a live batch of 3 s
                first = gw.stream(3)
                assert await _collect(first) == [3, 2, 1]  # the batch runs
                reply = keys.reply("foreign")
                redis_client.xadd(keys.stream(0), {"id": "late-1", "data": codec.encode(5), "reply": reply, "v": 1,
                                                   "deadline_ms": protocol.now_ms() - 1})
                began = asyncio.get_running_loop().time()
                popped = await asyncio.to_thread(redis_client.blpop, [reply], 2)
                waited = asyncio.get_running_loop().time() - began
                assert not long.done(), "the live batch ended before the late entry was answered"
                assert popped is not None, "no answer for the late entry while the live batch ran"
                return [*codec.decode(popped[1]), await long], waited

        (record, chunks), waited = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert record["ok"] is False and record["error"]["type"] == "DeadlineExceeded", record
    assert chunks == list(range(150, 0, -1)) and waited < 2
    assert redis_client.xpending(keys.stream(0), "workers")["pending"] == 0


def test_an_item_of_a_live_batchs_first_read_answered_at_admission_is_answered_while_the_batch_runs(
        redis_url: str, redis_client: redis.Redis) -> None:
    """The first read of a continuous batch: an entry past its deadline read with one that runs long is answered
    and acked at once, as a joiner is, not when the batch ends (under a steady load it may never end)."""
    keys = Keys("t-growing")
    with running_workers(redis_url, f"{APP}:growing", ["Growing"]) as workers:
        workers.wait_ready("t-growing")
        long_reply, late_reply = keys.reply("foreign-long"), keys.reply("foreign-late")
        now = protocol.now_ms()
        with redis_client.pipeline(transaction=True) as both:  # in one read: the worker waits on the stream
            both.xadd(keys.stream(0), {"id": "long-1", "data": codec.encode(150), "reply": long_reply, "v": 1,
                                       "deadline_ms": now + 20_000})  # 150 steps of 20 ms: a live batch of 3 s
            both.xadd(keys.stream(0), {"id": "late-2", "data": codec.encode(5), "reply": late_reply, "v": 1,
                                       "deadline_ms": now - 1})
            both.execute()
        popped = redis_client.blpop([late_reply], 2)
        assert popped is not None, "no answer for the late entry while the live batch ran"
        assert not redis_client.exists(keys.result_key(b"long-1")), "the live batch ended first"
        (record,) = codec.decode(popped[1])
        assert record["ok"] is False and record["error"]["type"] == "DeadlineExceeded", record
        wait_for(lambda: redis_client.exists(keys.result_key(b"long-1")), 10, "the long stream's end")
    assert redis_client.xpending(keys.stream(0), "workers")["pending"] == 0
