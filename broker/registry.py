"""A pipeline's registration: workers write its spec, its first stage's admission limit and its name
in the prefix's registry when they start; gateways and ``conveyor status`` read them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import redis

from broker import protocol
from broker.families import MAX_BACKLOG, REGISTRY, SPEC, STREAMS
from broker.keys import GROUP, Keys
from broker.operations import GATEWAY, WORKER, sends

__all__ = ["register", "registered_pipelines"]


@sends(WORKER, uses={"xgroup|create": STREAMS, "set": (SPEC, MAX_BACKLOG), "sadd": REGISTRY}, why="at start")
def register(client: redis.Redis, pipeline: str, lanes: Sequence[tuple[Keys, str]], spec: bytes,
             max_backlog: int | None) -> None:
    """For each ``(keys, stream)`` lane (a partition and the stage's stream in it): the stream's
    consumer group (made with the stream), the pipeline's spec, the first stage's limit and the
    pipeline's name in the prefix's registry (``conveyor gateway --all``).

    Admission (submit.lua) reads the limit from ``P:max_backlog`` in the same call as its XADDs:
    every gateway and foreign producer is bounded from this moment on; with partitions it bounds
    each partition's first stream. "none", not DEL: the documented minimal ACLs hold."""
    for keys, stream in lanes:
        try:
            client.xgroup_create(stream, GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        pipe = client.pipeline(transaction=False)
        pipe.set(keys.spec, spec)
        pipe.set(keys.max_backlog, "none" if max_backlog is None else max_backlog)
        pipe.sadd(keys.registry, pipeline)
        pipe.execute()


@sends(GATEWAY, uses={"smembers": REGISTRY}, why="`conveyor gateway --all`, and the hint for a mistyped name")
async def registered_pipelines(client: Any, prefix: str) -> list[str]:
    """Every pipeline name registered under ``prefix`` (workers add theirs at registration)."""
    members = await client.smembers(Keys("x", prefix).registry)
    return sorted(protocol.as_bytes(m).decode(errors="replace") for m in members)
