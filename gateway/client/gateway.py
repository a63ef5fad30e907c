"""A gateway for a pipeline of any partition count: one :class:`Gateway` per partition.

Each partition is a full copy of the key layout under its own hash tag (see
:mod:`broker.keys`), so each has its own first stream, reply list and result keys, in its own
Redis Cluster slot; a request stays in the partition it was submitted to, and its answer is
pushed to that partition's reply list of this gateway. One :class:`Gateway` per partition is
therefore the whole design: each keeps its own flusher and reply reader (a ``BLPOP`` on its
partition's node); admission is in ``submit.lua``, per partition, not here.

The partition count is read from the pipeline spec (written by the workers) at start, unless
given; with no spec yet the gateway submits to partition 0 only (which every worker serves, so
this is correct, just not spread) and looks for the spec again every 2 s while requests come,
adding the other partitions once it names them.

Requests go round robin over the partitions, retrying on the next one when a partition answers
``Overloaded`` (``max_backlog`` is a per-partition bound: the pipeline holds up to N times
``max_backlog``), or to the partition a caller's key hashes to (CRC32 of the key, mod N) for
affinity.
"""

from __future__ import annotations

import asyncio
import logging
import time
import zlib
from dataclasses import replace
from types import TracebackType
from typing import Any, Literal, overload

from broker import protocol
from broker.connection import CONNECTION_OR_REPLY_ERRORS, RedisSettings, is_cluster_client
from broker.keys import Keys
from broker.spec import SpecError, decode_spec
from gateway.client.partition import Gateway, GatewaySettings
from gateway.client.slot import Waiter
from gateway.errors import Overloaded
from gateway.monitor.status import PipelineStatus, StageStatus, read_status

log = logging.getLogger("conveyor.gateway")


def partition_of(key: str | bytes, partitions: int) -> int:
    """The partition a caller's key maps to: what a foreign producer should compute too."""
    data = key.encode() if isinstance(key, str) else key
    return zlib.crc32(data) % partitions


async def read_partition_count(client: Any, keys: Keys) -> int | None:
    """The partition count from partition 0's spec; None if no worker wrote one yet."""
    raw = await client.get(keys.spec)
    if not raw:
        return None
    try:
        spec = decode_spec(protocol.as_bytes(raw))
    except SpecError:
        return None
    return spec[0].partitions if spec else None


class PartitionedGateway:
    """Same interface as :class:`Gateway` (``predict``, ``submit``, ``in_flight``, ``healthy``,
    ``pipeline_status``), plus ``key=`` on ``predict`` and ``submit`` (over HTTP: the header
    ``X-Conveyor-Partition-Key``)."""

    takes_partition_key = True  # the HTTP front passes X-Conveyor-Partition-Key on

    def __init__(self, redis_url: str, pipeline: str, settings: GatewaySettings | None = None,
                 partitions: int | None = None) -> None:
        self.redis_url = redis_url
        self.pipeline = pipeline
        self.settings = settings or GatewaySettings()
        self.partitions = partitions
        self.gateways: list[Gateway] = []
        self._next = 0
        self._counted = partitions is not None  # the count is known (given, or read from a spec)
        self._next_count_s = 0.0
        self._growing: asyncio.Task[None] | None = None

    async def start(self) -> None:
        count = self.partitions
        if count is None:
            count = await self._read_count()
            self._counted = count is not None
        self.gateways = await self._start_gateways(range(count or 1))

    async def _read_count(self) -> int | None:
        client = RedisSettings(self.redis_url).async_client(1)
        try:
            return await read_partition_count(client, Keys(self.pipeline, self.settings.prefix))
        finally:
            await client.aclose()

    async def _start_gateways(self, partitions: range) -> list[Gateway]:
        gateways = [Gateway(self.redis_url, self.pipeline, self.settings, p) for p in partitions]
        started = await asyncio.gather(*(g.start() for g in gateways), return_exceptions=True)
        failed = [r for r in started if isinstance(r, BaseException)]
        if failed:
            await asyncio.gather(*(g.close() for g, r in zip(gateways, started, strict=True) if r is None),
                                 return_exceptions=True)
            raise failed[0]
        return gateways

    def _check_count(self) -> None:
        """Started before any worker wrote the spec: look for it every 2 s (in the background)
        and, once it names more partitions, start their gateways, so the spread begins by itself."""
        if self._counted or self._growing is not None or time.monotonic() < self._next_count_s:
            return
        self._next_count_s = time.monotonic() + 2.0
        self._growing = asyncio.ensure_future(self._grow())

    async def _grow(self) -> None:
        try:
            count = await self._read_count()
            if count is not None:
                if count > len(self.gateways):
                    self.gateways += await self._start_gateways(range(len(self.gateways), count))
                    log.info("pipeline %s has %d partitions: submitting to all of them", self.pipeline, count)
                self._counted = True
        except CONNECTION_OR_REPLY_ERRORS as exc:
            log.warning("reading the partition count failed (will retry) error=%r", exc)
        finally:
            self._growing = None

    async def close(self) -> None:
        if self._growing is not None:
            self._growing.cancel()
            await asyncio.gather(self._growing, return_exceptions=True)
        await asyncio.gather(*(g.close() for g in self.gateways), return_exceptions=True)

    async def __aenter__(self) -> PartitionedGateway:
        await self.start()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    @property
    def in_flight(self) -> int:
        return sum(g.in_flight for g in self.gateways)

    @property
    def healthy(self) -> bool:
        return all(g.healthy for g in self.gateways)

    submits_direct = True

    @overload
    def submit(self, x: Any, timeout_s: float | None = None, key: str | bytes | None = None, *,
               direct: Literal[False] = False) -> asyncio.Future[Any]: ...

    @overload
    def submit(self, x: Any, timeout_s: float | None = None, key: str | bytes | None = None, *,
               direct: bool) -> Waiter: ...

    def submit(self, x: Any, timeout_s: float | None = None, key: str | bytes | None = None, *,
               direct: bool = False) -> Waiter:
        """Like :meth:`Gateway.submit` (the HTTP front's path): with one partition, or a key,
        exactly that on the one partition (``direct``: a `Slot`, as there); else :meth:`predict`'s
        round robin (which may retry another partition) as a task."""
        self._check_count()
        n = len(self.gateways)
        if n == 1 or key is not None:
            return self.gateways[0 if key is None else partition_of(key, n)].submit(x, timeout_s, direct=direct)
        return asyncio.ensure_future(self.predict(x, timeout_s))

    async def predict(self, x: Any, timeout_s: float | None = None, key: str | bytes | None = None) -> Any:
        """Like :meth:`Gateway.predict`; ``key``: requests with one key go to one partition."""
        self._check_count()
        n = len(self.gateways)
        if n == 1:
            return await self.gateways[0].predict(x, timeout_s)
        if key is not None:
            return await self.gateways[partition_of(key, n)].predict(x, timeout_s)
        for attempt in range(n):
            gateway = self.gateways[self._next]
            self._next = (self._next + 1) % n
            try:
                return await gateway.predict(x, timeout_s)
            except Overloaded:
                if attempt == n - 1:  # every partition is over its max_backlog
                    raise
        raise RuntimeError("unreachable: no partition")  # n >= 1, so the loop returns or raises

    async def pipeline_status(self) -> PipelineStatus:
        parts = await asyncio.gather(*(g.pipeline_status() for g in self.gateways))
        return merge_status(list(parts))


