"""A Gateway and event loops: started again on another loop after a close, it serves there in full; used
from another loop while started on one, every call says so at once, before anything reaches Redis."""

from __future__ import annotations

import asyncio

import pytest

from gateway import Gateway, GatewaySettings

pytestmark = pytest.mark.redis

T = 5.0


def test_a_gateway_closed_then_started_on_another_loop_keeps_its_views_refreshing(redis_url: str) -> None:
    """Two ``asyncio.run`` calls, each ``async with`` the same gateway: the second one's views must refresh
    (registration, spec, sizing and status come from them), not die on an event bound to the first loop."""
    gw = Gateway(redis_url, "t-loops-again", GatewaySettings(timeout_s=T))

    async def run() -> tuple[bool, bool]:
        async with gw:
            registered = await asyncio.wait_for(gw.pipeline_registered(), T)  # a refresh of the views, awaited
            await asyncio.wait_for(gw.views.refreshed(gw.views.views[0]), T)
            return registered, gw.views.healthy

    assert asyncio.run(run()) == (False, True)
    assert asyncio.run(run()) == (False, True), "the views died on the second loop"


def test_a_gateway_whose_loop_ended_says_so_for_request_ids_and_close(redis_url: str) -> None:
    """A request with the caller's own id (checked in Redis first) and ``close()`` from another loop than
    the gateway's: the error names the cause, not asyncio's "Event loop is closed"; and a close refused
    there leaves the gateway as it was (a start then is refused too, not half done)."""
    gw = Gateway(redis_url, "t-loops-ended", GatewaySettings(timeout_s=T))
    asyncio.run(gw.start())  # never closed on its loop

    async def elsewhere() -> None:
        calls = (gw.predict(1, request_id="mine-1"), anext(gw.stream(1, request_id="mine-2")), gw.close())
        for call in calls:
            with pytest.raises(RuntimeError, match="started on another event loop"):
                await asyncio.wait_for(call, T)
        with pytest.raises(RuntimeError, match="already started"):
            await asyncio.wait_for(gw.start(), T)
        assert gw.in_flight == 0

    asyncio.run(elsewhere())
