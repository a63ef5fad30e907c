"""One view per pipeline a gateway process serves, all kept current by one task of the process (:class:`Views`).

A view holds what the gateway needs of its pipeline without asking Redis per request or per probe:
whether it is registered and its spec (stages, tensors, payload limit, partition count), each
partition's first stage as batch entries are sized by it (its live workers and latest stats entry:
:mod:`gateway.client.sizing`), and the pipeline's latest status (``/readyz``, ``/metrics``, the v2
ready routes, ``Gateway.pipeline_status``).

**One task, a fixed number of connections.** :meth:`Views._run` reads every view on one connection of
its own (one per node on a Redis Cluster, and one more per node for the reads), whatever the number of
pipelines: the specs in one pipelined round trip, then every registered pipeline's partitions in another
(:mod:`broker.status`; on a Redis Cluster each of the two a round trip per node, every pipeline's reads of that
node in it, the nodes at once, each on a client of its own and within ``PARTITION_READ_S``
(:class:`broker.status.NodeReads`), so that a node lost does not close the others' reads, and a node down or
hanging costs a refresh one bound and the pipelines only its partitions, however many it serves). It does so
every ``REFRESH_S``; while requests wait for a pipeline that is not registered yet, it reads the
unregistered ones' specs every ``HURRY_S`` too, and everything again as soon as one turns up.

**How stale.** While Redis answers, a status is at most ``REFRESH_S`` plus one round trip old. A view
that no refresh reached for ``STALE_AFTER_S`` says so: its status is unreachable (readiness 503) and
names the refresher's last error.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any, TypeVar

from broker.commit import ItemExemplar
from broker.connection import RedisSettings, is_cluster_client
from broker.errors import CONNECTION_OR_REPLY_ERRORS, error_text
from broker.keys import Keys
from broker.logs import Throttle
from broker.protocol import now_ms
from broker.refusals import log_refusal_once
from broker.spec import SpecError, StageInfo
from broker.status import (
    UNREACHED,
    NodeReads,
    PartitionQuery,
    PartitionReads,
    Spec,
    node_names,
    read_partitions,
    read_specs,
)
from gateway.monitor.status import PipelineStatus, StatusReader, explain, spec_status

__all__ = ["HURRY_S", "REFRESH_S", "STALE_AFTER_S", "PipelineView", "Views"]

T = TypeVar("T")

log = logging.getLogger("conveyor.gateway")

REFRESH_S = 1.0  # every view is read this often
HURRY_S = 0.1  # the specs of unregistered pipelines this often, while requests wait for one
STALE_AFTER_S = 5.0  # a status no refresh reached for this long is unreachable
MAX_HELD_BATCHES = 100_000  # per stage, the batches kept for a reader (/metrics) that takes none


class PipelineView:
    """One pipeline as the gateway process last read it. ``on_refresh(view)`` runs after each refresh
    that read it (whether it succeeded or not), in the refresher's task."""

    def __init__(self, keys: Keys, batch_entries: bool, on_refresh: Callable[[PipelineView], None]) -> None:
        self.keys = keys
        self.batch_entries = batch_entries  # read the first stage's sizing (GatewaySettings.batch_entries)
        self.on_refresh = on_refresh
        self.spec: Spec = None  # partition 0's: None, not registered (yet); a SpecError, unreadable
        self.specs_read = 0  # how many reads of the spec succeeded (a wait for registration counts them)
        self.sizing: list[tuple[Any, Any] | None] = []  # per partition: its first stage's sizing reads
        self.refreshed_s: float | None = None  # when a refresh last read it (monotonic)
        self.failure: BaseException | None = None  # why the last refresh of it failed; None if it did not
        self.down: frozenset[int] = frozenset()  # partitions the last refresh could not read, the others could
        self._status: PipelineStatus | None = None
        self._batches: dict[int, list[tuple[int, float]]] = {}  # per stage: batches no reader took yet
        self._waits: dict[int, list[tuple[int, int]]] = {}  # per stage: items' waits (bucket, items), the same
        self._exemplars: dict[int, list[ItemExemplar]] = {}  # per stage: sampled items' exemplars, the same
        self._reader = StatusReader(keys)

    @property
    def registered(self) -> bool:
        return self.spec is not None

    @property
    def stages(self) -> list[StageInfo]:
        return self.spec if isinstance(self.spec, list) else []

    @property
    def partitions(self) -> int | None:
        """The partition count its spec says; None until a readable spec was read."""
        return self.stages[0].partitions if self.stages else None

    def take_spec(self, spec: Spec) -> None:
        self.spec = spec
        self.specs_read += 1
        if not self.stages:  # no stage to read: the status says why
            self._done(spec_status(self.keys, spec) or PipelineStatus(True, []))
            self.sizing = []

    def queries(self, now: int) -> list[PartitionQuery]:
        """What a full refresh reads of it (nothing before its spec names stages)."""
        stages = self.stages
        if not stages:
            return []
        first = stages[0]
        return self._reader.queries(stages, now, self.batch_entries and first.batch_entries and first.batch_size >= 2)

    def take_reads(self, reads: Sequence[PartitionReads | BaseException], now: int, nodes: list[str]) -> None:
        status = self._reader.shape(self.stages, reads, now, nodes)
        self.sizing = [None if isinstance(r, BaseException) else r.sizing for r in reads]
        # Partitions out of reach while others are not (a Redis Cluster node down): requests go elsewhere.
        down = frozenset(k for k, r in enumerate(reads) if isinstance(r, BaseException))
        self.down = down if len(down) < len(reads) else frozenset()
        for stage in status.stages:
            _hold(self._batches, stage.index, stage.batches)
            _hold(self._waits, stage.index, stage.item_waits)
            _hold(self._exemplars, stage.index, stage.exemplars)
        self._done(status)

    def _done(self, status: PipelineStatus) -> None:
        self._status = status
        self.refreshed_s = time.monotonic()
        self.failure = None

    def failed(self, exc: BaseException) -> None:
        """A refresh could not read it: batch entries stop until one does (their sizing is unknown)."""
        self.failure = exc
        self.sizing = []

    @property
    def latest(self) -> PipelineStatus | None:
        return self._status

    def unserved_stage(self) -> str | None:
        """The first stage with no live and no loading worker in the latest refresh (None: each has one,
        or nothing read yet): requests for it would wait their whole deadline."""
        status = self._status
        if status is None or not status.reachable:
            return None
        return next((s.name for s in status.stages if s.live_workers == 0 and s.loading_workers == 0), None)

    def status(self) -> PipelineStatus | None:
        """The latest status, with the batches, items' waits and exemplars no reader took yet (taken now:
        each is counted once, however many refreshes or reads came between); None before the first refresh."""
        if self._status is None or self.refreshed_s is None:
            return None if self.failure is None else PipelineStatus(False, [], f"redis unreachable: {self.failure}")
        age_s = time.monotonic() - self.refreshed_s
        if age_s > STALE_AFTER_S:
            why = f"redis unreachable: {self.failure}" if self.failure is not None else "no refresh"
            return PipelineStatus(False, [], f"stale: the gateway's view of this pipeline is {age_s:.1f}s old "
                                             f"({why})")
        status = self._status
        return replace(status, stages=[replace(s, batches=self._batches.pop(s.index, []),
                                               item_waits=self._waits.pop(s.index, []),
                                               exemplars=self._exemplars.pop(s.index, [])) for s in status.stages])


