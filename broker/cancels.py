"""Cancellation: a request whose caller left is marked in Redis, and workers drop it.

A gateway whose caller disconnected (HTTP), cancelled its ``asyncio`` task, or stopped reading a
stream marks the request with ``P:cancel:<id>`` (a TTL until its deadline, and a second: never an
``XDEL``, which would make a stream group's lag lie to an autoscaler). Every cancel also keeps the
partition's flag ``P:cancels`` alive as long as its longest marker, so that a worker looks for
markers only while some may be live: with no cancel of late, no worker sends a command more.

Workers learn of the flag with their heartbeat (:class:`CancelWatch`, a beat hook) and, while it is
up, read the markers of each batch before they run it (:func:`cancelled`, one ``MGET``); a streaming
stage reads its items' markers with each step's chunks (:mod:`broker.chunks`). A foreign producer
cancels the same way (docs/protocol.md): ``cancel.lua``, which never shortens another's flag.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from importlib import resources
from typing import Any

import redis

from broker.families import CANCEL_FLAG, CANCELS
from broker.keys import Keys
from broker.operations import GATEWAY, WORKER, Script, sends

__all__ = ["CANCEL_SLACK_MS", "MAX_CANCEL_TTL_MS", "cancelled", "send_cancels"]

CANCEL_LUA = resources.files("broker").joinpath("cancel.lua").read_text()
CANCEL_SHA = hashlib.sha1(CANCEL_LUA.encode()).hexdigest()
CANCEL = Script("cancel.lua", (CANCEL_FLAG, CANCELS), (("set", (CANCEL_FLAG, CANCELS)), ("pttl", (CANCEL_FLAG,))))

CANCEL_SLACK_MS = 1_000  # a marker outlives its request's deadline by this much (clocks differ a little)
MAX_CANCEL_TTL_MS = 7 * 24 * 3600 * 1000  # a deadline is at most a week away (broker.protocol)
_MARKERS_PER_CALL = 500  # one call's KEYS stay bounded however many callers leave at once


@sends(GATEWAY, scripts=(CANCEL,), why="requests whose callers left (disconnected, cancelled, stopped reading)")
async def send_cancels(client: Any, keys: Keys, cancels: Sequence[tuple[bytes, int]]) -> int:
    """Mark ``cancels`` (request id, ms until its deadline) of this partition cancelled; returns how
    many. Raises what the client raises (the caller logs: a cancel is an optimisation, never a loss)."""
    done = 0
    for start in range(0, len(cancels), _MARKERS_PER_CALL):
        part = cancels[start:start + _MARKERS_PER_CALL]
        script_keys = [keys.cancels, *(keys.cancel_prefix + rid for rid, _ in part)]
        ttls = [min(MAX_CANCEL_TTL_MS, max(1, ttl) + CANCEL_SLACK_MS) for _, ttl in part]
        try:
            done += int(await client.evalsha(CANCEL_SHA, len(script_keys), *script_keys, *ttls))
        except redis.exceptions.NoScriptError:  # a restarted Redis (or a failover): load it, once
            await client.script_load(CANCEL_LUA)
            done += int(await client.evalsha(CANCEL_SHA, len(script_keys), *script_keys, *ttls))
    return done


@sends(WORKER, uses={"mget": CANCELS}, why="a batch's markers, while the partition's flag says some may be live")
def cancelled(client: redis.Redis, keys: Keys, request_ids: Sequence[bytes]) -> list[bool]:
    """Whether each of ``request_ids`` is marked cancelled (one round trip)."""
    if not request_ids:
        return []
    prefix = keys.cancel_prefix
    return [value is not None for value in client.mget([prefix + rid for rid in request_ids])]

