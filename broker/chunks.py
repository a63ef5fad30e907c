"""A streaming stage's step through Redis: its chunks pushed, its items' cancel markers read, one round trip.

A stage whose ``predict`` yields (workers.loop.streaming) sends each step's chunk records to the reply
lists of the requests that made them (one ``RPUSH`` per list, an element holding that list's records,
as a batch's answers are pushed by ``commit.lua``), and reads in the same round trip the cancel markers
of the items still running (:mod:`broker.cancels`): a caller who left is seen before the next step.

A chunk record is a msgpack map ``{"id": str, "seq": int, "chunk": any, "run": int}`` (docs/protocol.md),
plus ``"resume": true`` from a stage that declares itself deterministic; the record that ends an item's
stream is an ordinary result record (``ok``, ``value``: the generator's return value) with
``"chunks": n``, its chunk count. Why a pipeline and not a script: nothing here must be atomic (the
commit that acks the batch is), and a pipeline costs the same round trip.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import redis

from broker.connection import is_cluster_client
from broker.families import CANCELS, REPLIES, SHARED_REPLIES
from broker.operations import WORKER, sends
from broker.refusals import log_refusal_once

__all__ = ["publish_step"]

log = logging.getLogger("conveyor.worker")


@sends(WORKER, uses={"rpush": (REPLIES, SHARED_REPLIES), "pexpire": (REPLIES, SHARED_REPLIES), "mget": CANCELS,
                     "exists": CANCELS},
       why="a streaming stage's step: its chunks out, its running items' cancel markers in")
def publish_step(client: redis.Redis, pushes: Sequence[tuple[bytes, bytes]], reply_ttl_ms: int,
                 markers: Sequence[bytes]) -> list[bool]:
    """Push each (reply key, element) and read ``markers``; whether each marker is set. A reply key of
    another type (a foreign producer's mistake) is skipped, as ``commit.lua`` skips it; a connection
    error raises (the batch stays pending and runs again)."""
    pipe = client.pipeline(transaction=False)
    for key, element in pushes:
        pipe.rpush(key, element)
        pipe.pexpire(key, reply_ttl_ms)
    cluster = is_cluster_client(client)
    if markers and not cluster:
        pipe.mget(list(markers))
    elif markers:  # a cluster's pipeline refuses MGET (its keys may span slots; ours share one): one each
        for marker in markers:
            pipe.exists(marker)
    replies: list[Any] = pipe.execute(raise_on_error=False)
    for (key, _), pushed in zip(pushes, replies[0::2], strict=False):
        if isinstance(pushed, redis.ResponseError) and "WRONGTYPE" not in str(pushed):
            log_refusal_once(pushed, "rpush", key.decode(errors="replace"))
    if not markers:
        return []
    found = replies[2 * len(pushes):] if cluster else replies[-1]
    if isinstance(found, Exception) or any(isinstance(value, Exception) for value in found):
        error = found if isinstance(found, Exception) else next(v for v in found if isinstance(v, Exception))
        log_refusal_once(error, "exists" if cluster else "mget", markers[0].decode(errors="replace"))
        return [False] * len(markers)
    return [bool(value) for value in found] if cluster else [value is not None for value in found]