async def read_all_partitions(client: Any, keys: Keys, marks: dict[int, dict[int, bytes]] | None = None,
                              ) -> PipelineStatus:
    """``read_status`` of every partition (count from partition 0's spec), merged."""
    first = await read_status(client, keys, None if marks is None else marks.setdefault(0, {}))
    if first.partitions <= 1:
        return first
    parts = [first]
    for k in keys.partitions(first.partitions)[1:]:  # one after another: the client may hold one connection
        parts.append(await read_status(client, k, None if marks is None else marks.setdefault(k.partition, {})))
    if is_cluster_client(client):  # where each partition lives: spread or not, at a glance
        for k, part in zip(keys.partitions(first.partitions), parts, strict=True):
            part.node = str(client.get_node_from_key(k.spec).name)
    return merge_status(parts)


def merge_status(parts: list[PipelineStatus]) -> PipelineStatus:
    """Totals over partitions: backlog, pending, dead letters, items and batches add up; a
    stage's live workers are the fewest any partition sees (each worker beats in every
    partition, so fewer means a partition is not served); percentiles are the worst part's."""
    if len(parts) == 1:
        return parts[0]
    errors = "; ".join(f"partition {p}: {s.error}" for p, s in enumerate(parts) if s.error)
    reachable = all(s.reachable for s in parts)
    if not all(s.stages for s in parts) or len({len(s.stages) for s in parts}) != 1:
        return PipelineStatus(reachable, [], errors or "not every partition is registered", len(parts), parts)
    stages = [_merge_stage([s.stages[i] for s in parts]) for i in range(len(parts[0].stages))]
    return PipelineStatus(reachable, stages, errors, len(parts), parts)


def _merge_stage(parts: list[StageStatus]) -> StageStatus:
    first = parts[0]
    p50s = [s.batch_p50_s for s in parts if s.batch_p50_s is not None]
    p99s = [s.batch_p99_s for s in parts if s.batch_p99_s is not None]
    return replace(
        first,
        backlog=sum(s.backlog for s in parts), pending=sum(s.pending for s in parts),
        consumers=max(s.consumers for s in parts), live_workers=min(s.live_workers for s in parts),
        dead_letters=sum(s.dead_letters for s in parts),
        batches=[b for s in parts for b in s.batches],
        items_last_minute=sum(s.items_last_minute for s in parts),
        batches_last_minute=sum(s.batches_last_minute for s in parts),
        throughput_per_s=sum(s.throughput_per_s for s in parts),
        batch_p50_s=max(p50s) if p50s else None, batch_p99_s=max(p99s) if p99s else None,
        stats_window_s=min(s.stats_window_s for s in parts),
    )
