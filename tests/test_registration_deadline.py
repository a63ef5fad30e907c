"""A request that waits for its pipeline's registration spends its own deadline waiting: what its stream
entry carries counts from its arrival, over one partition or spread round robin over several."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis

from broker.keys import Keys
from broker.spec import StageInfo, encode_spec
from gateway import Gateway, GatewaySettings

pytestmark = pytest.mark.redis

T = 30.0
TIMEOUT_S = 20.0
WAITED_S = 1.0  # how long the request waits for the registration


@pytest.mark.parametrize("partitions, key", [(2, None), (2, "k"), (1, None)])
def test_a_request_waiting_for_registration_keeps_its_deadline(redis_url: str, partitions: int,
                                                              key: str | None) -> None:
    """Spread round robin over partitions (no key), a request's wait for the registration was not taken
    from its timeout: it was submitted with the whole timeout again, so it ran (or timed out) that much later."""
    name = f"reg-deadline-{partitions}-{key}"
    keys = Keys(name)

    async def main() -> tuple[float, int]:
        async with Gateway(redis_url, name, partitions=partitions) as gw:
            arrived_ms = time.time() * 1000
            pending = asyncio.ensure_future(gw.predict(1, timeout_s=TIMEOUT_S, key=key))
            await asyncio.sleep(WAITED_S)  # time passes before any worker registers the pipeline
            client = redis.Redis.from_url(redis_url)
            try:
                client.set(keys.spec, encode_spec([StageInfo(0, "Scale", partitions=partitions)]))
                client.sadd(keys.registry, name)
                streams = [k.stream(0) for k in keys.partitions(partitions)]
                for _ in range(int(T * 100)):  # the request is submitted once the registration is seen
                    entries = [e for s in streams for e in client.xrange(s) or []]
                    if entries:
                        break
                    await asyncio.sleep(0.01)
            finally:
                client.close()
            pending.cancel()
            assert len(entries) == 1, entries
            fields = entries[0][1] or {}
            return arrived_ms, int(fields[b"deadline_ms"])

    arrived_ms, deadline_ms = asyncio.run(main())
    assert deadline_ms - arrived_ms <= (TIMEOUT_S + WAITED_S / 2) * 1000, \
        f"deadline {deadline_ms - arrived_ms:.0f} ms after arrival, for a timeout of {TIMEOUT_S:g} s"


def test_close_fails_requests_waiting_for_registration_with_a_connection_error(redis_url: str) -> None:
    """Closing the gateway while requests wait for their pipeline's registration fails them with the
    ConnectionError of any request in flight at a close, at once: not a CancelledError in tasks nobody
    cancelled (a TaskGroup would take it for its own cancellation). A caller that cancels its own wait
    still gets its CancelledError."""

    async def main() -> tuple[bool, list[BaseException | None]]:
        settings = GatewaySettings(register_wait_s=TIMEOUT_S)
        async with Gateway(redis_url, "reg-closed", settings) as gw:
            waiting = [asyncio.ensure_future(gw.predict(1, timeout_s=TIMEOUT_S)),
                       asyncio.ensure_future(gw.predict(2, timeout_s=TIMEOUT_S, key="k")),
                       asyncio.ensure_future(gw.stream(3, timeout_s=TIMEOUT_S).__anext__())]
            left = asyncio.ensure_future(gw.predict(4, timeout_s=TIMEOUT_S))
            for _ in range(1000):  # every request waits on the registration's poll (started by the first)
                if gw.registration.polls():
                    break
                await asyncio.sleep(0.005)
            assert gw.registration.polls(), "no request waits on the registration"
            await asyncio.sleep(0)  # the others, started in the same turn, reach it too
            left.cancel()
            await asyncio.wait([left], timeout=T)
        done, _ = await asyncio.wait(waiting, timeout=T)
        assert len(done) == len(waiting), "a request still waits after the gateway closed"
        return left.cancelled(), [None if task.cancelled() else task.exception() for task in waiting]

    left_cancelled, outcomes = asyncio.run(main())
    assert left_cancelled, "the caller that cancelled its own request did not get its CancelledError"
    for outcome in outcomes:
        assert isinstance(outcome, ConnectionError) and "gateway closed" in str(outcome), outcomes
