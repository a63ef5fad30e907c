"""Per-item histograms of each stage: an item's wait in the stage's stream and its share of the
``predict`` call that ran it, with OpenMetrics exemplars carrying a sampled request's trace id.

Why per item and not only per batch (``conveyor_stage_batch_duration_seconds``): a request's latency
is its items' waits and calls, and a batch of 64 is 64 items that each waited for it. The workers
send what this needs in their stats entries (:class:`broker.commit.BatchStats`: the waits as
histogram counts per ~100 ms, the predict time as each batch's size and duration, no Redis command
per item); an item's share of a call is the call's duration over its size. Exemplars are the last
traced item per bucket per stats period, so a scrape shows at most one per bucket: the latest.
Exemplars reach only an OpenMetrics scrape (``Accept: application/openmetrics-text``); the classic
text format has none. Plain integers, no locks: as :mod:`gateway.monitor.request_metrics`, the event
loop is the only writer.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from prometheus_client.metrics_core import HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Exemplar
from prometheus_client.utils import floatToGoString

from broker.commit import ITEM_BUCKETS_S, ItemExemplar, bucket_of

__all__ = ["ItemHistograms"]

Labels = tuple[str, str, str]  # pipeline, stage index, stage name


class _Histogram:
    __slots__ = ("buckets", "exemplars", "sum")

    def __init__(self) -> None:
        self.buckets = [0] * (len(ITEM_BUCKETS_S) + 1)
        self.sum = 0.0
        self.exemplars: dict[int, tuple[str, float]] = {}


class ItemHistograms(Collector):
    """``{ns}_stage_item_wait_seconds`` and ``{ns}_stage_item_predict_seconds``, by pipeline and stage."""

    def __init__(self, namespace: str) -> None:
        self._names = {"w": f"{namespace}_stage_item_wait_seconds", "p": f"{namespace}_stage_item_predict_seconds"}
        self._help = {"w": "Time an item waited in the stage's stream, from its entry's id to its batch's predict.",
                      "p": "An item's share of the predict call that ran it (the call's duration over its size)."}
        self._le = [*(floatToGoString(b) for b in ITEM_BUCKETS_S), "+Inf"]
        self._hists: dict[tuple[str, Labels], _Histogram] = {}

    def _hist(self, kind: str, labels: Labels) -> _Histogram:
        hist = self._hists.get((kind, labels))
        if hist is None:
            hist = self._hists[(kind, labels)] = _Histogram()
        return hist

    def observe(self, labels: Labels, batches: Sequence[tuple[int, float]], waits: Sequence[tuple[int, int]],
                exemplars: Sequence[ItemExemplar]) -> None:
        """A stage's batches (size, seconds), waits (bucket, items) and exemplars since the last read."""
        if batches:
            predict = self._hist("p", labels)
            for size, seconds in batches:
                share = seconds / size if size else seconds
                predict.buckets[bucket_of(share)] += size
                predict.sum += seconds
        if waits:
            wait = self._hist("w", labels)
            last = len(wait.buckets) - 1
            for bucket, items in waits:
                wait.buckets[min(max(bucket, 0), last)] += items
                wait.sum += items * (ITEM_BUCKETS_S[bucket] if bucket < last else ITEM_BUCKETS_S[-1])
        for kind, bucket, trace_id, seconds in exemplars:
            if kind in self._names and 0 <= bucket <= len(ITEM_BUCKETS_S):
                self._hist(kind, labels).exemplars[bucket] = (trace_id, seconds)

    def describe(self) -> Iterable[Metric]:
        return [HistogramMetricFamily(self._names[k], self._help[k], labels=("pipeline", "index", "stage"))
                for k in ("w", "p")]

    def collect(self) -> Iterable[Metric]:
        families = {k: HistogramMetricFamily(self._names[k], self._help[k], labels=("pipeline", "index", "stage"))
                    for k in ("w", "p")}
        for (kind, labels), hist in self._hists.items():
            cumulative: list = []
            total = 0
            for i, (le, count) in enumerate(zip(self._le, hist.buckets, strict=True)):
                total += count
                found = hist.exemplars.get(i)
                if found is None:
                    cumulative.append((le, float(total)))
                else:
                    cumulative.append((le, float(total), Exemplar({"trace_id": found[0]}, found[1])))
            families[kind].add_metric(labels, cumulative, hist.sum)
        return list(families.values())
