"""What an autoscaling supervisor reads and says in Redis (:mod:`workers.process.scaling` decides).

It reads, about once a second and in one round trip per stage, in every partition and priority level:

- the stage's backlog, as entries wait for a worker: those not yet delivered (the group's ``lag``;
  ``XLEN`` less ``pending`` on Redis 6.2, where workers delete what they ack, as ``conveyor status``
  counts them) and those held by consumers that no longer beat (they wait to be claimed), but not those
  a live worker holds: those are being computed (``XINFO GROUPS``, ``XLEN``, ``XINFO CONSUMERS``). A batch
  entry holds many requests and the rate it is weighed against is in requests: the group's
  ``entries-read`` (Redis 7) beside the requests the stats say were finished gives the requests an entry
  holds (:mod:`workers.process.scaling`). No entry is read: their payloads may be large;
- its live workers (``ZRANGE`` of its heartbeats, every host), and which of them hold nothing (idle);
- what its workers finished since the last read (``XRANGE`` of its stats streams: batch sizes and predict
  durations, written by every worker of the stage on any host).

It says what it did in ``P:scale:<i>`` (partition 0), a hash with one field per supervisor: a JSON record of
its range, its workers and its last change with the reason, which ``conveyor status`` and ``/metrics`` read
with the stage's other keys (:mod:`broker.status`); a supervisor's field is removed when it stops, and any
field not renewed for :data:`PRUNE_AFTER_MS` (a supervisor that died) by the next supervisor that prunes.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import redis

from broker.batch_entries import item_time_s
from broker.connection import is_absent
from broker.families import HEARTBEATS, SCALE, STATS, STREAMS
from broker.keys import GROUP, LIVE_AFTER_MS, Keys
from broker.operations import WORKER, sends
from broker.protocol import as_bytes, now_ms

__all__ = ["ScaleRecord", "StageLoad", "forget_scale", "prune_scale", "publish_scale", "read_load",
           "scale_records"]

STALE_AFTER_MS = 10_000  # a supervisor's record not renewed this long is gone (status leaves it out)
PRUNE_AFTER_MS = 60_000  # ... and one not renewed this long is removed (its supervisor died without a stop)


@dataclass
class StageLoad:
    """One stage, as read now: its backlog, its live workers and what they finished since the last read."""

    backlog: int = 0  # entries waiting for a worker (not those a live worker holds)
    live: int = 0
    items: int = 0
    busy_s: float = 0.0
    cursors: list[bytes] = field(default_factory=list)  # per partition: the last stats entry read
    idle: int = 0  # live workers that hold no entry: they take what waits at once
    entries_read: int | None = None  # entries ever delivered to the group (None: Redis 6.2 does not say)


@dataclass
class _StreamBacklog:
    """One stream's share of the backlog, as read: its waiting entries, what each consumer holds, and the
    entries ever delivered to its group (None: not said)."""

    waiting: int = 0
    held: dict[bytes, int] = field(default_factory=dict)
    entries_read: int | None = None


@sends(WORKER, uses={"xinfo|groups": STREAMS, "xinfo|consumers": STREAMS, "xlen": STREAMS, "xrange": STATS,
                     "zrange": HEARTBEATS},
       why="an autoscaling supervisor: each autoscaled stage's backlog, workers and finished work, about every second")
def read_load(client: redis.Redis, partitions: Sequence[Keys], stage: int, cursors: Sequence[bytes],
              levels: int = 1) -> StageLoad:
    """The stage's load in every partition (its backlog at every priority level of ``levels``); ``cursors``:
    the last stats entry read in each (``b"-"`` at first, then :attr:`StageLoad.cursors` of the previous read)."""
    pipe = client.pipeline(transaction=False)
    since = now_ms() - LIVE_AFTER_MS
    for keys, cursor in zip(partitions, cursors, strict=True):
        for level_keys in keys.levels(levels):
            stream = level_keys.stream(stage)
            pipe.xinfo_groups(stream)
            pipe.xlen(stream)
            pipe.xinfo_consumers(stream, GROUP)
        pipe.xrange(keys.stats(stage), min=cursor if cursor == b"-" else b"(" + cursor, count=1000)
        pipe.zrange(keys.heartbeats(stage), since, "+inf", byscore=True)
    return _load(pipe.execute(raise_on_error=False), cursors, levels)


def _load(replies: list[Any], cursors: Sequence[bytes], levels: int) -> StageLoad:
    load = StageLoad()
    live: set[bytes] = set()
    streams: list[_StreamBacklog] = []
    per = 3 * levels + 2
    for p, cursor in enumerate(cursors):
        part = replies[per * p:per * p + per]
        for level in range(levels):
            streams.append(_stream(*part[3 * level:3 * level + 3]))
        entries, members = (_reply(r, []) for r in part[-2:])
        live.update(as_bytes(m) for m in members)
        for _, fields in entries:
            per_item_s = item_time_s(fields)  # None for an entry it cannot read
            if per_item_s is not None:
                items = sum(int(n) for n in fields.get(b"n", b"").split())
                load.items += items
                load.busy_s += per_item_s * items
        load.cursors.append(as_bytes(entries[-1][0]) if entries else cursor)
    waiting = sum(s.waiting for s in streams)
    holding: set[bytes] = set()
    for s in streams:
        waiting += sum(n for name, n in s.held.items() if name not in live)  # a dead consumer's: to be claimed
        holding.update(name for name, n in s.held.items() if n > 0)
    load.backlog = waiting
    load.live = len(live)
    load.idle = len(live - holding)
    read = [s.entries_read for s in streams]
    load.entries_read = None if None in read else sum(n for n in read if n is not None)
    return load


def _stream(groups: Any, length: Any, consumers: Any) -> _StreamBacklog:
    """One stream's replies: ``XINFO GROUPS``, ``XLEN``, ``XINFO CONSUMERS``."""
    pending, lag, read = 0, None, 0  # no group yet: nothing delivered
    for group in _reply(groups, []):
        if group["name"] in (GROUP, GROUP.encode()):
            pending, lag, read = int(group["pending"]), group.get("lag"), group.get("entries-read")  # 6.2: None
    out = _StreamBacklog(int(lag) if lag is not None else max(0, int(_reply(length, 0)) - pending))
    out.entries_read = None if read is None else int(read)
    for consumer in _reply(consumers, []):
        out.held[as_bytes(consumer["name"])] = int(consumer["pending"])
    return out


