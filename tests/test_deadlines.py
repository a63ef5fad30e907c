"""gateway.client.deadlines: one timer for every request's deadline (no timing asserted, only order and bounds)."""

from __future__ import annotations

import asyncio
import weakref

from gateway.client.deadlines import Deadlines


class Record:
    """A request in flight, as the hub's table holds it (its deadline's serial)."""

    def __init__(self, timeout_s: float = 0.0) -> None:
        self.timeout_s = timeout_s
        self.serial = 0


def _add(deadlines: Deadlines, live: dict[bytes, Record], loop: asyncio.AbstractEventLoop, request_id: bytes,
         when: float, timeout_s: float = 0.0) -> Record:
    live[request_id] = record = Record(timeout_s)
    record.serial = deadlines.add(loop, request_id, when)
    return record


async def _expire_in_order() -> None:
    live: dict[bytes, Record] = {}
    expired: list[tuple[bytes, float]] = []
    done = asyncio.Event()

    def expire(request_id: bytes) -> None:
        expired.append((request_id, live.pop(request_id).timeout_s))
        if not live:
            done.set()

    deadlines = Deadlines(live, expire)
    loop = asyncio.get_running_loop()
    for request_id, timeout_s in ((b"late", 0.05), (b"answered", 0.01), (b"early", 0.02)):
        _add(deadlines, live, loop, request_id, loop.time() + timeout_s, timeout_s)  # "early" after "late": re-armed
    del live[b"answered"]
    await asyncio.wait_for(done.wait(), 5)
    assert expired == [(b"early", 0.02), (b"late", 0.05)]
    assert len(deadlines) == 0
    deadlines.close()


async def _no_pile_up() -> None:
    live: dict[bytes, Record] = {}
    deadlines = Deadlines(live, lambda request_id: None)
    loop = asyncio.get_running_loop()
    for n in range(20_000):
        _add(deadlines, live, loop, b"%d" % n, loop.time() + 30.0)
        if n >= 10:  # ten in flight, the rest answered
            del live[b"%d" % (n - 10)]
    assert len(deadlines) <= 2 * len(live) + 1024 + 1
    deadlines.close()
    assert len(deadlines) == 0


def test_only_live_requests_expire_in_deadline_order() -> None:
    asyncio.run(_expire_in_order())


def test_answered_requests_do_not_pile_up() -> None:
    asyncio.run(_no_pile_up())


async def _added_while_firing() -> tuple[float, float]:
    """The HTTP front submits a connection's next pipelined request from the call that expires its current
    one; that ``add`` may compact the heap while ``_fire`` walks it. A new list left ``_fire`` re-arming
    from the old heap: a 50 ms deadline fired with the next one, at 1 s."""
    loop = asyncio.get_running_loop()
    live: dict[bytes, Record] = {}
    fired: dict[bytes, float] = {}
    done = asyncio.Event()
    after = {b"c1": (b"x1", 1.0), b"c2": (b"x2", 0.05)}  # each connection's next request, its timeout

    def expire(request_id: bytes) -> None:
        live.pop(request_id, None)
        fired[request_id] = loop.time()
        if request_id in after:
            new, timeout_s = after[request_id]
            _add(deadlines, live, loop, new, loop.time() + timeout_s)
        if request_id == b"x2":
            done.set()

    deadlines = Deadlines(live, expire)
    start = loop.time()
    for request_id in (b"c1", b"c2"):
        _add(deadlines, live, loop, request_id, start + 0.01)
    old = [b"old-%d" % n for n in range(1_100)]
    for request_id in old:
        _add(deadlines, live, loop, request_id, start + 5.0)
    for request_id in old:  # answered since: stale entries, so the next add compacts
        del live[request_id]
    await asyncio.wait_for(done.wait(), 5)
    deadlines.close()
    return fired[b"x2"], fired[b"c1"] + 1.0


def test_a_deadline_added_while_another_expires_is_kept() -> None:
    x2_fired, x1_due = asyncio.run(_added_while_firing())
    assert x2_fired < x1_due


async def _id_used_again() -> list[bytes]:
    loop = asyncio.get_running_loop()
    live: dict[bytes, Record] = {}
    expired: list[bytes] = []
    done = asyncio.Event()

    def expire(request_id: bytes) -> None:
        expired.append(request_id)
        del live[request_id]
        if request_id == b"later":
            done.set()

    deadlines = Deadlines(live, expire)
    _add(deadlines, live, loop, b"mine", loop.time() + 0.02)
    del live[b"mine"]  # answered; the caller uses its id again, with a longer timeout
    _add(deadlines, live, loop, b"mine", loop.time() + 30.0)
    _add(deadlines, live, loop, b"later", loop.time() + 0.1)
    await asyncio.wait_for(done.wait(), 5)
    deadlines.close()
    return expired


def test_an_id_used_again_is_expired_at_its_own_deadline_not_the_first_ones() -> None:
    """The first request's entry expired the second one, 2.95 s into its 30 s."""
    assert asyncio.run(_id_used_again()) == [b"later"]


def test_answered_requests_are_not_kept_alive_by_their_deadlines() -> None:
    """The heap held each request's record: an answered request's input and result stayed in memory
    until its deadline (3,000 answers of 256 KB, 10 in flight: 232 MiB held)."""
    async def run() -> int:
        live: dict[bytes, Record] = {}
        deadlines = Deadlines(live, lambda request_id: None)
        loop = asyncio.get_running_loop()
        gone = []
        for n in range(50):
            record = _add(deadlines, live, loop, b"%d" % n, loop.time() + 30.0)
            gone.append(weakref.ref(record))
            del live[b"%d" % n], record  # answered
        held = sum(ref() is not None for ref in gone)  # the heap still has their 50 entries
        deadlines.close()
        return held

    assert asyncio.run(run()) == 0


def test_a_deadline_added_as_the_heap_is_compacted_is_kept() -> None:
    """The record carries its serial only once ``add`` returns: a compaction inside that ``add`` dropped the
    entry just pushed, and one request in about every (in flight + 1024) never timed out."""
    async def scenario() -> None:
        live: dict[bytes, Record] = {}
        deadlines = Deadlines(live, lambda request_id: None)
        loop = asyncio.get_running_loop()
        for n in range(3_000):
            request_id = b"%d" % n
            _add(deadlines, live, loop, request_id, loop.time() + 30.0)
            assert any(entry[2] == request_id for entry in deadlines._heap), f"request {n}'s deadline was dropped"
            del live[request_id]  # answered
        deadlines.close()

    asyncio.run(scenario())
