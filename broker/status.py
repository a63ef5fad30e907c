"""Reads a pipeline's state from Redis in one pipelined round trip (for status, readyz, metrics)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aredis

from broker import codec
from broker.connection import CONNECTION_ERRORS
from broker.keys import GROUP, Keys
from broker.protocol import as_bytes, now_ms

LIVE_AFTER_MS = 5_000  # a worker whose last heartbeat is older than this is not live


@dataclass
class ConsumerStatus:
    name: str
    pending: int
    idle_ms: int


@dataclass
class StageStatus:
    index: int
    name: str
    backlog: int = 0  # entries in the stream not yet delivered to any consumer
    pending: int = 0  # delivered, not yet acked
    consumers: int = 0
    live_workers: int = 0
    dead_letters: int = 0
    max_backlog: int | None = None
    batches: list[tuple[int, float]] = field(default_factory=list)  # (size, seconds) since last read
    consumer_details: list[ConsumerStatus] = field(default_factory=list)


@dataclass
class PipelineStatus:
    reachable: bool
    stages: list[StageStatus] = field(default_factory=list)
    error: str = ""

    @property
    def ready(self) -> bool:
        return self.reachable and bool(self.stages) and all(s.live_workers > 0 for s in self.stages)


async def read_status(client: aredis.Redis, keys: Keys, marks: dict[int, bytes] | None = None) -> PipelineStatus:
    """``marks`` remembers the last stats entry seen per stage, so batches are reported once."""
    try:
        raw_spec = await client.get(keys.spec)
        if not raw_spec:
            return PipelineStatus(True, [], "no worker has registered this pipeline yet")
        spec = codec.decode(as_bytes(raw_spec))
        pipe = client.pipeline(transaction=False)
        now = now_ms()
        for stage in spec:
            i = int(stage["index"])
            pipe.xinfo_groups(keys.stream(i))
            pipe.xinfo_consumers(keys.stream(i), GROUP)
            pipe.zcount(keys.heartbeats(i), now - LIVE_AFTER_MS, "+inf")
            pipe.xlen(keys.dead(i))
            start = b"(" + marks[i] if marks is not None and i in marks else (b"-" if marks is None else b"+")
            pipe.xrange(keys.stats(i), min=start, max="+", count=1000) if start != b"+" else pipe.xrevrange(
                keys.stats(i), count=1)
        results = await pipe.execute(raise_on_error=False)
    except CONNECTION_ERRORS as exc:
        return PipelineStatus(False, [], f"redis unreachable: {exc!r}")
    stages = [_stage(stage, results[5 * n:5 * n + 5], marks) for n, stage in enumerate(spec)]
    return PipelineStatus(True, stages)


def _ok(value: Any, default: Any) -> Any:
    return default if isinstance(value, Exception) else value


def _stage(stage: dict[str, Any], results: list[Any], marks: dict[int, bytes] | None) -> StageStatus:
    groups, consumers, live, dead, stats = (_ok(r, d) for r, d in zip(results, ([], [], 0, 0, []), strict=True))
    i = int(stage["index"])
    status = StageStatus(i, str(stage["name"]), live_workers=int(live), dead_letters=int(dead),
                         max_backlog=stage.get("max_backlog"))
    for group in groups:
        if group["name"] in (GROUP, GROUP.encode()):
            status.pending = int(group["pending"])
            status.consumers = int(group["consumers"])
            lag = group.get("lag")
            status.backlog = int(lag) if lag is not None else 0
    status.consumer_details = [
        ConsumerStatus(_text(c["name"]), int(c["pending"]), int(c["idle"])) for c in consumers
    ]
    if marks is not None and stats:
        if marks.get(i) is None and stats:
            marks[i] = stats[0][0]  # first look: start counting from now on
        else:
            status.batches = [(int(f[b"n"]), float(f[b"ms"]) / 1000) for _, f in stats]
            marks[i] = stats[-1][0]
    return status


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
