"""The TTL limits ``conveyor worker``/``run`` hold their options to (broker/numbers.py) are Redis's own, against a
real server: the largest taken works where the workers use it, and past it Redis refuses (a worker would crash at
every commit, or at every pin claim, in a loop)."""

from __future__ import annotations

import time

import pytest
import redis

from broker.keys import Keys
from broker.numbers import MAX_EXPIRE_MS, MAX_PIN_TTL_MS
from broker.pins import PinClaims, PinRequest

pytestmark = pytest.mark.redis

# What commit.lua does with the result TTL: the argument as sent, to SET ... PX inside a script.
SET_PX = "return redis.call('SET', KEYS[1], 'x', 'PX', ARGV[1])"


def test_the_largest_result_and_reply_ttl_is_taken_and_past_redis_s_limit_refused(redis_client: redis.Redis) -> None:
    assert redis_client.eval(SET_PX, 1, "t-result", MAX_EXPIRE_MS) == b"OK"
    redis_client.rpush("t-reply", b"x")
    assert redis_client.pexpire("t-reply", MAX_EXPIRE_MS)
    beyond = 2**63 - 1 - int(time.time() * 1000) + 60_000  # the clock plus this passes 2**63 - 1
    with pytest.raises(redis.ResponseError, match="invalid expire time"):
        redis_client.eval(SET_PX, 1, "t-result", beyond)
    with pytest.raises(redis.ResponseError, match="invalid expire time"):
        redis_client.pexpire("t-reply", beyond)


def test_the_largest_pin_ttl_is_taken_by_the_claim_script_and_one_ms_more_is_not(redis_client: redis.Redis) -> None:
    """pins.lua holds the TTL as a Lua number: past MAX_PIN_TTL_MS, PEXPIRE gets e-notation (Redis <= 7.0)."""
    request = [PinRequest("w0", 0, 0)]
    assert PinClaims(Keys("t-pins"), "host-a", MAX_PIN_TTL_MS).claim(redis_client, [0], request) == [0]
    assert redis_client.pttl(Keys("t-pins").pins("host-a")) > MAX_PIN_TTL_MS - 60_000
    info = redis_client.info("server")
    if tuple(int(n) for n in str(info["redis_version"]).split(".")[:2]) <= (7, 0):
        with pytest.raises(redis.ResponseError, match="not an integer"):
            PinClaims(Keys("t-pins"), "host-a", MAX_PIN_TTL_MS + 1).claim(redis_client, [0], request)
