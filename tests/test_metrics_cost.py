"""What a ``/metrics`` scrape costs the gateway's event loop: the batches it brings are counted cheaply
(gateway.monitor.batch_metrics, whose exposition is prometheus-client's `Histogram`'s), and its text is
written off the loop."""

from __future__ import annotations

import asyncio
import random

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from gateway.monitor.batch_metrics import BatchHistograms
from gateway.monitor.metrics import BATCH_DURATION_BUCKETS, BATCH_SIZE_BUCKETS, Metrics
from tests.metrics_statuses import Served, busy_pipeline

STAGE_LABELS = ("pipeline", "index", "stage")


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


@pytest.mark.parametrize("openmetrics", [False, True])
def test_the_loop_runs_while_a_scrape_of_many_pipelines_is_written(openmetrics: bool) -> None:
    """Many pipelines of busy stages: writing their text is the bulk of a scrape, done off the event
    loop, which meanwhile keeps turning (requests are answered) instead of waiting for the whole text. The
    text is the registry's, exactly as `Metrics.render` writes it."""

    async def main() -> None:
        metrics = Metrics(Served({f"p-{n}": busy_pipeline(3) for n in range(50)}))
        turns, scraping = 0, True

        async def turning() -> None:
            nonlocal turns
            while scraping:
                turns += 1
                await asyncio.sleep(0)

        turner = asyncio.create_task(turning())
        await asyncio.sleep(0)
        try:
            before = turns
            text = await asyncio.wait_for(metrics.scrape(openmetrics), 60)
            during = turns - before
        finally:
            scraping = False
            await turner
        assert text == metrics.render(openmetrics)
        assert text.count(b"\n") > 10_000
        assert during > 100, f"the loop turned {during} times while {len(text)} bytes were written"

    asyncio.run(main())
