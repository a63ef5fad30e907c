"""What a worker measures of each item of a batch: its wait in the stream (every item, for the
stage's histogram) and, for the few items whose entry carries a ``trace`` value (docs/protocol.md),
their spans, their exemplars and the timings their producer asked for.

Times, and why these: an item's **wait** runs from its entry's id (the millisecond Redis added it
to this stage's stream) to the moment its batch's ``predict`` began here, so it holds the batching
window too; its **predict** is the call that ran it (a singleton stage's read of k entries is timed
as one slice and divided evenly; a batched item shares its call's whole duration). A timing token
(:func:`broker.tracing.with_timing`) and the spans report the same two numbers. Entry ids are Redis's
clock, spans this host's: across hosts a wait is as good as their clocks' agreement. An entry given
back to its stream by burst sharing gets a new id: its wait counts from then.

Per batch, the common case costs a loop over the items (an entry id compared with the last one) and
one histogram update per distinct entry (a batch entry's requests share one). A traced item costs a
few tuples, recorded for the span sink's thread (:class:`broker.tracing.SpanSink`): the SDK runs
there, not here. Wait spans are recorded before ``predict`` runs, so that a worker killed in it
(SIGKILL, OOM) has already said that it had the item; the delivery that follows says ``delivery`` 2.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

from broker import otlp, tracing
from broker.commit import BatchStats, bucket_of
from workers.loop.routing import Work
from workers.loop.runner import Outcome
from workers.pipeline import StageSpec

__all__ = ["StageTracing"]


class StageTracing:
    """One worker's measurements of its batches (``sink``: None when this process does not trace)."""

    def __init__(self, spec: StageSpec, pipeline: str, consumer: str, sink: tracing.SpanSink | None) -> None:
        self._spec = spec
        self._consumer = consumer
        self._sink = sink
        self._batches = 0
        # What every span of this worker says, encoded once (broker.otlp): a span adds only its own.
        self._constant = otlp.attributes({"conveyor.pipeline": pipeline, "conveyor.stage": spec.name,
                                          "conveyor.stage.index": spec.index, "conveyor.worker": consumer})
        self._wait_name = f"{spec.name} wait"
        self._predict_name = f"{spec.name} predict"
        self._start_ns = 0
        self._start_perf = 0.0
        self._parents: dict[int, tuple[int, int, int] | None] = {}  # the batch's traced items' parents

    @classmethod
    def start(cls, spec: StageSpec, pipeline: str, consumer: str, settings: tracing.TraceSettings) -> StageTracing:
        """A worker's measurements, with a span sink if ``settings`` say this process traces (the
        exporter reads its ``OTEL_EXPORTER_OTLP_*`` variables now, at the worker's start)."""
        sink = tracing.start_sink(f"conveyor-{pipeline}", os.environ) if settings.enabled else None
        return cls(spec, pipeline, consumer, sink)

    def close(self) -> None:
        """Export what was recorded (the worker is stopping)."""
        if self._sink is not None:
            self._sink.close()

    def before(self, work: Work, stats: BatchStats, deliveries: dict[bytes, int] | None) -> list[int]:
        """At ``predict``'s start: every item's wait counted; the traced items' indices returned,
        their wait spans recorded."""
        self._start_ns = now_ns = time.time_ns()
        self._start_perf = time.perf_counter()
        now_ms = now_ns / 1e6
        traced: list[int] = []
        # Items are counted by the millisecond of their entry's id (a run of equal ones shares a bucket):
        # under load most of a batch's entries were added in a few milliseconds, so the work per item is
        # a partition and a comparison, and the wait is computed once per run.
        last, count = b"", 0
        for i, (item, _) in enumerate(work):
            ms = item.entry_id.partition(b"-")[0]
            if ms != last:
                if count:
                    stats.add_wait(bucket_of(_wait_of(last, now_ms)), count)
                last, count = ms, 0
            count += 1
            if item.trace is not None:
                traced.append(i)
        if count:
            stats.add_wait(bucket_of(_wait_of(last, now_ms)), count)
        if traced:
            self._batches += 1
            self._waits(work, traced, stats, deliveries or {})
        return traced

    def _waits(self, work: Work, traced: list[int], stats: BatchStats, deliveries: dict[bytes, int]) -> None:
        now_ns, sink = self._start_ns, self._sink
        parents = self._parents = {}
        for i in traced:
            item = work[i][0]
            parent = parents[i] = tracing.parent_of(item.trace or b"")
            if parent is None or sink is None:
                continue
            entered_ns = min(now_ns, _entered_ms(item.entry_id) * 1_000_000)
            stats.add_exemplar(b"w", (now_ns - entered_ns) / 1e9, parent[0])
            attributes = {"conveyor.request.id": item.request_id.decode(),
                          "conveyor.delivery": deliveries.get(item.entry_id, 1), "conveyor.entry.id":
                          item.entry_id.decode()}
            sink.record(tracing.SpanRecord(self._wait_name, parent[0], tracing.new_span_id(), parent[1],
                                           entered_ns, now_ns, attributes, constant=self._constant))

    def after(self, work: Work, traced: list[int], outcomes: Sequence[Outcome],
              slices: Sequence[tuple[int, int, float, float]], stats: BatchStats,
              deliveries: dict[bytes, int] | None) -> None:
        """After ``predict``: each traced item's predict span, exemplar and timing token (its
        ``trace`` value, forwarded or answered, gets it where its producer asked)."""
        offset_ns = self._start_ns - self._start_perf * 1e9  # perf_counter to wall clock, this batch
        batch_id = f"{self._consumer}/{self._batches}"
        deliveries = deliveries or {}
        bounds = _slice_of(slices, traced)
        for i in traced:
            item = work[i][0]
            value = item.trace or b""
            start, end, began, ended = bounds[i]
            size = end - start
            if not self._spec.batched and size > 1:  # a singleton stage's slice: k calls, evenly
                step = (ended - began) / size
                began, ended = began + step * (i - start), began + step * (i - start + 1)
                size = 1
            began_ns, ended_ns = int(offset_ns + began * 1e9), int(offset_ns + ended * 1e9)
            if tracing.timing_asked(value):
                wait_ns = max(0, began_ns - _entered_ms(item.entry_id) * 1_000_000)
                item.trace = tracing.with_timing(value, wait_ns / 1e6, (ended_ns - began_ns) / 1e6)
            parent = self._parents.get(i)
            if parent is None or self._sink is None:
                continue
            stats.add_exemplar(b"p", (ended - began) / size, parent[0])
            self._predict_span(item, parent, began_ns, ended_ns, size, batch_id, outcomes[i],
                               deliveries.get(item.entry_id, 1))

    def _predict_span(self, item: Any, parent: tuple[int, int, int], began_ns: int, ended_ns: int, size: int,
                      batch_id: str, outcome: Outcome, delivery: int) -> None:
        ok, value = outcome
        error = None if ok else (value.type, value.message, value.traceback)
        attributes = {"conveyor.request.id": item.request_id.decode(), "conveyor.batch.size": size,
                      "conveyor.batch.id": batch_id, "conveyor.delivery": delivery}
        assert self._sink is not None
        self._sink.record(tracing.SpanRecord(self._predict_name, parent[0], tracing.new_span_id(), parent[1],
                                             began_ns, ended_ns, attributes, error=error, constant=self._constant))


def _wait_of(ms: bytes, now_ms: float) -> float:
    """Seconds since the millisecond ``ms`` (an entry id's first part; 0 if it is not a number)."""
    try:
        return max(0.0, now_ms - int(ms)) / 1000
    except ValueError:
        return 0.0


def _entered_ms(entry_id: bytes) -> int:
    """The millisecond part of a stream entry id: when Redis added the entry."""
    try:
        return int(entry_id[:entry_id.index(b"-")])
    except ValueError:
        return 0


def _wait_s(entry_id: bytes, now_ms: float) -> float:
    return max(0.0, now_ms - _entered_ms(entry_id)) / 1000


def _slice_of(slices: Sequence[tuple[int, int, float, float]], traced: list[int]
              ) -> dict[int, tuple[int, int, float, float]]:
    """Each traced item's predict call, from the run's slices (in order)."""
    found, k = {}, 0
    for i in traced:
        while k < len(slices) and slices[k][1] <= i:
            k += 1
        if k < len(slices):
            found[i] = slices[k]
    return found
