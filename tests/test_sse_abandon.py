"""A client that leaves a stream between its submission and the hand-over of its sink (pure logic)."""

from __future__ import annotations

import asyncio

import pytest

from gateway.client.streams import StreamSink
from gateway.http.sse import StreamReply
from gateway.http.types import Request

pytestmark = pytest.mark.unit


def _reply(opening: asyncio.Future[StreamSink], cancelled: list[StreamSink]) -> StreamReply:
    request = Request(b"POST", b"/v1/stream", {})
    request.request_id = b"r1"
    return StreamReply(opening, request, None, cancelled.append)  # type: ignore[arg-type]


def test_a_client_gone_before_its_submitted_sink_is_handed_over_cancels_the_request() -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        opening: asyncio.Future[StreamSink] = loop.create_future()
        cancelled: list[StreamSink] = []
        reply = _reply(opening, cancelled)
        reply.attach(b"", lambda data: None, lambda reply, outcome: None)
        sink = StreamSink(loop, 4)
        opening.set_result(sink)  # submitted: the hand-over (a done-callback) runs in a later step
        reply.abandon()  # the client's disconnect, in this step
        await asyncio.sleep(0)
        assert cancelled == [sink]

    asyncio.run(scenario())


def test_a_client_gone_before_the_submission_cancels_the_opening() -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        opening: asyncio.Future[StreamSink] = loop.create_future()
        cancelled: list[StreamSink] = []
        reply = _reply(opening, cancelled)
        reply.attach(b"", lambda data: None, lambda reply, outcome: None)
        reply.abandon()
        await asyncio.sleep(0)
        assert opening.cancelled() and cancelled == []

    asyncio.run(scenario())
