"""The Python owner of ``share.lua``: a worker gives part of a burst back to its idle peers.

A burst of requests that arrives at once (say eight answers sent back together, whose callers
send their next requests together) is read whole by the first worker blocked on the stream,
while its peers stay idle. The worker that read it gives the part its idle peers should run
back to the stream, atomically (see the script's header), and they take it at once. The choice
of how much, and when, is :mod:`workers.batching.handoff`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from importlib import resources

import redis

from broker.keys import GROUP

SHARE_LUA = resources.files("broker").joinpath("share.lua").read_text()


class Sharer:
    """Runs ``share.lua`` with EVALSHA (redis-py's script object loads it again after a flush)."""

    def __init__(self, client: redis.Redis, stream: str, consumer: str) -> None:
        self._script = client.register_script(SHARE_LUA)
        self._stream = stream
        self._consumer = consumer

    def give_back(self, groups: Sequence[Sequence[bytes]]) -> set[bytes]:
        """Give these entries (read by this consumer, not started) back to the stream, one script
        call per group: Redis serves the readers blocked on the stream after each call, and a
        blocked read takes all it can, so one call per idle peer is what gives each its part.
        Returns the ids actually given back (an entry no longer pending for this consumer stays
        with the caller)."""
        given: set[bytes] = set()
        for group in groups:
            if group:
                reply = self._script(keys=[self._stream], args=[GROUP, self._consumer, *group])
                given.update(i if isinstance(i, bytes) else str(i).encode() for i in reply)
        return given