def _hold(kept: dict[int, list[T]], index: int, new: list[T]) -> None:
    """Keep ``new`` for stage ``index``'s next reader, at most the last ``MAX_HELD_BATCHES``."""
    held = kept.setdefault(index, [])
    held += new
    del held[:-MAX_HELD_BATCHES]


class Views:
    """Every view of one gateway process, and the one task that refreshes them on one connection of its own."""

    def __init__(self, redis_url: str) -> None:
        self.redis = RedisSettings(redis_url)
        self.views: list[PipelineView] = []
        self.waiting = 0  # waits for a registration under way (hurry while some pipeline is unregistered)
        self._client: Any = None
        self._nodes: NodeReads | None = None  # on a Redis Cluster: each node's partitions read on its own client
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._asked = False  # a full refresh wanted now
        self._started = 0  # refreshes begun
        self._outcome: asyncio.Future[int] | None = None  # the number of the refresh under way or next, once ended
        self._throttle = Throttle(10.0)
        self._closing = False

    async def start(self) -> None:
        self._closing = False
        # A new event: one waited on is bound to that loop, and a start after a close may be on another loop.
        self._wake = asyncio.Event()
        self._client = self.redis.async_client(1)
        self._nodes = NodeReads(self._client) if is_cluster_client(self._client) else None
        self._outcome = asyncio.get_running_loop().create_future()
        self._task = asyncio.create_task(self._run(), name="conveyor-views")
        self._task.add_done_callback(_ended)

    async def close(self) -> None:
        if self._task is not None:
            # A flag as well as the cancel: a cancel that lands in a command may be absorbed by the client,
            # which completes the command instead; the loop then ends at its next turn.
            self._closing = True
            self._wake.set()
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._nodes is not None:
            await self._nodes.aclose()
            self._nodes = None
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    @property
    def healthy(self) -> bool:
        """False once the refresher has died (a bug: logged): the views go stale."""
        return self._task is not None and not self._task.done()

    def watch(self, keys: Keys, batch_entries: bool, on_refresh: Callable[[PipelineView], None]) -> PipelineView:
        view = PipelineView(keys, batch_entries, on_refresh)
        self.views.append(view)
        return view

    def unwatch(self, view: PipelineView) -> None:
        with contextlib.suppress(ValueError):
            self.views.remove(view)

    async def refreshed(self, view: PipelineView | None = None) -> None:
        """Return once a full refresh that began after this call has ended; raise what it failed with
        on ``view``, if it failed there."""
        target = self._started + 1
        self._asked = True
        self._wake.set()
        while await self.next_refresh() < target:
            pass
        if view is not None and view.failure is not None:
            raise view.failure

    async def next_refresh(self) -> int:
        """Wait for the refresh under way, or the next, to end; its number."""
        if self._outcome is None or not self.healthy:
            raise ConnectionError("the gateway's views are not refreshed (not started, or their task died)")
        return await asyncio.shield(self._outcome)

    @contextlib.contextmanager
    def hurry(self) -> Iterator[None]:
        """While in it: the unregistered pipelines' specs are read every ``HURRY_S``."""
        self.waiting += 1
        self._wake.set()
        try:
            yield
        finally:
            self.waiting -= 1

    async def _run(self) -> None:
        try:
            await self._refresh_forever()
        finally:  # closed, or a bug: whoever waits for a refresh is told
            if self._outcome is not None and not self._outcome.done():
                self._outcome.set_exception(ConnectionError("the gateway's views are no longer refreshed"))
                self._outcome.exception()  # retrieved: no "never retrieved" warning when nobody waited

    async def _refresh_forever(self) -> None:
        next_full_s = 0.0
        while not self._closing:
            now_s = time.monotonic()
            full = self._asked or now_s >= next_full_s
            self._asked = False
            self._started += 1
            try:  # each command bounded by the client's socket timeout
                await self._refresh(full)
            except CONNECTION_OR_REPLY_ERRORS as exc:
                self._failed([v for v in self.views if full or not v.registered], exc)
            if full:
                next_full_s = now_s + REFRESH_S
            outcome, self._outcome = self._outcome, asyncio.get_running_loop().create_future()
            if outcome is not None:
                outcome.set_result(self._started)
            hurry = self.waiting > 0 and any(not v.registered for v in self.views)
            delay_s = HURRY_S if hurry else next_full_s - time.monotonic()
            if delay_s > 0 and not self._asked:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), delay_s)
            self._wake.clear()

    async def _refresh(self, full: bool) -> None:
        """One refresh: every view (``full``), or the specs of the unregistered ones. On a Redis Cluster every
        pipeline's specs, then every pipeline's partitions, are read a round trip per node, the nodes at once: a
        node down or hanging costs the refresh one ``PARTITION_READ_S``, however many pipelines it serves (read
        a pipeline after another, each would pay it, and the views go stale past ``STALE_AFTER_S``)."""
        views = [v for v in self.views if full or not v.registered]
        if not views:
            return
        specs, unreached = await self._specs(views, full)
        for view, spec in zip(views, specs, strict=True):
            if isinstance(spec, BaseException) and not isinstance(spec, SpecError):
                continue
            registered = view.registered
            view.take_spec(spec)
            self._asked |= not full and view.registered and not registered  # read all of it at once
        # An ACL that does not cover that pipeline, or (a Cluster) its spec's node out of reach: only it fails.
        for view, error in [(v, s) for v, s in zip(views, specs, strict=True)
                            if isinstance(s, BaseException) and not isinstance(s, SpecError)]:
            views.remove(view)
            self._failed([view], error)
        now = now_ms()
        queries = [view.queries(now) for view in views] if full else []
        if any(queries):
            flat = [q for qs in queries for q in qs]  # a Cluster's nodes fail apart
            reads = await (self._nodes.read(flat, unreached) if self._nodes is not None
                           else read_partitions(self._client, flat))
            start = 0
            for view, qs in zip(views, queries, strict=True):
                if qs:
                    nodes = node_names(self._client, [q.keys for q in qs])
                    view.take_reads(reads[start:start + len(qs)], now, nodes)
                    start += len(qs)
            await explain(self._client, *(v.latest for v in views if v.latest is not None))
        for view in views:
            view.on_refresh(view)

    async def _specs(self, views: list[PipelineView], full: bool
                     ) -> tuple[list[Spec | BaseException], dict[str, BaseException]]:
        """The views' specs, or why one could not be read (Redis refused it); and on a Redis Cluster the nodes
        found out of reach. There each node's specs are read on its own (:meth:`broker.status.NodeReads.specs`);
        a spec whose node is down, or does not answer within ``PARTITION_READ_S`` (it hangs), is its error, or on
        a full refresh the spec already known, so that the partitions on the other nodes are still read (and the
        view does not go stale waiting for it)."""
        if self._nodes is None:
            return list(await read_specs(self._client, [v.keys for v in views])), {}
        read, unreached = await self._nodes.specs([v.keys for v in views])
        unreached.pop("", None)  # read through the cluster client (redirected): its nodes not told apart
        return [v.spec if isinstance(s, UNREACHED) and full and v.registered else s
                for v, s in zip(views, read, strict=True)], unreached

    def _failed(self, views: list[PipelineView], exc: BaseException) -> None:
        if not log_refusal_once(exc) and self._throttle.allow(type(exc)) is not None:
            log.warning("reading the served pipelines' state failed (will retry in %gs) error=%s", REFRESH_S,
                        error_text(exc))
        for view in views:
            view.failed(exc)
            view.on_refresh(view)


def _ended(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("gateway task %s died: the pipelines' views go stale, readiness 503", task.get_name(),
                  exc_info=task.exception())
