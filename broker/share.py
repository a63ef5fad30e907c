"""The Redis side of burst sharing (:mod:`workers.batching.sharing` decides when): which peers are
idle, and ``share.lua``, which gives entries one consumer has read back to the stream."""

from __future__ import annotations

from collections.abc import Sequence
from importlib import resources

import redis

from broker.families import HEARTBEATS, STREAMS
from broker.keys import GROUP, LIVE_AFTER_MS
from broker.operations import WORKER, Script, sends
from broker.protocol import as_bytes, now_ms

SHARE_LUA = resources.files("broker").joinpath("share.lua").read_text()
SHARE = Script("share.lua", (STREAMS,), (
    ("xpending", (STREAMS,)), ("xrange", (STREAMS,)), ("xadd", (STREAMS,)), ("xack", (STREAMS,)),
    ("xdel", (STREAMS,))))


class Sharer:
    """One consumer's view of its peers, and ``share.lua`` run with EVALSHA (redis-py's script
    object loads it again after a flush)."""

    def __init__(self, client: redis.Redis, consumer: str) -> None:
        self._client = client
        self._script = client.register_script(SHARE_LUA)
        self._consumer = consumer.encode()

    @sends(WORKER, uses={"zrange": HEARTBEATS, "xinfo|consumers": STREAMS})
    def idle_peers(self, stream: str, heartbeats: str) -> int:
        """The stage's other live workers (a recent heartbeat in ``heartbeats``) that hold nothing
        pending in ``stream``: one round trip. (A worker's last read time cannot tell: Redis 7.0
        does not update it while the read blocks, and a worker that never got an entry is not
        yet a consumer of the group.)"""
        pipe = self._client.pipeline(transaction=False)
        pipe.zrange(heartbeats, now_ms() - LIVE_AFTER_MS, "+inf", byscore=True)
        pipe.xinfo_consumers(stream, GROUP)
        live, consumers = pipe.execute()
        busy = {as_bytes(info["name"]) for info in consumers if int(info["pending"])}
        return len({as_bytes(member) for member in live} - busy - {self._consumer})

    @sends(WORKER, scripts=(SHARE,))
    def give_back(self, stream: str, groups: Sequence[Sequence[bytes]]) -> set[bytes]:
        """Give these entries (read by this consumer, not started) back to the stream, one script
        call per group: Redis serves the readers blocked on the stream after each call, and a
        blocked read takes all it can, so one call per idle peer is what gives each its part.
        Returns the ids actually given back (an entry no longer pending for this consumer stays
        with the caller)."""
        given: set[bytes] = set()
        for group in groups:
            if group:
                reply = self._script(keys=[stream], args=[GROUP, self._consumer, *group])
                given.update(as_bytes(i) for i in reply)
        return given
