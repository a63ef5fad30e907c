"""A caller's own request id through the Python API, against the ids the gateway makes itself."""

from __future__ import annotations

import asyncio

import pytest

from gateway import Gateway
from tests.helpers import running_workers

pytestmark = pytest.mark.system  # worker processes (tests/conftest.py: tiers)

T = 30.0


def test_a_callers_id_in_the_gateways_own_form_is_never_made_again(redis_url: str) -> None:
    """The next id a lane would make, given first by a caller: the lane made it again for the next request,
    whose record replaced the caller's. The second caller got the first one's answer, and the first never
    resolved (its timer lost with its record)."""
    async def main() -> tuple[int, int]:
        async with Gateway(redis_url, "t-sleepy") as gw:
            await gw.predict(0, timeout_s=T)  # registered, its lane made
            lane = gw.lanes[0]
            taken = lane.id_prefix + b"%d" % (lane.counter + 1)
            first = asyncio.ensure_future(gw.predict(10, request_id=taken, timeout_s=T))
            for _ in range(int(T * 1000)):  # queued (after its id's check in Redis), within T
                if taken in gw.hub.requests or first.done():
                    break
                await asyncio.sleep(0.001)
            second = asyncio.ensure_future(gw.predict(20, timeout_s=T))
            return await asyncio.wait_for(first, T), await asyncio.wait_for(second, T)

    with running_workers(redis_url, "tests.stages:sleepy", [("Sleepy", 1)]):
        assert asyncio.run(main()) == (11, 21)
