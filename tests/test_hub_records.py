"""The hub's table of requests in flight: a record failed or answered is that record, not its id (pure logic)."""

from __future__ import annotations

import asyncio

import pytest

from gateway.client.hub import Hub
from gateway.client.lane import InFlight

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
