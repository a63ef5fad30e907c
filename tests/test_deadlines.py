"""gateway.client.deadlines: one timer for every request's deadline (no timing asserted, only order and bounds)."""

from __future__ import annotations

import asyncio

from gateway.client.deadlines import Deadlines


async def _expire_in_order() -> None:
    live: dict[bytes, float] = {}
    expired: list[tuple[bytes, float]] = []
    done = asyncio.Event()

    def expire(request_id: bytes) -> None:
        expired.append((request_id, live.pop(request_id)))
        if not live:
            done.set()

    deadlines = Deadlines(live, expire)
    loop = asyncio.get_running_loop()
    for request_id, timeout_s in ((b"late", 0.05), (b"answered", 0.01), (b"early", 0.02)):
        live[request_id] = timeout_s
        deadlines.add(loop, request_id, loop.time() + timeout_s)  # "early" comes after "late": the timer is re-armed
    del live[b"answered"]
    await asyncio.wait_for(done.wait(), 5)
    assert expired == [(b"early", 0.02), (b"late", 0.05)]
    assert len(deadlines) == 0
    deadlines.close()


async def _no_pile_up() -> None:
    live: dict[bytes, None] = {}
    deadlines = Deadlines(live, lambda request_id: None)
    loop = asyncio.get_running_loop()
    for n in range(20_000):
        request_id = b"%d" % n
        live[request_id] = None
        deadlines.add(loop, request_id, loop.time() + 30.0)
        if n >= 10:  # ten in flight, the rest answered
            del live[b"%d" % (n - 10)]
    assert len(deadlines) <= 2 * len(live) + 1024 + 1
    deadlines.close()
    assert len(deadlines) == 0


def test_only_live_requests_expire_in_deadline_order() -> None:
    asyncio.run(_expire_in_order())


def test_answered_requests_do_not_pile_up() -> None:
    asyncio.run(_no_pile_up())
