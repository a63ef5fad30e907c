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

