"""The gateway's reply reader (broker/replies.py) on a real Redis: what came while it was away arrives in one
round trip, in order; nothing comes twice; an empty list answers nothing within its block time."""

from __future__ import annotations

import asyncio

import pytest
import redis
import redis.asyncio as aredis

from broker.replies import POP_MORE, ReplyList

pytestmark = pytest.mark.redis

KEY = b"conveyor:reply:t-reply-list"


async def _popped(redis_url: str, rounds: int, block_s: float = 0.05) -> list[list[bytes]]:
    replies = ReplyList(aredis.Redis.from_url(redis_url), KEY, block_s)
    try:
        return [await replies.pop() for _ in range(rounds)]
    finally:
        await replies.close()


def test_what_came_meanwhile_comes_in_one_pop_in_order(redis_url: str, redis_client: redis.Redis) -> None:
    """A stream's chunks are pushed a step at a time, faster than one pop per round trip can take them:
    one BLPOP and, in the same write, one LPOP take them all (up to 1 + POP_MORE), in push order."""
    redis_client.delete(KEY)
    redis_client.rpush(KEY, *(b"e%d" % i for i in range(POP_MORE + 3)))
    first, second, third = asyncio.run(_popped(redis_url, 3))
    assert first == [b"e%d" % i for i in range(POP_MORE + 1)]
    assert second == [b"e%d" % (POP_MORE + 1), b"e%d" % (POP_MORE + 2)]
    assert third == []  # nothing within block_s
    assert redis_client.llen(KEY) == 0


def test_a_lone_element_is_answered_as_before(redis_url: str, redis_client: redis.Redis) -> None:
    redis_client.delete(KEY)

    async def pop_while_pushed() -> list[bytes]:
        replies = ReplyList(aredis.Redis.from_url(redis_url), KEY, 5.0)
        try:
            popping = asyncio.ensure_future(replies.pop())
            for _ in range(500):  # until the BLPOP blocks (bounded: 5 s), so the element comes to a blocked pop
                if redis_client.info("clients")["blocked_clients"] >= 1:
                    break
                await asyncio.sleep(0.01)
            await asyncio.to_thread(redis_client.rpush, KEY, b"only")
            return await asyncio.wait_for(popping, 5)
        finally:
            await replies.close()

    assert asyncio.run(pop_while_pushed()) == [b"only"]


def test_a_user_without_lpop_still_gets_every_element(redis_url: str, redis_client: redis.Redis,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    """A gateway user generated before the reader took LPOP: the refusal is said once (what would allow
    it), the element its BLPOP took is not lost, and the reader goes on one element a round trip."""
    redis_client.delete(KEY)
    user = "t-reply-no-lpop"
    redis_client.acl_setuser(user, enabled=True, passwords=["+pw"], keys=["conveyor:reply:*"],
                             commands=["+blpop", "+ping", "+hello", "+info"], reset=True)
    redis_client.rpush(KEY, b"a", b"b", b"c")
    url = redis_url.replace("unix://", f"unix://{user}:pw@")
    try:
        with caplog.at_level("ERROR"):
            popped = asyncio.run(_popped(url, 4))
    finally:
        redis_client.acl_deluser(user)
    assert popped == [[b"a"], [b"b"], [b"c"], []]
    assert sum("lpop" in r.getMessage().lower() for r in caplog.records) == 1, caplog.text
