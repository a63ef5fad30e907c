"""What an autoscaling supervisor reads and says in Redis (:mod:`workers.process.scaling` decides).

It reads, about once a second and in one round trip per stage: the stage's backlog (``XLEN`` of its
stream in every partition: the entries not yet delivered and those pending, as ``conveyor status``
counts them), what its workers finished since the last read (``XRANGE`` of its stats streams: batch
sizes and predict durations, written by every worker of the stage on any host), and its live workers
(``ZRANGE`` of its heartbeats, every host). It says what it did in ``P:scale:<i>`` (partition 0), a
hash with one field per supervisor: a JSON record of its range, its workers and its last change with
the reason, which ``conveyor status`` and ``/metrics`` read with the stage's other keys (:mod:`broker.status`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import redis

from broker.batch_entries import item_time_s
from broker.families import HEARTBEATS, SCALE, STATS, STREAMS
from broker.keys import LIVE_AFTER_MS, Keys
from broker.operations import WORKER, sends
from broker.protocol import as_bytes, now_ms

__all__ = ["ScaleRecord", "StageLoad", "forget_scale", "publish_scale", "read_load", "scale_records"]

STALE_AFTER_MS = 10_000  # a supervisor's record not renewed this long is gone (status leaves it out)


@dataclass
class StageLoad:
    """One stage, as read now: its backlog, its live workers and what they finished since the last read."""

    backlog: int = 0
    live: int = 0
    items: int = 0
    busy_s: float = 0.0
    cursors: list[bytes] = field(default_factory=list)  # per partition: the last stats entry read


@sends(WORKER, uses={"xlen": STREAMS, "xrange": STATS, "zrange": HEARTBEATS},
       why="an autoscaling supervisor: each autoscaled stage's backlog, workers and finished work, about every second")
def read_load(client: redis.Redis, partitions: Sequence[Keys], stage: int, cursors: Sequence[bytes],
              levels: int = 1) -> StageLoad:
    """The stage's load in every partition (its backlog at every priority level of ``levels``); ``cursors``:
    the last stats entry read in each (``b"-"`` at first, then :attr:`StageLoad.cursors` of the previous read)."""
    pipe = client.pipeline(transaction=False)
    since = now_ms() - LIVE_AFTER_MS
    for keys, cursor in zip(partitions, cursors, strict=True):
        for level_keys in keys.levels(levels):
            pipe.xlen(level_keys.stream(stage))
        pipe.xrange(keys.stats(stage), min=cursor if cursor == b"-" else b"(" + cursor, count=1000)
        pipe.zrange(keys.heartbeats(stage), since, "+inf", byscore=True)
    replies = pipe.execute()
    load = StageLoad()
    live: set[bytes] = set()
    per = levels + 2
    for p, cursor in enumerate(cursors):
        *backlogs, entries, members = replies[per * p:per * p + per]
        load.backlog += sum(int(b) for b in backlogs)
        live.update(as_bytes(m) for m in members)
        for _, fields in entries:
            per_item_s = item_time_s(fields)  # None for an entry it cannot read
            if per_item_s is not None:
                items = sum(int(n) for n in fields.get(b"n", b"").split())
                load.items += items
                load.busy_s += per_item_s * items
        load.cursors.append(as_bytes(entries[-1][0]) if entries else cursor)
    load.live = len(live)
    return load


@dataclass(frozen=True)
class ScaleRecord:
    """One supervisor's autoscaling of one stage, as status shows it."""

    supervisor: str
    min_workers: int
    max_workers: int
    workers: int
    reason: str  # the last change's, e.g. "up: expected wait 0.31s > target 0.1s"
    changed_ms: int  # when (0: never changed)
    seen_ms: int  # the record's last renewal

    def encode(self) -> bytes:
        return json.dumps({"min": self.min_workers, "max": self.max_workers, "workers": self.workers,
                           "reason": self.reason, "changed_ms": self.changed_ms, "seen_ms": self.seen_ms}).encode()

    @classmethod
    def decode(cls, supervisor: str, raw: bytes) -> ScaleRecord | None:
        try:
            data: Any = json.loads(raw)
            return cls(supervisor, int(data["min"]), int(data["max"]), int(data["workers"]), str(data["reason"]),
                       int(data["changed_ms"]), int(data["seen_ms"]))
        except (ValueError, KeyError, TypeError):
            return None


@sends(WORKER, uses={"hset": SCALE}, why="an autoscaling supervisor: its stage's workers and last change, every second")
def publish_scale(client: redis.Redis, keys: Keys, stage: int, record: ScaleRecord) -> None:
    client.hset(keys.scale(stage), record.supervisor, record.encode())


@sends(WORKER, uses={"hdel": SCALE}, why="an autoscaling supervisor that stops")
def forget_scale(client: redis.Redis, keys: Keys, stage: int, supervisor: str) -> None:
    client.hdel(keys.scale(stage), supervisor)


def scale_records(reply: dict[Any, Any]) -> list[ScaleRecord]:
    """The records of ``HGETALL P:scale:<i>`` renewed within ``STALE_AFTER_MS`` (status reads it with the
    stage's other keys: :mod:`broker.status`)."""
    fresh_after = now_ms() - STALE_AFTER_MS
    records = [ScaleRecord.decode(as_bytes(name).decode(errors="replace"), raw) for name, raw in reply.items()]
    return [r for r in records if r is not None and r.seen_ms >= fresh_after]
