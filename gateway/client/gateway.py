"""The gateway's Python API: :class:`Gateway`, for a pipeline of any partition count.

Each partition is a full copy of the key layout under its own hash tag (see
:mod:`broker.keys`), so each has its own first stream, reply list and result keys, in its own
Redis Cluster slot; a request stays in the partition it was submitted to, and its answer is
pushed to that partition's reply list of this gateway. One :class:`Partition` per partition is
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
from types import TracebackType
from typing import Any

from broker import protocol
from broker.connection import CONNECTION_OR_REPLY_ERRORS, RedisSettings
from broker.keys import Keys
from broker.spec import SpecError, decode_spec
from gateway.client.partition import Partition
from gateway.client.settings import GatewaySettings
from gateway.client.slot import Waiter
from gateway.errors import Overloaded
from gateway.monitor.status import PipelineStatus, merge_status

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


class Gateway:
    """The Python API: ``predict(x)`` runs ``x`` through pipeline ``pipeline`` and returns its
    answer. Raises `StageError` (a stage raised on it), `Overloaded` (the first stage's backlog is
    at its ``max_backlog``), `UnknownPipeline` (no worker ever registered that name here),
    ``TimeoutError`` (the deadline passed), `CodecError` (an input that cannot travel).

    ``key`` (on ``predict`` and ``submit``; over HTTP the header ``X-Conveyor-Partition-Key``):
    requests with one key go to one partition of a partitioned pipeline."""

    def __init__(self, redis_url: str, pipeline: str, settings: GatewaySettings | None = None,
                 partitions: int | None = None) -> None:
        """``partitions``: the pipeline's partition count, if known (else read from its spec)."""
        self.redis_url = redis_url
        self.pipeline = pipeline
        self.settings = settings or GatewaySettings()
        self.partitions = partitions
        self.parts: list[Partition] = []
        self._next = 0
        self._counted = partitions is not None  # the count is known (given, or read from a spec)
        self._next_count_s = 0.0
        self._growing: asyncio.Task[None] | None = None

    async def start(self) -> None:
        count = self.partitions
        if count is None:
            count = await self._read_count()
            self._counted = count is not None
        self.parts = await self._start_parts(range(count or 1))

    async def _read_count(self) -> int | None:
        client = RedisSettings(self.redis_url).async_client(1)
        try:
            return await read_partition_count(client, Keys(self.pipeline, self.settings.prefix))
        finally:
            await client.aclose()

    def _partition(self, index: int) -> Partition:
        return Partition(self.redis_url, self.pipeline, self.settings, index)

    async def _start_parts(self, indexes: range) -> list[Partition]:
        parts = [self._partition(p) for p in indexes]
        started = await asyncio.gather(*(p.start() for p in parts), return_exceptions=True)
        failed = [r for r in started if isinstance(r, BaseException)]
        if failed:
            await asyncio.gather(*(p.close() for p, r in zip(parts, started, strict=True) if r is None),
                                 return_exceptions=True)
            raise failed[0]
        return parts

    def _check_count(self) -> None:
        """Started before any worker wrote the spec: look for it every 2 s (in the background)
        and, once it names more partitions, start them, so the spread begins by itself."""
        if self._counted or self._growing is not None or time.monotonic() < self._next_count_s:
            return
        self._next_count_s = time.monotonic() + 2.0
        self._growing = asyncio.ensure_future(self._grow())

    async def _grow(self) -> None:
        try:
            count = await self._read_count()
            if count is not None:
                if count > len(self.parts):
                    self.parts += await self._start_parts(range(len(self.parts), count))
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
        await asyncio.gather(*(p.close() for p in self.parts), return_exceptions=True)

    async def __aenter__(self) -> Gateway:
        await self.start()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    @property
    def in_flight(self) -> int:
        return sum(p.in_flight for p in self.parts)

    @property
    def healthy(self) -> bool:
        """False once a background task has died: readiness turns 503 so traffic goes elsewhere."""
        return all(p.healthy for p in self.parts)

    def submit(self, x: Any, timeout_s: float | None = None, key: str | bytes | None = None, *,
               direct: bool = False) -> Waiter:
        """:meth:`predict` without the coroutine: what ``x``'s answer will complete (the HTTP
        front adds a callback instead of creating a task per request); Overloaded and CodecError
        raise here. ``direct``: a `Slot` (one callback, run as the answer arrives, without an
        event-loop handle) where it can, else a future."""
        self._check_count()
        n = len(self.parts)
        if n == 1 or key is not None:
            return self.parts[0 if key is None else partition_of(key, n)].submit(x, timeout_s, direct=direct)
        return asyncio.ensure_future(self.predict(x, timeout_s))  # round robin, may retry another partition

    async def predict(self, x: Any, timeout_s: float | None = None, key: str | bytes | None = None) -> Any:
        """Run ``x`` through the pipeline; ``timeout_s``: its deadline (default ``settings.timeout_s``)."""
        self._check_count()
        n = len(self.parts)
        if n == 1 or key is not None:
            return await self.parts[0 if key is None else partition_of(key, n)].predict(x, timeout_s)
        for attempt in range(n):
            part = self.parts[self._next]
            self._next = (self._next + 1) % n
            try:
                return await part.predict(x, timeout_s)
            except Overloaded:
                if attempt == n - 1:  # every partition is over its max_backlog
                    raise
        raise RuntimeError("unreachable: no partition")  # n >= 1, so the loop returns or raises

    async def pipeline_registered(self) -> bool:
        """Whether a worker has registered this pipeline in this Redis (once true, no more round trips)."""
        return await self.parts[0].pipeline_registered()

    async def pipeline_status(self) -> PipelineStatus:
        parts = await asyncio.gather(*(p.pipeline_status() for p in self.parts))
        return merge_status(list(parts))
