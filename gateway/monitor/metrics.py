"""Prometheus metrics of one gateway, on its own CollectorRegistry.

Why a per-server registry and never prometheus-client's global one: tests (and embedders) run
several gateways in one process, and the global registry refuses a second metric of the same
name. Each `Metrics` owns its registry; ``/metrics`` renders exactly that registry.

Two kinds of numbers live here:

- request metrics the HTTP front observes itself (`observe_request`): requests by route and
  outcome, end-to-end latency, open connections; in-flight predictions are read from the
  backend at scrape time through a gauge callback, so they can never drift.
- pipeline metrics (per stage backlog, pending, consumers, live workers, dead letters, batch
  size and duration) that only Redis knows. They are taken right before exposition (`refresh`
  then `render`) from each pipeline's status as the gateway process's views last read it
  (:mod:`gateway.client.view`: about once a second, by one task for every pipeline), so a scrape
  costs no Redis round trip and its numbers are at most about a second old.

A gateway run as ``--processes N`` passes each process a `SiblingCounts`: its scrapes then answer the sum of
the per-process numbers over all N processes (:mod:`gateway.monitor.process_counts` says which and how);
without one (one process, the default) nothing of it runs.

A status's ``batches`` are the batches *since the last read*: whoever reads a status must
feed it to `update`, or those batches are lost to the histograms. That is why ``/readyz``
passes its statuses here too. A process serving several pipelines labels every pipeline number
with ``pipeline``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import Metric
from prometheus_client.openmetrics.exposition import CONTENT_TYPE_LATEST as OPENMETRICS_CONTENT_TYPE
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_latest
from prometheus_client.registry import Collector

from broker.logs import Throttle
from gateway.backends import Backend, Backends, as_backends
from gateway.monitor.batch_metrics import BatchHistograms
from gateway.monitor.item_metrics import ItemHistograms
from gateway.monitor.process_counts import ProcessCounts, SiblingCounts, merge, replace_families
from gateway.monitor.request_metrics import RequestMetrics

__all__ = [
    "CONTENT_TYPE",
    "LATENCY_BUCKETS",
    "OPENMETRICS_CONTENT_TYPE",
    "Metrics",
    "PipelineStatusLike",
    "StageStatusLike",
    "Unreadable",
    "read_statuses",
]

log = logging.getLogger(__name__)

CONTENT_TYPE = CONTENT_TYPE_LATEST
# Model serving spans sub-millisecond lookups to minute-long generations: cover both ends.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                   120.0)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
# Batches of light stages take tens of microseconds: start well below the request latency buckets.
BATCH_DURATION_BUCKETS = (0.00001, 0.00005, 0.0001, 0.00025, 0.0005, *LATENCY_BUCKETS)
STAGE_LABELS = ("pipeline", "index", "stage")


class StageStatusLike(Protocol):
    """What metrics read of `gateway.monitor.status.StageStatus` (read-only, so the dataclass fits)."""

    @property
    def index(self) -> int: ...
    @property
    def name(self) -> str: ...
    @property
    def backlog(self) -> int: ...
    @property
    def pending(self) -> int: ...
    @property
    def consumers(self) -> int: ...
    @property
    def live_workers(self) -> int: ...
    @property
    def dead_letters(self) -> int: ...
    @property
    def stuck_workers(self) -> int: ...
    @property
    def stage_errors(self) -> int: ...
    @property
    def batch_length_errors(self) -> int: ...
    @property
    def cancelled(self) -> int: ...
    @property
    def results_kept(self) -> int: ...
    @property
    def workers_wanted(self) -> int: ...
    @property
    def workers_max(self) -> int: ...
    @property
    def batches(self) -> Sequence[tuple[int, float]]: ...


class PipelineStatusLike(Protocol):
    """What metrics and ``/readyz`` read of `gateway.monitor.status.PipelineStatus`."""

    @property
    def reachable(self) -> bool: ...
    @property
    def stages(self) -> Sequence[StageStatusLike]: ...
    @property
    def ready(self) -> bool: ...
    @property
    def not_ready_stages(self) -> list[str]: ...


@dataclass
class Unreadable:
    """The status of a pipeline whose status could not be read (Redis unreachable, or too slow)."""

    error: str
    reachable: bool = False
    ready: bool = False
    stages: Sequence[StageStatusLike] = ()
    not_ready_stages: list[str] = field(default_factory=list)


async def read_statuses(backends: Backends, timeout_s: float) -> dict[str, PipelineStatusLike]:
    """Every served pipeline's status, read concurrently, each bounded by ``timeout_s`` (an
    `Unreadable` one past it)."""
    names = backends.names()

    async def one(name: str) -> PipelineStatusLike:
        backend = backends.get(name)
        try:
            if backend is None:
                raise LookupError(f"pipeline {name!r} is no longer served")
            status: PipelineStatusLike = await asyncio.wait_for(backend.pipeline_status(), timeout_s)
        except Exception as exc:  # a scrape or a readiness probe must still answer: "unreachable"
            log.warning("pipeline status unavailable pipeline=%s error=%s: %s", name, type(exc).__name__, exc)
            return Unreadable(f"{type(exc).__name__}: {exc}")
        return status

    return dict(zip(names, await asyncio.gather(*(one(n) for n in names)), strict=True))


class Metrics:
    """All metrics of one gateway process, on a private registry.

    ``namespace`` prefixes every name (default ``conveyor``). ``status_timeout_s`` bounds the
    wait for a pipeline's status (a backend that reads Redis for it, or a view not read yet): a
    scrape that hangs would make Prometheus mark the target down, when the interesting news is
    "Redis unreachable", which ``conveyor_redis_reachable`` says. ``siblings``: the processes of a
    ``--processes N`` gateway, whose per-process numbers a scrape sums (None: this process is the gateway).
    """

    def __init__(self, backend: Backend | Backends, *, namespace: str = "conveyor",
                 status_timeout_s: float = 5.0, siblings: SiblingCounts | None = None) -> None:
        self.backend = as_backends(backend)
        self.status_timeout_s = status_timeout_s
        self.siblings = siblings
        self._publish_failed = Throttle(60.0)
        self.registry = CollectorRegistry(auto_describe=True)
        self._open_connections = 0
        ns, reg = namespace, self.registry
        # Requests by route and outcome, and predict latency: lock-free counts (gateway.monitor.request_metrics).
        self.requests = RequestMetrics(ns, LATENCY_BUCKETS)
        reg.register(self.requests)
        self.observe_request = self.requests.observe  # bound once: one Python call per request, not two
        self.in_flight = Gauge(f"{ns}_gateway_in_flight", "Predictions submitted and not yet answered.",
                               registry=reg)
        self.in_flight.set_function(self._read_in_flight)
        self.rejected_connections = Counter(f"{ns}_gateway_rejected_connections",
                                            "Connections answered 503 at once (connection cap or draining).",
                                            registry=reg)
        self.resent = Gauge(f"{ns}_gateway_requests_resent", "Requests sent again because Redis lost them "
                            "(gateway.client.recall), since start.", registry=reg)
        self.resent.set_function(lambda: self._hub_count("resent"))
        self.late_answers = Gauge(f"{ns}_gateway_late_answers", "Answers that came after their request was "
                                  "answered (a request run twice) or expired, since start.", registry=reg)
        self.late_answers.set_function(lambda: self._hub_count("late"))
        self.connections = Gauge(f"{ns}_gateway_open_connections", "Open HTTP connections.", registry=reg)
        self.connections.set_function(lambda: float(self._open_connections))
        # This process's share of the gateway: summed over the processes of a --processes N gateway.
        self._own_gauges: dict[str, Callable[[], float]] = {
            f"{ns}_gateway_in_flight": self._read_in_flight,
            f"{ns}_gateway_open_connections": lambda: float(self._open_connections),
            f"{ns}_gateway_requests_resent": lambda: self._hub_count("resent"),
            f"{ns}_gateway_late_answers": lambda: self._hub_count("late"),
        }
        self.reachable = Gauge(f"{ns}_redis_reachable", "1 if the last status read reached Redis.",
                               registry=reg)
        self.ready = Gauge(f"{ns}_pipeline_ready",
                           "1 if Redis is reachable and every stage has a live worker.", ["pipeline"], registry=reg)
        self._stage_gauges = {
            "backlog": Gauge(f"{ns}_stage_backlog",
                             "Entries in the stage stream not yet delivered to a worker.", STAGE_LABELS,
                             registry=reg),
            "pending": Gauge(f"{ns}_stage_pending", "Entries delivered to a worker and not yet acked.",
                             STAGE_LABELS, registry=reg),
            "consumers": Gauge(f"{ns}_stage_consumers", "Consumers in the stage's consumer group.",
                               STAGE_LABELS, registry=reg),
            "live_workers": Gauge(f"{ns}_stage_live_workers", "Workers with a recent heartbeat.",
                                  STAGE_LABELS, registry=reg),
            "dead_letters": Gauge(f"{ns}_stage_dead_letters", "Entries in the stage's dead-letter stream.",
                                  STAGE_LABELS, registry=reg),
            "stuck_workers": Gauge(f"{ns}_stage_stuck_workers",
                                   "Workers found stuck in predict, or frozen, and being replaced.",
                                   STAGE_LABELS, registry=reg),
            "stage_errors": Gauge(f"{ns}_stage_errors", "Items whose predict raised, in total (kept in Redis).",
                                  STAGE_LABELS, registry=reg),
            "batch_length_errors": Gauge(f"{ns}_stage_batch_length_errors",
                                         "Batched predict calls that returned the wrong number of results, in "
                                         "total (kept in Redis).", STAGE_LABELS, registry=reg),
            "cancelled": Gauge(f"{ns}_stage_cancelled", "Items dropped because their callers left (disconnected, "
                               "cancelled, stopped reading a stream), in total (kept in Redis).", STAGE_LABELS,
                               registry=reg),
            "results_kept": Gauge(f"{ns}_stage_results_kept", "Results not written because their key held an "
                                  "answer: a request id reused within result_ttl_ms, or a run again after a worker "
                                  "died past its write, in total (kept in Redis).", STAGE_LABELS, registry=reg),
            "workers_wanted": Gauge(f"{ns}_stage_autoscale_workers",
                                    "Workers its autoscaling supervisors run now (0: not autoscaled).", STAGE_LABELS,
                                    registry=reg),
            "workers_max": Gauge(f"{ns}_stage_autoscale_max_workers",
                                 "The most workers its autoscaling supervisors may run.", STAGE_LABELS, registry=reg),
        }
        self.level_backlog = Gauge(f"{ns}_stage_level_backlog", "Entries (waiting or pending) in the stage's "
                                   "stream of a priority level above the default (pipelines with priority_levels).",
                                   [*STAGE_LABELS, "level"], registry=reg)
        # Partitioned pipelines (gateway.client.gateway): the stage gauges above are totals; these the parts.
        self._partition_gauges = {
            attr: Gauge(f"{ns}_partition_{attr}", f"Per partition: {help_}", [*STAGE_LABELS, "partition"],
                        registry=reg)
            for attr, help_ in (("backlog", "entries not yet delivered to a worker."),
                                ("pending", "entries delivered and not yet acked."),
                                ("live_workers", "workers with a recent heartbeat in this partition."))
        }
        self.items = ItemHistograms(ns)  # per item: stream wait, predict share, with exemplars
        reg.register(self.items)
        # Per batch: items and wall time, lock-free counts (gateway.monitor.batch_metrics).
        self.batches = BatchHistograms(ns, BATCH_SIZE_BUCKETS, BATCH_DURATION_BUCKETS)
        reg.register(self.batches)

    def _hub_count(self, which: str) -> float:
        hub = getattr(self.backend, "hub", None)  # gateway.client.Pipelines, or a Single Gateway's
        if hub is None:
            return 0.0
        return float(hub.recall.resubmitted if which == "resent" else hub.late_answers)

    def _read_in_flight(self) -> float:
        """Gauge callback: a broken backend must not break the whole scrape."""
        try:
            return float(self.backend.in_flight)
        except Exception:  # pragma: no cover - defensive
            log.exception("reading backend.in_flight failed")
            return float("nan")

    # -- request side ---------------------------------------------------------------------------

    def connection_opened(self) -> None:
        self._open_connections += 1

    def connection_closed(self) -> None:
        self._open_connections -= 1

    # -- pipeline side --------------------------------------------------------------------------

    def update(self, statuses: Mapping[str, PipelineStatusLike]) -> None:
        """Set the pipeline gauges from one status per pipeline and feed their new batches to the
        histograms.

        Every pipeline gauge is cleared first: a stage that vanished (or an unreachable Redis) must
        not keep reporting its last numbers as if they were current.
        """
        self.reachable.set(1.0 if statuses and all(s.reachable for s in statuses.values()) else 0.0)
        for gauge in (self.ready, self.level_backlog, *self._stage_gauges.values(), *self._partition_gauges.values()):
            gauge.clear()
        for name, status in statuses.items():
            self.ready.labels(name).set(1.0 if status.ready else 0.0)
            self._update_stages(name, status)

    def _update_stages(self, name: str, status: PipelineStatusLike) -> None:
        for stage in status.stages:
            labels = (name, str(stage.index), stage.name)
            for attr, gauge in self._stage_gauges.items():
                gauge.labels(*labels).set(float(getattr(stage, attr)))
            for level, entries in (getattr(stage, "level_backlog", None) or {}).items():
                self.level_backlog.labels(*labels, str(level)).set(float(entries))
            self.batches.observe(labels, stage.batches)
            self.items.observe(labels, stage.batches, getattr(stage, "item_waits", ()), getattr(stage, "exemplars", ()))
        for partition, part in enumerate(getattr(status, "by_partition", None) or ()):
            for stage in part.stages:
                for attr, gauge in self._partition_gauges.items():
                    gauge.labels(name, str(stage.index), stage.name, str(partition)).set(float(getattr(stage, attr)))

    async def refresh(self) -> dict[str, PipelineStatusLike]:
        """Read every pipeline's status (each bounded by ``status_timeout_s``) and `update` from them."""
        statuses = await read_statuses(self.backend, self.status_timeout_s)
        self.update(statuses)
        return statuses

    def render(self, openmetrics: bool = False) -> bytes:
        """The registry in the Prometheus text format (serve with `CONTENT_TYPE`), or in OpenMetrics
        (`OPENMETRICS_CONTENT_TYPE`), which carries the item histograms' exemplars."""
        return openmetrics_latest(self.registry) if openmetrics else generate_latest(self.registry)

    async def scrape(self, openmetrics: bool = False) -> bytes:
        """What ``GET /metrics`` answers: refresh from the pipelines' statuses, then render.

        The numbers are collected on the event loop (its tasks are their only writers), the text is
        written in a thread from that copy: writing it is most of a scrape's cost, and grows with the
        stages served, while the loop must keep answering requests. With siblings, this process's numbers
        are published first (so that no later scrape, at any process, shows less of them), and the
        per-process families are replaced by their sums over the processes, in the thread too."""
        await self.refresh()
        collected = list(self.registry.collect())
        if self.siblings is None:
            return await asyncio.to_thread(_format, _Collected(collected), openmetrics)
        own = self.process_counts()
        self.publish(own)
        return await asyncio.to_thread(self._format_summed, collected, own, self.siblings, openmetrics)

    # -- the processes of one gateway -------------------------------------------------------------

    def process_counts(self) -> ProcessCounts:
        """This process's per-process numbers, copied (gateway.monitor.process_counts: what is summed)."""
        rejected = next(iter(self.rejected_connections.collect()))
        total = created = 0.0
        for sample in rejected.samples:
            if sample.name.endswith("_total"):
                total = sample.value
            elif sample.name.endswith("_created"):
                created = sample.value
        return ProcessCounts(self.requests.snapshot(), {rejected.name: (total, created)},
                             {name: read() for name, read in self._own_gauges.items()})

    def publish(self, counts: ProcessCounts | None = None) -> None:
        """Write this process's numbers (``counts``, else taken now) for its siblings to read; nothing
        without siblings. A directory that cannot be written is logged (once a minute), not raised: the
        scrape still answers, with siblings seeing this process's last snapshot."""
        if self.siblings is None:
            return
        try:
            self.siblings.publish(counts if counts is not None else self.process_counts())
        except OSError as exc:
            if self._publish_failed.allow("publish") is not None:
                log.warning("cannot publish this process's counts directory=%s error=%s",
                            self.siblings.settings.directory, exc)

    async def publish_periodically(self) -> None:
        """`publish` every ``siblings.settings.period_s`` until cancelled (returns at once without siblings):
        a scrape at a sibling then shows this process's numbers at most that old."""
        if self.siblings is None:
            return
        while True:
            await asyncio.sleep(self.siblings.settings.period_s)
            self.publish()

    def _format_summed(self, collected: list[Metric], own: ProcessCounts, siblings: SiblingCounts,
                       openmetrics: bool) -> bytes:
        total = merge([own, *siblings.others()])
        summed = replace_families(collected, total, self.requests.render(total.requests))
        return _format(_Collected(summed), openmetrics)


class _Collected(Collector):
    """A registry's metrics as collected once: what the exposition writers read (their ``collect``)."""

    def __init__(self, metrics: list[Metric]) -> None:
        self.metrics = metrics

    def collect(self) -> list[Metric]:
        return self.metrics


def _format(collected: _Collected, openmetrics: bool) -> bytes:
    return openmetrics_latest(collected) if openmetrics else generate_latest(collected)

