"""What a ``/metrics`` scrape costs the gateway's event loop: the batches it brings are counted cheaply
(gateway.monitor.batch_metrics, whose exposition is prometheus-client's `Histogram`'s)."""

from __future__ import annotations

import random
import time
from bisect import bisect_left
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from gateway.client.view import MAX_HELD_BATCHES
from gateway.monitor.batch_metrics import BatchHistograms
from gateway.monitor.metrics import BATCH_DURATION_BUCKETS, BATCH_SIZE_BUCKETS, Metrics
from gateway.monitor.status import PipelineStatus, StageStatus

STAGE_LABELS = ("pipeline", "index", "stage")


class _NoBackend:
    in_flight = 0

    async def pipeline_status(self) -> PipelineStatus:
        return PipelineStatus(False)


def _samples(registry: CollectorRegistry) -> list[str]:
    """Exposition lines without the ``_created`` values (creation times differ by construction)."""
    lines = generate_latest(registry).decode().splitlines()
    return [line.rsplit(" ", 1)[0] if "_created{" in line else line for line in lines]


def test_same_exposition_as_prometheus_client() -> None:
    ours = CollectorRegistry()
    batches = BatchHistograms("conveyor", BATCH_SIZE_BUCKETS, BATCH_DURATION_BUCKETS)
    ours.register(batches)
    theirs = CollectorRegistry()
    size = Histogram("conveyor_stage_batch_size", "Items per batch a stage ran.", STAGE_LABELS,
                     buckets=BATCH_SIZE_BUCKETS, registry=theirs)
    duration = Histogram("conveyor_stage_batch_duration_seconds", "Wall time of one batch.", STAGE_LABELS,
                         buckets=BATCH_DURATION_BUCKETS, registry=theirs)
    rng = random.Random(7)
    stages = [("p", "0", "a"), ("p", "1", 'b"\\\n'), ("q", "0", "a")]
    edges = [(int(b), d) for b, d in zip(BATCH_SIZE_BUCKETS, BATCH_DURATION_BUCKETS, strict=False)]
    for turn in range(5):
        for labels in stages:
            sent = [(rng.randint(1, 2000), rng.expovariate(50)) for _ in range(300)] + (edges if turn == 0 else [])
            batches.observe(labels, sent)
            for n, seconds in sent:
                size.labels(*labels).observe(n)
                duration.labels(*labels).observe(seconds)
    batches.observe(("r", "0", "idle"), [])  # no batch yet: no series yet, as a Histogram never labelled
    assert _samples(ours) == _samples(theirs)


def _cpu_s(work: Callable[[], object]) -> float:
    started = time.process_time()
    work()
    return time.process_time() - started


def test_a_scrape_of_a_busy_stages_held_batches_costs_the_loop_little() -> None:
    """The most batches a view holds for one stage, fed to the metrics as a scrape does, cost the loop
    about what a bisect per batch costs, not a locked observe per bucket, sum and count. Measured in CPU
    time (a busy machine must not fail it), against a bare bisect per batch (nor a slow machine), the best
    of a few tries."""
    rng = random.Random(3)
    held = [(1, rng.randrange(20, 90) / 1e6) for _ in range(MAX_HELD_BATCHES)]

    def bisect_each() -> None:
        for _, seconds in held:
            bisect_left(BATCH_DURATION_BUCKETS, seconds)

    def feed() -> Metrics:
        metrics = Metrics(_NoBackend())
        metrics.update({"p": PipelineStatus(True, [StageStatus(0, "singleton", live_workers=1, batches=held)])})
        return metrics

    text = feed().render().decode()
    assert f'conveyor_stage_batch_size_count{{index="0",pipeline="p",stage="singleton"}} {MAX_HELD_BATCHES:.1f}' in text
    baseline = min(_cpu_s(bisect_each) for _ in range(3))
    spent = min(_cpu_s(feed) for _ in range(3))
    assert spent < 12 * baseline, f"{MAX_HELD_BATCHES} batches: {spent:.3f} s of CPU, a bisect each {baseline:.3f} s"
