"""A Gateway's calls that ask Redis before submitting: from another event loop than the gateway's, or with
the caller's own request id, what is wrong is said at once, before Redis is asked; and a gateway started again
on another loop after a close serves there in full."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from gateway import CodecError, Gateway, GatewaySettings, PayloadTooLarge
from workers.embedded.server import EmbeddedRedis

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


def test_a_request_with_its_own_id_is_refused_for_what_is_wrong_before_redis_is_asked(
        private_redis: EmbeddedRedis) -> None:
    """A bad timeout, an input that cannot travel or is too large, under the caller's own id: refused at once,
    not after the round trip that checks the id is unused (the socket timeout with a Redis that does not
    answer), nor as that check's TimeoutError."""
    big = b"x" * (GatewaySettings().max_payload_bytes + 1)

    async def main() -> list[tuple[type[BaseException], float]]:
        async with Gateway(private_redis.url, "t-own-ids", GatewaySettings(timeout_s=T)) as gw:
            calls = [gw.predict(1, timeout_s=0, request_id="own-1"),
                     gw.predict(1, timeout_s=float("nan"), request_id="own-2"),
                     gw.predict({1, 2}, timeout_s=2, request_id="own-3"),
                     anext(gw.stream(big, timeout_s=2, request_id="own-4"))]
            pid = private_redis.pid
            assert pid is not None
            os.kill(pid, signal.SIGSTOP)  # Redis answers nothing meanwhile
            try:
                outcomes = []
                for call in calls:
                    started = time.monotonic()
                    try:
                        await asyncio.wait_for(call, 3 * T)
                    except (ValueError, CodecError, PayloadTooLarge, TimeoutError) as exc:
                        outcomes.append((type(exc), time.monotonic() - started))
                return outcomes
            finally:
                os.kill(pid, signal.SIGCONT)

    outcomes = asyncio.run(main())
    assert [kind for kind, _ in outcomes] == [ValueError, ValueError, CodecError, PayloadTooLarge], outcomes
    assert max(took for _, took in outcomes) < 1.0, outcomes
