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
one histogram update per distinct entry (a batch entry's requests share one). A traced item's two
spans are packed here (:mod:`broker.otlp`: its ids and times, then a tail its call's spans share)
and sent by the span sink's thread (:class:`broker.tracing.SpanSink`). Wait spans are recorded
before ``predict`` runs, so that a worker killed in it (SIGKILL, OOM) has already said that it had
the item; the delivery that follows says ``delivery`` 2. A streaming stage's predict span is its
item's whole stream (:mod:`workers.loop.streaming`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

from broker import otlp, tracing
from broker.commit import BatchStats, bucket_of
from workers.loop.predicting import Slice
from workers.loop.routing import Work
from workers.loop.runner import EXPIRED, Outcome
from workers.pipeline import StageSpec

__all__ = ["StageTracing"]


_REQUEST_PREFIXES, _DELIVERY = otlp.string_prefixes("conveyor.request.id"), otlp.key("conveyor.delivery")
_BATCH_SIZE, _BATCH_ID = otlp.key("conveyor.batch.size"), otlp.key("conveyor.batch.id")
_FIRST_DELIVERY = otlp.int_attribute(_DELIVERY, 1)


class StageTracing:
    """One worker's measurements of its batches (``sink``: None when this process does not trace)."""

    def __init__(self, spec: StageSpec, consumer: str, sink: tracing.SpanSink | None) -> None:
        self._spec = spec
        self._consumer = consumer.encode()
        self._sink = sink
        self._batches = 0
        # A span's name and kind, encoded once: a span adds its ids, times and own attributes.
        self._wait_head = otlp.head(f"{spec.name} wait")
        self._predict_head = otlp.head(f"{spec.name} predict")
        self._start_ns = 0
        self._start_perf = 0.0
        # The batch's sampled items: trace id, parent span id, the attributes of their own both spans carry.
        self._parents: dict[int, tuple[bytes, bytes, bytes]] = {}

    @staticmethod
    def resource(spec: StageSpec, pipeline: str, consumer: str) -> dict[str, str | int]:
        """What every span of a worker shares: sent once per export, as the process's resource."""
        return {"conveyor.pipeline": pipeline, "conveyor.stage": spec.name, "conveyor.stage.index": spec.index,
                "conveyor.worker": consumer}

    @classmethod
    def start(cls, spec: StageSpec, pipeline: str, consumer: str, settings: tracing.TraceSettings) -> StageTracing:
        """A worker's measurements, with a span sink if ``settings`` say this process traces (the
        exporter reads its ``OTEL_EXPORTER_OTLP_*`` variables now, at the worker's start)."""
        sink = tracing.start_sink(f"conveyor-{pipeline}", os.environ, cls.resource(spec, pipeline, consumer)) \
            if settings.enabled else None
        return cls(spec, consumer, sink)

    def held(self) -> tuple[int, float, dict[int, tuple[bytes, bytes, bytes]]]:
        """The batch measured last by :meth:`before`, for :meth:`resume`: set aside while another group
        of items is measured (a continuous batch's joiners, :mod:`workers.loop.streaming`)."""
        return self._start_ns, self._start_perf, self._parents

    def resume(self, held: tuple[int, float, dict[int, tuple[bytes, bytes, bytes]]]) -> None:
        self._start_ns, self._start_perf, self._parents = held

    def close(self) -> None:
        """Export what was recorded (the worker is stopping)."""
        if self._sink is not None:
            self._sink.close()

    def before(self, work: Work, stats: BatchStats, deliveries: dict[bytes, int] | None,
               same_call: bool = False) -> list[int]:
        """At ``predict``'s start: every item's wait counted; the traced items' indices returned,
        their wait spans recorded. ``same_call``: items that join the call measured before (their
        predict spans share its batch id)."""
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
        self._parents = {}
        if traced:
            if not same_call:
                self._batches += 1
            if self._sink is not None:
                self._waits(work, traced, stats, deliveries or {}, self._sink)
        return traced

    def _waits(self, work: Work, traced: list[int], stats: BatchStats, deliveries: dict[bytes, int],
               sink: tracing.SpanSink) -> None:
        now_ns, head, parents = self._start_ns, self._wait_head, self._parents
        spans, last_ms, entered_ns = [], b"", now_ns
        for i in traced:
            item = work[i][0]
            parent = tracing.parent_of(item.trace or b"")
            if parent is None:
                continue
            request_id = item.request_id  # at most 128 bytes (broker.protocol)
            own = _REQUEST_PREFIXES[len(request_id)] + request_id + _delivery(deliveries, item.entry_id)
            parents[i] = (*parent, own)
            ms = item.entry_id.partition(b"-")[0]
            if ms != last_ms:  # the items of one millisecond share their bucket, hence its exemplar
                entered_ns = min(now_ns, _entered_ms(item.entry_id) * 1_000_000)
                stats.add_exemplar(b"w", (now_ns - entered_ns) / 1e9, parent[0])
                last_ms = ms
            spans.append(otlp.span(parent[0], tracing.new_span_id(), parent[1], entered_ns, now_ns, head + own))
        if spans:
            sink.record_all(spans)

    def after(self, work: Work, traced: list[int], outcomes: Sequence[Outcome], slices: Sequence[Slice],
              stats: BatchStats) -> None:
        """After ``predict``: each traced item's predict span, exemplar and timing token (its
        ``trace`` value, forwarded or answered, gets it where its producer asked). ``traced`` in
        order; ``slices``: the calls that ran them, in order (:class:`workers.loop.predicting.Predictor`)."""
        offset_ns = self._start_ns - self._start_perf * 1e9  # perf_counter to wall clock, this batch
        parents, batched = self._parents, self._spec.batched
        spans: list[bytes] = []
        k, n = 0, len(traced)
        for start, end, began, ended, size in slices:
            began_ns, ended_ns = int(offset_ns + began * 1e9), int(offset_ns + ended * 1e9)
            step_ns = 0.0 if batched else (ended_ns - began_ns) / max(1, end - start)  # singletons: calls share it
            tail = b""
            while k < n and traced[k] < end:
                i = traced[k]
                k += 1
                if step_ns:
                    began_ns = int(offset_ns + began * 1e9 + step_ns * (i - start))
                    ended_ns = int(began_ns + step_ns)
                item = work[i][0]
                value = item.trace or b""
                if tracing.timing_asked(value):
                    wait_ns = max(0, self._start_ns - _entered_ms(item.entry_id) * 1_000_000)  # as its wait span
                    item.trace = tracing.with_timing(value, wait_ns / 1e6, (ended_ns - began_ns) / 1e6)
                parent = parents.get(i)
                if parent is None or outcomes[i] is EXPIRED:  # never run (its deadline passed): no predict span
                    continue
                if not tail:
                    stats.add_exemplar(b"p", (ended_ns - began_ns) / 1e9 / size, parent[0])
                if not tail or not batched:  # a singleton stage's read is several calls: an id each
                    tail = self._predict_tail(size, b"" if batched else b".%d" % (i - start))
                ok, result = outcomes[i]
                spans.append(otlp.span(parent[0], tracing.new_span_id(), parent[1], began_ns, ended_ns, tail + parent[2]
                                       + (b"" if ok else otlp.error(result.type, result.message, result.traceback,
                                                                      ended_ns))))
        if spans and self._sink is not None:
            self._sink.record_all(spans)

    def _predict_tail(self, size: int, call: bytes = b"") -> bytes:
        """What the predict spans of one call share: name, batch size, the batch's id (``call``: which
        of a singleton stage's calls, ``.<i>``)."""
        return self._predict_head + otlp.int_attribute(_BATCH_SIZE, size) + otlp.string_attribute(
            _BATCH_ID, b"%b/%d%b" % (self._consumer, self._batches, call))


def _delivery(deliveries: dict[bytes, int], entry_id: bytes) -> bytes:
    delivery = deliveries.get(entry_id, 1) if deliveries else 1
    return _FIRST_DELIVERY if delivery == 1 else otlp.int_attribute(_DELIVERY, delivery)


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
