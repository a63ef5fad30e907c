"""Runs ``audit.lua``: which requests Redis forgot (in no stage's stream, without a result).

The owner of the script for any producer that holds its requests until they are answered (the
gateway's :mod:`gateway.client.recall`; a foreign producer may run the same script, see
docs/guarantees.md). On a Redis Cluster every key of a pipeline partition shares its hash tag, so
the call goes to that partition's node.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from importlib import resources
from typing import Any

import redis

from broker import protocol
from broker.families import RESULTS, STREAMS
from broker.keys import Keys
from broker.operations import GATEWAY, Script, sends
from broker.refusals import log_refusal_once

AUDIT_LUA = resources.files("broker").joinpath("audit.lua").read_text()
AUDIT_SHA = hashlib.sha1(AUDIT_LUA.encode()).hexdigest()
AUDIT = Script("audit.lua", (STREAMS, RESULTS), (("exists", (RESULTS,)), ("xrange", (STREAMS,))))

# Ids per call: one script call holds Redis for its scan; a bounded number of ids keeps the
# KEYS list (one result key each) small.
AUDIT_BATCH = 500


@sends(GATEWAY, scripts=(AUDIT,), why="requests older than audit_after_s")
async def forgotten(client: Any, keys: Keys, stages: int, request_ids: Sequence[bytes]) -> list[bytes]:
    """Of ``request_ids`` (submitted to this partition of a pipeline of ``stages`` stages), those
    in no stage's stream and without a result. An ACL refusal is logged once, with what would allow it."""
    missing: list[bytes] = []
    streams = [keys.stream(i) for i in range(stages)]
    for start in range(0, len(request_ids), AUDIT_BATCH):
        ids = request_ids[start:start + AUDIT_BATCH]
        script_keys = [*streams, *(keys.result_key(i) for i in ids)]
        args = [stages, *ids]
        try:
            reply = await _run(client, script_keys, args)
        except redis.ResponseError as exc:
            log_refusal_once(exc, "audit.lua", streams[0])
            raise
        missing += [protocol.as_bytes(r) for r in reply or []]
    return missing


async def _run(client: Any, script_keys: list[Any], args: list[Any]) -> Any:
    try:
        return await client.evalsha(AUDIT_SHA, len(script_keys), *script_keys, *args)
    except redis.exceptions.NoScriptError:  # a restarted Redis (or a failover): load it, once
        await client.script_load(AUDIT_LUA)
        return await client.evalsha(AUDIT_SHA, len(script_keys), *script_keys, *args)
