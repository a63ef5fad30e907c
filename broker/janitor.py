"""Removes dead consumers from a stage's consumer group, so that ``status`` stays true.

Every worker process is a consumer with a unique name; one that dies (killed, crashed,
container replaced) stays in the group forever. A consumer is dead when all of these hold:

- its heartbeat (``P:hb:<i>``, member = consumer name, score = Unix ms) is older than
  ``dead_after_ms``, or missing (workers prune members older than an hour);
- Redis has seen no read or claim from it for ``dead_after_ms`` (``XINFO CONSUMERS`` idle);
- it holds no pending entry.

The last condition is what makes removal safe, and it is re-checked in the same Lua call
that removes the consumer: ``XGROUP DELCONSUMER`` on a consumer that still holds entries
drops them from the pending list, and nobody would ever process (or even claim) them. A
consumer whose entries are still pending is left alone; live workers claim those entries
after ``claim_idle_s`` and the consumer is removed on a later round.

Removing a consumer that is in fact alive costs nothing: its next ``XREADGROUP`` recreates
it. Any number of workers may reap the same stage concurrently: each removal is atomic and
removing an absent consumer is a no-op.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from importlib import resources
from typing import Any

import redis

from broker.connection import is_absent
from broker.families import HEARTBEATS, STREAMS
from broker.keys import GROUP, Keys
from broker.operations import WORKER, Script, sends
from broker.protocol import now_ms
from broker.refusals import log_refusal_once

log = logging.getLogger("conveyor.janitor")

REAP_INTERVAL_S = 30.0  # how often a worker should call reap_dead_consumers
DEFAULT_DEAD_AFTER_MS = 60_000  # well past LIVE_AFTER_MS (5 s): a worker that misses beats is not reaped

REAP_LUA = resources.files("broker").joinpath("janitor.lua").read_text()
JANITOR = Script("janitor.lua", (STREAMS, HEARTBEATS), (
    ("zscore", (HEARTBEATS,)), ("xinfo|consumers", (STREAMS,)), ("xgroup|delconsumer", (STREAMS,)),
    ("zrem", (HEARTBEATS,))))


@sends(WORKER, uses={"zrange": HEARTBEATS, "xinfo|consumers": STREAMS}, scripts=(JANITOR,),
       why="every 30 s")
def reap_dead_consumers(client: redis.Redis, keys: Keys, stage: int, dead_after_ms: int = DEFAULT_DEAD_AFTER_MS,
                        *, keep: Collection[str] = ()) -> list[str]:
    """Remove stage ``stage``'s dead consumers (see the module docstring); returns their names.

    ``keep``: names never removed (a worker passes its own). A missing stream or group is not
    an error (nothing to reap); connection errors propagate to the caller's retry logic.
    """
    if dead_after_ms <= 0:
        raise ValueError(f"dead_after_ms must be > 0, got {dead_after_ms}")
    stream, hb_key = keys.stream(stage), keys.heartbeats(stage)
    pipe = client.pipeline(transaction=False)
    pipe.xinfo_consumers(stream, GROUP)
    pipe.zrange(hb_key, 0, -1, withscores=True)
    try:
        consumers, beats = pipe.execute()
    except redis.ResponseError as exc:
        if is_absent(exc):
            return []
        log_refusal_once(exc, None, stream)
        raise
    cutoff = now_ms() - dead_after_ms
    heartbeats = {_text(member): float(score) for member, score in beats}
    script = client.register_script(REAP_LUA)
    removed: list[str] = []
    for candidate in _candidates(consumers, heartbeats, cutoff, dead_after_ms, keep):
        try:
            done = script(keys=[stream, hb_key], args=[GROUP, candidate, cutoff, dead_after_ms])
        except redis.ResponseError as exc:
            if is_absent(exc):
                break
            log_refusal_once(exc, "janitor.lua", stream)
            raise
        if int(done):
            beat = heartbeats.get(candidate)
            log.info("reaped dead consumer stage=%s consumer=%s last_heartbeat_age_ms=%s", stage, candidate,
                     None if beat is None else int(cutoff + dead_after_ms - beat))
            removed.append(candidate)
    return removed


def _candidates(consumers: list[dict[str, Any]], heartbeats: dict[str, float], cutoff: int, dead_after_ms: int,
                keep: Collection[str]) -> list[str]:
    """Names that look dead from one snapshot; the Lua script has the final word."""
    names = []
    for info in consumers:
        name = _text(info["name"])
        beat = heartbeats.get(name)
        if name in keep or (beat is not None and beat >= cutoff):
            continue
        if int(info["pending"]) == 0 and int(info["idle"]) > dead_after_ms:
            names.append(name)
    return names


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
