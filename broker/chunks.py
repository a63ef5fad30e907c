"""A streaming stage's step through Redis: its chunks pushed, its items' cancel markers read, one call.

A stage whose ``predict`` yields (workers.loop.streaming) sends each step's chunk records to the reply
lists of the requests that made them (one ``RPUSH`` per list, an element holding that list's records,
as a batch's answers are pushed by ``commit.lua``), and reads in the same call the cancel markers of the
items still running (:mod:`broker.cancels`): a caller who left is seen before the next step.

A chunk record is a msgpack map ``{"id": str, "seq": int, "chunk": any, "run": int}`` (docs/protocol.md),
plus ``"resume": true`` from a stage that declares itself deterministic; the record that ends an item's
stream is an ordinary result record (``ok``, ``value``: the generator's return value) with
``"chunks": n``, its chunk count.

Why a script on a held connection, packed from bytes (as the commit is): a step is the unit of a stream's
cost, and redis-py's pipeline (a command object per call, a checkout of the pool, its reply callbacks) cost
twice the round trip itself (``python -m bench.streams``). Nothing here must be atomic: the commit that acks
the batch is.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from importlib import resources
from typing import Any

import redis

from broker.connection import is_cluster_client
from broker.families import CANCELS, REPLIES, SHARED_REPLIES
from broker.held import HeldConnection
from broker.operations import WORKER, Script, sends
from broker.refusals import log_refusal_once
from broker.resp import pack_args

__all__ = ["StepPublisher"]

log = logging.getLogger("conveyor.worker")

CHUNKS_LUA = resources.files("broker").joinpath("chunks.lua").read_text()
CHUNKS = Script("chunks.lua", (REPLIES, SHARED_REPLIES, CANCELS), (
    ("rpush", (REPLIES, SHARED_REPLIES)), ("pexpire", (REPLIES, SHARED_REPLIES)), ("mget", (CANCELS,))))


class StepPublisher:
    """Runs ``chunks.lua`` for a worker's steps: on a held connection, or (a Redis Cluster) through redis-py,
    which routes each call to the node of its keys (one partition's: one slot)."""

    def __init__(self, client: redis.Redis, reply_ttl_ms: int) -> None:
        self._client = client
        self._sha = client.register_script(CHUNKS_LUA).sha.encode()
        self._ttl = b"%d" % reply_ttl_ms
        self._cluster = is_cluster_client(client)
        self._held = None if self._cluster else HeldConnection(client)
        self._packed_evalsha = b"".join(pack_args([b"EVALSHA", self._sha], []))

    @sends(WORKER, scripts=(CHUNKS,), why="a streaming stage's step: its chunks out, its running items' markers in")
    def __call__(self, pushes: Sequence[tuple[bytes, bytes]], markers: Sequence[bytes]) -> list[bool]:
        """Push each (reply key, element) and read ``markers``; whether each marker is set. A connection
        error raises (the batch stays pending and runs again)."""
        if not pushes and not markers:
            return []
        keys = [key for key, _ in pushes]
        args = [self._ttl, b"%d" % len(pushes), *(element for _, element in pushes)]
        try:
            reply = self._run(keys, markers, args)
        except redis.exceptions.NoScriptError:  # Redis restarted or flushed its scripts, or a failover
            self._client.script_load(CHUNKS_LUA)
            reply = self._run(keys, markers, args)
        except redis.ResponseError as exc:
            log_refusal_once(exc, "chunks.lua", keys[0] if keys else markers[0])
            raise
        for i in range(1, len(reply) - 1, 2):  # reply lists the script could not push to (pcall)
            key, error = reply[i], reply[i + 1]
            if not log_refusal_once(redis.ResponseError(_text(error)), "rpush", key):
                log.warning("chunks not pushed key=%s error=%s", key, error)
        flags = reply[0]
        return [flag == 0x31 for flag in (flags if isinstance(flags, bytes) else flags.encode())]

    def _run(self, keys: list[bytes], markers: Sequence[bytes], args: list[bytes]) -> Any:
        n_keys = len(keys) + len(markers)
        if self._held is None:
            return self._client.execute_command("EVALSHA", self._sha, n_keys, *keys, *markers, *args)
        parts = [b"*%d\r\n" % (3 + n_keys + len(args)), self._packed_evalsha]
        pack_args([b"%d" % n_keys, *keys, *markers, *args], parts)
        return self._held.call(b"".join(parts))

    def close(self) -> None:
        if self._held is not None:
            self._held.drop()


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)
