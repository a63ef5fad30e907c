"""broker.held.AsyncHeldConnection against a real Redis: its calls go straight onto the connection,
bounded by the socket timeout through one watchdog timer per connection (not a timer per call)."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis
import redis.asyncio as aredis

from broker.held import AsyncHeldConnection
from broker.resp import pack_command

TIMEOUT_S = 0.8


def _client(url: str) -> aredis.Redis:
    return aredis.Redis.from_url(url, socket_timeout=TIMEOUT_S)


async def _a_call_past_the_timeout_fails_and_the_next_reconnects(url: str) -> None:
    client = _client(url)
    held = AsyncHeldConnection(client)
    try:
        assert await held.call(pack_command([b"SET", b"k", b"v"])) == b"OK"
        with pytest.raises(redis.TimeoutError, match="socket_timeout"):  # the server would answer nil at 3 s
            await held.call(pack_command([b"BLPOP", b"nothing", b"3"]))
        assert not held._conn  # dropped: its state is unknown
        assert await held.call(pack_command([b"GET", b"k"])) == b"v"  # a new connection
    finally:
        await held.close()
        await client.aclose()


async def _calls_within_the_timeout_never_trip_it(url: str) -> None:
    """Calls of 0.1-0.2 s each (Redis ends a BLOCK at its next tick), back to back for two and a
    half timeouts' worth: a timer armed by the first call must re-arm for the call under way."""
    client = _client(url)
    held = AsyncHeldConnection(client)
    try:
        deadline = time.monotonic() + 2.5 * TIMEOUT_S
        calls = 0
        while time.monotonic() < deadline:
            assert await held.call(pack_command([b"BLPOP", b"nothing", b"0.1"])) is None
            calls += 1
        assert calls >= 5
    finally:
        await held.close()
        await client.aclose()


async def _error_replies_in_a_turn(url: str) -> None:
    client = _client(url)
    held = AsyncHeldConnection(client, keep=lambda exc: "WRONGTYPE" in str(exc))
    try:
        await held.call(pack_command([b"SET", b"s", b"x"]))
        replies = await held.call_many([pack_command([b"LPUSH", b"s", b"1"]), pack_command([b"GET", b"s"])])
        assert isinstance(replies[0], redis.ResponseError) and replies[1] == b"x"
        assert held._conn is not None  # a kept error reply leaves the connection in use
        with pytest.raises(redis.ResponseError, match="unknown command"):
            await held.call(pack_command([b"NOSUCHCOMMAND"]))
        assert held._conn is None  # any other drops it
        assert await held.call(pack_command([b"GET", b"s"])) == b"x"
    finally:
        await held.close()
        await client.aclose()


async def _the_timeout_leaves_the_task_uncancelled(url: str) -> None:
    """The watchdog cancels the call it bounds and takes that cancellation back: the caller's task
    goes on as if the call had raised, its own timeouts still work."""
    client = _client(url)
    held = AsyncHeldConnection(client)
    try:
        with pytest.raises(redis.TimeoutError):
            await held.call(pack_command([b"BLPOP", b"nothing", b"3"]))
        task = asyncio.current_task()
        assert task is not None and task.cancelling() == 0
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.05):
                await asyncio.sleep(1)
        assert await held.call(pack_command([b"PING"])) == b"PONG"
    finally:
        await held.close()
        await client.aclose()


async def _a_cancellation_from_outside_stays_one(url: str) -> None:
    """A caller cancelled mid-call (a gateway closing) sees CancelledError, not TimeoutError, even
    when the watchdog fires at the same time; the connection is dropped."""
    client = _client(url)
    held = AsyncHeldConnection(client)
    try:
        for delay_s in (0.1, TIMEOUT_S):  # before the watchdog, and about when it fires
            call = asyncio.ensure_future(held.call(pack_command([b"BLPOP", b"nothing", b"3"])))
            await asyncio.sleep(delay_s)
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
            assert held._conn is None
    finally:
        await held.close()
        await client.aclose()


@pytest.mark.parametrize("case", [_a_call_past_the_timeout_fails_and_the_next_reconnects,
                                  _calls_within_the_timeout_never_trip_it, _error_replies_in_a_turn,
                                  _the_timeout_leaves_the_task_uncancelled, _a_cancellation_from_outside_stays_one])
def test_async_held_connection(case, redis_url: str) -> None:  # type: ignore[no-untyped-def]
    asyncio.run(asyncio.wait_for(case(redis_url), 20))
