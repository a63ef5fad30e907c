"""Runs ``audit.lua``: which requests Redis forgot (in no stage's stream, without a result).

The owner of the script for any producer that holds its requests until they are answered (the
gateway's :mod:`gateway.client.recall`; a foreign producer may run the same script, see
docs/guarantees.md). On a Redis Cluster every key of a pipeline partition shares its hash tag, so
each call goes to that partition's node.

An audit is one scan of the partition's streams, split over calls that each read a bounded part
(the script says why the split misses nothing), so its cost grows with the backlog once, not once
per chunk of ids, and no call holds Redis for long; it stops as soon as it met every id asked about.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from importlib import resources
from typing import Any

import redis

from broker import protocol
from broker.families import RESULTS, STREAMS
from broker.keys import Keys
from broker.operations import GATEWAY, Script, sends
from broker.refusals import log_refusal_once

log = logging.getLogger("conveyor.gateway")

AUDIT_LUA = resources.files("broker").joinpath("audit.lua").read_text()
AUDIT_SHA = hashlib.sha1(AUDIT_LUA.encode()).hexdigest()
AUDIT = Script("audit.lua", (STREAMS, RESULTS),
               (("exists", (RESULTS,)), ("xrange", (STREAMS,)), ("xlen", (STREAMS,))))

# Ids per 'unanswered' call: a bounded number keeps its KEYS list (one result key each) small.
AUDIT_BATCH = 500
# A scan reads at most this many times the streams' length when it began (plus one call's worth)
# before it gives up, leaving its ids for the next audit: streams appended faster than the calls
# read them would otherwise keep it going for ever.
SCAN_SLACK = 2


@sends(GATEWAY, scripts=(AUDIT,), why="requests older than audit_after_s, or in flight on another run")
async def forgotten(client: Any, keys: Keys, stages: int, request_ids: Sequence[bytes],
                    unsure_lost: bool = False) -> list[bytes]:
    """Of ``request_ids`` (submitted to this partition of a pipeline of ``stages`` stages), those
    in no stage's stream and without a result, in their order. A scan that gave up (the streams grew
    faster than it read) says none lost, leaving them to the next audit; with ``unsure_lost`` (no next
    audit to leave them to) those it did not meet count as lost when they have no result. An ACL refusal
    is logged once, with what would allow it."""
    streams = [keys.stream(i) for i in range(stages)]
    try:
        unmet = await _scan(client, streams, set(request_ids), unsure_lost)
        if not unmet:
            return []
        missing: list[bytes] = []
        ids = [i for i in request_ids if i in unmet]
        for start in range(0, len(ids), AUDIT_BATCH):
            chunk = ids[start:start + AUDIT_BATCH]
            reply = await _run(client, [keys.result_key(i) for i in chunk], ["unanswered", *chunk])
            missing += [protocol.as_bytes(r) for r in reply or []]
        return missing
    except redis.ResponseError as exc:
        log_refusal_once(exc, "audit.lua", streams[0])
        raise


async def _scan(client: Any, streams: list[str], wanted: set[bytes], unsure_lost: bool = False) -> set[bytes]:
    """Scan ``streams`` to their ends, a bounded part per call, and return the ids of ``wanted``
    met nowhere; empty also when the scan gave up (nothing is said lost unless the scan ended), unless
    ``unsure_lost``: then those it had not met yet."""
    stage, after = 1, "-"
    budget: int | None = None
    while wanted and stage <= len(streams):
        reply = await _run(client, streams, ["scan", stage, after])
        stage, after = int(reply[0]), protocol.as_bytes(reply[1]).decode()
        length, read = int(reply[2]), int(reply[3])
        wanted.difference_update(protocol.as_bytes(r) for r in reply[4:])
        if budget is None:
            budget = SCAN_SLACK * length + read
        budget -= read
        if budget < 0 and wanted and stage <= len(streams):
            if unsure_lost:
                log.info("audit of %d requests gave up: the streams grew faster than it read them; those it did "
                         "not meet are taken as lost stream=%s", len(wanted), streams[0])
                return wanted
            log.info("audit of %d old requests left for the next one: the streams grew faster than it read "
                     "them stream=%s", len(wanted), streams[0])
            return set()
    return wanted


async def _run(client: Any, script_keys: list[Any], args: list[Any]) -> Any:
    try:
        return await client.evalsha(AUDIT_SHA, len(script_keys), *script_keys, *args)
    except redis.exceptions.NoScriptError:  # a restarted Redis (or a failover): load it, once
        await client.script_load(AUDIT_LUA)
        return await client.evalsha(AUDIT_SHA, len(script_keys), *script_keys, *args)
