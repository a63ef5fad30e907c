"""A client that leaves a stream between its submission and the hand-over of its sink (pure logic)."""

from __future__ import annotations

import asyncio

import pytest

from gateway.client.streams import StreamSink
from gateway.http.sse import StreamReply
from gateway.http.types import Request

pytestmark = pytest.mark.unit


def _attached(loop: asyncio.AbstractEventLoop) -> tuple[asyncio.Future[StreamSink], StreamReply, list[StreamSink]]:
    """A stream's reply, its opening (the submission) not done yet, attached to a connection; the sinks it cancels."""
    opening: asyncio.Future[StreamSink] = loop.create_future()
    cancelled: list[StreamSink] = []
    request = Request(b"POST", b"/v1/stream", {})
    request.request_id = b"r1"
    reply = StreamReply(opening, request, None, cancelled.append)  # type: ignore[arg-type]
    reply.attach(b"", lambda data: None, lambda reply, outcome: None)
    return opening, reply, cancelled


def test_a_client_gone_before_its_submitted_sink_is_handed_over_cancels_the_request() -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        opening, reply, cancelled = _attached(loop)
        sink = StreamSink(loop, 4)
        opening.set_result(sink)  # submitted: the hand-over (a done-callback) runs in a later step
        reply.abandon()  # the client's disconnect, in this step
        await asyncio.sleep(0)
        assert cancelled == [sink]

    asyncio.run(scenario())


def test_a_client_gone_before_the_submission_cancels_the_opening() -> None:
    async def scenario() -> None:
        opening, reply, cancelled = _attached(asyncio.get_running_loop())
        reply.abandon()
        await asyncio.sleep(0)
        assert opening.cancelled() and cancelled == []

    asyncio.run(scenario())