def _reply(value: Any, empty: Any) -> Any:
    """A reply, or ``empty`` for a stream or group that does not exist yet; any other error raised (a
    refusal, explained by the caller)."""
    if isinstance(value, redis.exceptions.ResponseError):
        if is_absent(value):
            return empty
        raise value
    return value


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


@sends(WORKER, uses={"hgetall": SCALE, "hdel": SCALE},
       why="an autoscaling supervisor, about once a minute: the records of supervisors that died without a stop")
def prune_scale(client: redis.Redis, keys: Keys, stage: int) -> list[str]:
    """Remove the records of ``P:scale:<stage>`` not renewed for :data:`PRUNE_AFTER_MS` (or unreadable); their
    supervisors' names. A live supervisor whose record is removed (frozen that long) writes it again at its
    next renewal."""
    gone_before = now_ms() - PRUNE_AFTER_MS
    stale = []
    for name, raw in client.hgetall(keys.scale(stage)).items():
        record = ScaleRecord.decode(as_bytes(name).decode(errors="replace"), as_bytes(raw))
        if record is None or record.seen_ms < gone_before:
            stale.append(as_bytes(name))
    if stale:
        client.hdel(keys.scale(stage), *stale)
    return [name.decode(errors="replace") for name in stale]


def scale_records(reply: dict[Any, Any]) -> list[ScaleRecord]:
    """The records of ``HGETALL P:scale:<i>`` renewed within ``STALE_AFTER_MS`` (status reads it with the
    stage's other keys: :mod:`broker.status`)."""
    fresh_after = now_ms() - STALE_AFTER_MS
    records = [ScaleRecord.decode(as_bytes(name).decode(errors="replace"), raw) for name, raw in reply.items()]
    return [r for r in records if r is not None and r.seen_ms >= fresh_after]
