"""The hub's table of requests in flight: a record failed or answered is that record, not its id (pure logic)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from broker import codec, protocol
from broker.keys import Keys
from broker.submit import Submitter
from gateway.client.hub import Hub
from gateway.client.lane import InFlight, Lane
from gateway.client.slot import Answer, new_answer
from gateway.client.streams import StreamSink

pytestmark = pytest.mark.unit


def test_a_refused_turn_fails_its_own_records_not_a_later_request_under_the_same_id() -> None:
    """A request cancelled while its turn was on its way, its id then given to a new request (the caller's own
    id again): the old turn's refusal popped the table's record by id and failed the new request with it."""
    async def main() -> None:
        loop = asyncio.get_running_loop()
        hub = Hub("redis://127.0.0.1:1/0")
        old = InFlight(loop.create_future(), None, (b"mine", b"d", b"1", b""), 0.0, 1.0)  # type: ignore[arg-type]
        new = InFlight(loop.create_future(), None, (b"mine", b"d", b"1", b""), 0.0, 1.0)  # type: ignore[arg-type]
        hub.requests[b"mine"] = new  # the old one was cancelled (left the table), its id taken again
        hub._fail([old], lambda: RuntimeError("refused"))
        assert hub.requests.get(b"mine") is new and not new.waiter.done()
        hub._fail([new], lambda: RuntimeError("refused"))
        assert b"mine" not in hub.requests and isinstance(new.waiter.exception(), RuntimeError)

    asyncio.run(main())


def _boom() -> None:
    raise RuntimeError("a bug in the stream's consumer")


def _in_flight(hub: Hub, lane: Lane, waiter: Answer | StreamSink, request_id: bytes, timeout_s: float) -> None:
    """``waiter``'s request held by the hub (never sent: no Redis), its deadline ``timeout_s`` from now."""
    loop = hub.loop
    waiter.request_id = request_id
    record = hub.requests[request_id] = InFlight(waiter, lane, (request_id, b"d", b"1", b""), loop.time(), timeout_s)
    record.serial = hub.deadlines.add(loop, request_id, loop.time() + timeout_s)


def test_a_stream_listener_that_raises_breaks_neither_the_deadline_timer_nor_the_other_answers() -> None:
    """A stream's listener (the HTTP front's SSE writer) that raised went up into whoever woke its sink: the
    deadline timer, whose walk stopped there unarmed (the requests behind never timed out: their HTTP clients
    hung), and the reply reader's delivery of an element, whose other answers were dropped (their callers
    waited out their timeouts). As a Slot's done-callback, the error goes to the loop's exception handler."""
    async def main() -> None:
        loop = asyncio.get_running_loop()
        reported: list[dict[str, Any]] = []
        loop.set_exception_handler(lambda _loop, context: reported.append(context))
        hub = Hub("redis://127.0.0.1:1/0")
        hub.loop = loop
        keys = Keys("t")
        lane = Lane(keys, Submitter(keys, b"reply"), b"reply", b"g-0-", asyncio.Event(), lambda: 1)

        expiring, behind = StreamSink(loop, 4), new_answer(loop, hub.cancel)
        expiring.listen(_boom)
        _in_flight(hub, lane, expiring, b"expiring", 0.01)
        _in_flight(hub, lane, behind, b"behind", 0.02)
        done, _ = await asyncio.wait([behind], timeout=5)
        assert done, "the request behind a stream whose listener raised as it expired never timed out"
        assert isinstance(behind.exception(), TimeoutError)

        streaming, answered = StreamSink(loop, 4), new_answer(loop, hub.cancel)
        streaming.listen(_boom)
        _in_flight(hub, lane, streaming, b"streaming", 30)
        _in_flight(hub, lane, answered, b"answered", 30)
        hub._deliver(codec.encode([{"id": "streaming", "seq": 0, "chunk": "a", "run": 1},
                                   {"id": "answered", "ok": True, "value": 7}]))  # one element: a batch's records
        assert answered.done() and answered.result() == 7
        assert streaming.take() == ["a"]
        assert [type(context.get("exception")) for context in reported] == [RuntimeError, RuntimeError]
        hub.deadlines.close()

    asyncio.run(main())


def _records(run: int, raised: BaseException) -> list[dict[str, Any]]:
    """What a streaming stage's run ``run`` pushes when its generator raises: the records of its step (made
    without Redis: the runner's client connects at its first step)."""
    import redis

    from workers.loop.problems import Problems
    from workers.loop.streaming import StreamRunner, _ItemChunks, _Step
    from workers.pipeline import Pipeline
    from workers.stage import Stage

    class Words(Stage):
        def predict(self, x: str) -> Any:
            yield from x.split()

    spec = Pipeline("t-runs").add(Words).stages[0]
    runner = StreamRunner(Words(), spec, redis.Redis(port=1), 60_000, 1 << 20, Problems("Words", "t-runs:counts"), None)
    try:
        stream, step = _ItemChunks(protocol.Item(b"1-0", b"r1", b"", b"reply", None), run), _Step()
        runner._fail(stream, step, raised)
        return [codec.decode(record) for record in step.pushes[b"reply"]]
    finally:
        runner.close()


def test_an_earlier_runs_error_is_a_straggler_and_a_later_runs_ends_the_stream() -> None:
    """A worker taken for dead (frozen past claim_idle_s, its lease lapsed) that goes on and fails ended the
    healthy stream of the run that took its entry over: its error record said no run. A later run's error
    (the run again failed) ends the stream, its chunks given or not."""

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        sink = StreamSink(loop, 16)
        sink.chunk({"id": "r1", "seq": 0, "chunk": "a", "run": 1, "resume": True})
        sink.chunk({"id": "r1", "seq": 0, "chunk": "a", "run": 2, "resume": True})  # run 2 took it over
        sink.chunk({"id": "r1", "seq": 1, "chunk": "b", "run": 2, "resume": True})
        (stale,) = _records(1, TimeoutError("the API timed out while the worker was frozen"))
        assert sink.finish(stale) and not sink.done()  # the zombie's: dropped
        assert not sink.finish({"id": "r1", "ok": True, "value": None, "chunks": 2, "run": 2})
        assert sink.take() == ["a", "b"]

        later = StreamSink(loop, 16)
        later.chunk({"id": "r1", "seq": 0, "chunk": "a", "run": 1})
        (failed,) = _records(2, RuntimeError("boom on the run again"))
        assert not later.finish(failed)  # its end: the hub sets the stage's error
        assert failed["error"]["message"] == "boom on the run again"
        assert not later.finish({"id": "r1", "ok": False, "error": {"type": "DeadLettered"}})  # no run: the end

    asyncio.run(scenario())
