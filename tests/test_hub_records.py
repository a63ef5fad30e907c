"""The hub's table of requests in flight: a record failed or answered is that record, not its id (pure logic)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from broker import codec
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
