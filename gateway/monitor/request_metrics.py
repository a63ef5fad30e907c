"""The HTTP front's per-request metrics: a count by route and outcome, a latency histogram by outcome.

Why not prometheus-client's `Counter` and `Histogram`: every ``inc`` and ``observe`` takes a
lock (a `MutexValue` per bucket, sum and count) and checks labels, ~5% of the front's CPU at 256
connections. The event loop is the only writer, so plain integers suffice: a request costs a
dict lookup, an increment and a ``bisect`` (the bucket), and the cumulative buckets are summed
only when ``/metrics`` is scraped. This collector renders exactly what the two prometheus-client
metrics rendered (same names, help, labels, buckets, ``_created`` series), and every number is
exact at the moment of the scrape: nothing is sampled or deferred past it.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Iterable, Sequence

from prometheus_client.metrics_core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

__all__ = ["RequestMetrics"]


class _Latency:
    """One outcome's histogram: non-cumulative bucket counts (the last one is ``+Inf``) and the sum."""

    __slots__ = ("buckets", "created", "sum")

    def __init__(self, size: int) -> None:
        self.buckets = [0] * size
        self.sum = 0.0
        self.created = time.time()


class RequestMetrics(Collector):
    """``{namespace}_gateway_requests_total`` and ``{namespace}_gateway_request_duration_seconds``."""

    def __init__(self, namespace: str, buckets: Sequence[float]) -> None:
        self._requests_name = f"{namespace}_gateway_requests"
        self._latency_name = f"{namespace}_gateway_request_duration_seconds"
        self._bounds = tuple(float(b) for b in buckets)
        self._le = [*(floatToGoString(b) for b in self._bounds), "+Inf"]
        self._counts: dict[tuple[str, str], int] = {}
        self._created: dict[tuple[str, str], float] = {}
        self._latency: dict[str, _Latency] = {}

    def observe(self, route: str, outcome: str, duration_s: float | None = None) -> None:
        """Count one answered request; predict requests also pass their end-to-end duration."""
        key = (route, outcome)
        count = self._counts.get(key)
        if count is None:
            self._created[key] = time.time()
            count = 0
        self._counts[key] = count + 1
        if duration_s is not None:
            latency = self._latency.get(outcome)
            if latency is None:
                latency = self._latency[outcome] = _Latency(len(self._le))
            latency.buckets[bisect_left(self._bounds, duration_s)] += 1  # le: the first bound >= it
            latency.sum += duration_s

    def _families(self) -> tuple[CounterMetricFamily, HistogramMetricFamily]:
        return (CounterMetricFamily(self._requests_name, "HTTP requests answered, by route and outcome.",
                                    labels=("route", "outcome")),
                HistogramMetricFamily(self._latency_name, "End-to-end latency of predict requests (request head "
                                      "read to response written), by outcome.", labels=("outcome",)))

    def describe(self) -> Iterable[Metric]:
        """The names, for the registry's duplicate check (without it, the registry would collect)."""
        return self._families()

    def collect(self) -> Iterable[Metric]:
        requests, latency = self._families()
        for (route, outcome), count in self._counts.items():
            requests.add_metric((route, outcome), count, created=self._created[(route, outcome)])
        for outcome, hist in self._latency.items():
            cumulative, total = [], 0
            for le, count in zip(self._le, hist.buckets, strict=True):
                total += count
                cumulative.append((le, float(total)))
            latency.add_metric((outcome,), cumulative, hist.sum)
            # Right after its label set's samples: OpenMetrics wants each set's lines together.
            latency.samples.append(Sample(f"{self._latency_name}_created", {"outcome": outcome}, hist.created))
        return requests, latency
