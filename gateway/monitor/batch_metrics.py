"""Each stage's batch histograms: items per batch and wall time per batch, by pipeline and stage.

Why not prometheus-client's `Histogram`: every batch of every stage since the last read is observed at
once, in the scrape (or ``/readyz``) that reads the statuses, on the event loop that serves the requests.
A busy singleton stage brings up to ``gateway.client.view.MAX_HELD_BATCHES`` batches to one scrape, and
through `Histogram` each costs a ``labels`` lookup and a lock per bucket, sum and count: the loop would
answer no request meanwhile. Plain integers suffice (the event loop is the only writer, as in
:mod:`gateway.monitor.request_metrics`): a batch costs two ``bisect`` and a few additions. The exposition
is prometheus-client's `Histogram`'s, line for line (names, help, labels, buckets, ``_created`` series).
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Iterable, Sequence

from prometheus_client.metrics_core import HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

__all__ = ["BatchHistograms"]

Labels = tuple[str, str, str]  # pipeline, stage index, stage name
LABEL_NAMES = ("pipeline", "index", "stage")


class _Counts:
    """One stage's histogram: non-cumulative bucket counts (the last one is ``+Inf``) and the sum."""

    __slots__ = ("buckets", "created", "sum")

    def __init__(self, size: int) -> None:
        self.buckets = [0] * size
        self.sum = 0.0
        self.created = time.time()


class _Family:
    """One histogram family's bounds and its stages' counts."""

    def __init__(self, name: str, help_: str, bounds: Sequence[float]) -> None:
        self.name, self.help = name, help_
        self.bounds = tuple(float(b) for b in bounds)
        self.le = [*(floatToGoString(b) for b in self.bounds), "+Inf"]
        self.counts: dict[Labels, _Counts] = {}

    def stage(self, labels: Labels) -> _Counts:
        counts = self.counts.get(labels)
        if counts is None:
            counts = self.counts[labels] = _Counts(len(self.le))
        return counts

    def family(self) -> HistogramMetricFamily:
        return HistogramMetricFamily(self.name, self.help, labels=LABEL_NAMES)

    def collect(self) -> HistogramMetricFamily:
        family = self.family()
        for labels, counts in self.counts.items():
            cumulative, total = [], 0
            for le, count in zip(self.le, counts.buckets, strict=True):
                total += count
                cumulative.append((le, float(total)))
            family.add_metric(labels, cumulative, counts.sum)
            # Right after its label set's samples: OpenMetrics wants each set's lines together.
            family.samples.append(Sample(f"{self.name}_created", dict(zip(LABEL_NAMES, labels, strict=True)),
                                         counts.created))
        return family


class BatchHistograms(Collector):
    """``{namespace}_stage_batch_size`` and ``{namespace}_stage_batch_duration_seconds``."""

    def __init__(self, namespace: str, size_buckets: Sequence[float], duration_buckets: Sequence[float]) -> None:
        self._size = _Family(f"{namespace}_stage_batch_size", "Items per batch a stage ran.", size_buckets)
        self._duration = _Family(f"{namespace}_stage_batch_duration_seconds", "Wall time of one batch.",
                                 duration_buckets)

    def observe(self, labels: Labels, batches: Sequence[tuple[int, float]]) -> None:
        """A stage's batches (size, seconds) since the last read; a stage with none gets no series yet."""
        if not batches:
            return
        sizes, durations = self._size.stage(labels), self._duration.stage(labels)
        size_bounds, duration_bounds = self._size.bounds, self._duration.bounds
        size_buckets, duration_buckets = sizes.buckets, durations.buckets
        size_sum, duration_sum = sizes.sum, durations.sum
        for size, seconds in batches:
            size_buckets[bisect_left(size_bounds, size)] += 1  # le: the first bound >= it
            size_sum += size
            duration_buckets[bisect_left(duration_bounds, seconds)] += 1
            duration_sum += seconds
        sizes.sum, durations.sum = size_sum, duration_sum

    def describe(self) -> Iterable[Metric]:
        """The names, for the registry's duplicate check (without it, the registry would collect)."""
        return self._size.family(), self._duration.family()

    def collect(self) -> Iterable[Metric]:
        return self._size.collect(), self._duration.collect()
