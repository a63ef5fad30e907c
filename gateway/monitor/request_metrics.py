"""The HTTP front's per-request metrics: a count by route and outcome, a latency histogram by outcome.

Why not prometheus-client's `Counter` and `Histogram`: every ``inc`` and ``observe`` takes a
lock (a `MutexValue` per bucket, sum and count) and checks labels, ~5% of the front's CPU at 256
connections. The event loop is the only writer, so plain integers suffice: a request costs a
dict lookup, an increment and a ``bisect`` (the bucket), and the cumulative buckets are summed
only when ``/metrics`` is scraped. This collector renders exactly what the two prometheus-client
metrics rendered (same names, help, labels, buckets, ``_created`` series), and every number is
exact at the moment of the scrape: nothing is sampled or deferred past it.

The numbers are one process's. A gateway run as ``--processes N`` renders the sum over its processes
instead (:mod:`gateway.monitor.process_counts`): `snapshot` copies these numbers, off the request
path, and `render` writes any `RequestCounts`, this process's or a sum.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from prometheus_client.metrics_core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

__all__ = ["Latency", "RequestCounts", "RequestMetrics"]


@dataclass(slots=True)
class Latency:
    """One outcome's histogram: non-cumulative bucket counts (the last one is ``+Inf``), the sum of the
    durations, and when it was created (Unix seconds)."""

    buckets: list[int]
    sum_s: float
    created_s: float


@dataclass
class RequestCounts:
    """Requests by (route, outcome) with their creation times (Unix seconds), and latency by outcome: one
    process's numbers, or several processes' summed."""

    counts: dict[tuple[str, str], int]
    created_s: dict[tuple[str, str], float]
    latency: dict[str, Latency]


class RequestMetrics(Collector):
    """``{namespace}_gateway_requests_total`` and ``{namespace}_gateway_request_duration_seconds``."""

    def __init__(self, namespace: str, buckets: Sequence[float]) -> None:
        self._requests_name = f"{namespace}_gateway_requests"
        self._latency_name = f"{namespace}_gateway_request_duration_seconds"
        self._bounds = tuple(float(b) for b in buckets)
        self._le = [*(floatToGoString(b) for b in self._bounds), "+Inf"]
        self._counts: dict[tuple[str, str], int] = {}
        self._created: dict[tuple[str, str], float] = {}
        self._latency: dict[str, Latency] = {}

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
                latency = self._latency[outcome] = Latency([0] * len(self._le), 0.0, time.time())
            latency.buckets[bisect_left(self._bounds, duration_s)] += 1  # le: the first bound >= it
            latency.sum_s += duration_s

    def snapshot(self) -> RequestCounts:
        """A copy of this process's numbers, to publish to sibling processes (not on the request path)."""
        return RequestCounts(dict(self._counts), dict(self._created),
                             {outcome: Latency(list(hist.buckets), hist.sum_s, hist.created_s)
                              for outcome, hist in self._latency.items()})

    def _families(self) -> tuple[CounterMetricFamily, HistogramMetricFamily]:
        return (CounterMetricFamily(self._requests_name, "HTTP requests answered, by route and outcome.",
                                    labels=("route", "outcome")),
                HistogramMetricFamily(self._latency_name, "End-to-end latency of predict requests (request head "
                                      "read to response written), by outcome.", labels=("outcome",)))

    def describe(self) -> Iterable[Metric]:
        """The names, for the registry's duplicate check (without it, the registry would collect)."""
        return self._families()

    def collect(self) -> Iterable[Metric]:
        return self.render(RequestCounts(self._counts, self._created, self._latency))

    def render(self, counts: RequestCounts) -> tuple[Metric, Metric]:
        """The two families of ``counts`` (this process's, or a sum of several processes' numbers)."""
        requests, latency = self._families()
        for (route, outcome), count in counts.counts.items():
            requests.add_metric((route, outcome), count, created=counts.created_s[(route, outcome)])
        for outcome, hist in counts.latency.items():
            cumulative, total = [], 0
            for le, count in zip(self._le, hist.buckets, strict=True):
                total += count
                cumulative.append((le, float(total)))
            latency.add_metric((outcome,), cumulative, hist.sum_s)
            # Right after its label set's samples: OpenMetrics wants each set's lines together.
            latency.samples.append(Sample(f"{self._latency_name}_created", {"outcome": outcome}, hist.created_s))
        return requests, latency
