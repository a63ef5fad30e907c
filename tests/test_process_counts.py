"""The per-process metrics of a ``--processes N`` gateway, summed (gateway.monitor.process_counts): the merge,
the snapshot's bytes, and two `Metrics` sharing a directory as two processes of one gateway do.

No processes here: tests/test_http_cli.py runs ``conveyor gateway --processes 2`` end to end."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics_families
from prometheus_client.parser import text_string_to_metric_families

from gateway.monitor.metrics import LATENCY_BUCKETS, Metrics
from gateway.monitor.process_counts import (
    ProcessCounts,
    ProcessCountsSettings,
    SiblingCounts,
    SnapshotUnreadable,
    decode,
    encode,
    merge,
)
from gateway.monitor.request_metrics import Latency, RequestCounts, RequestMetrics
from tests.metrics_statuses import Status, busy_pipeline

BUCKETS = len(LATENCY_BUCKETS) + 1


def _counts(ok: int, created_s: float, in_flight: float, bucket: int = 0) -> ProcessCounts:
    buckets = [0] * BUCKETS
    buckets[bucket] = ok
    return ProcessCounts(RequestCounts({("predict", "ok"): ok}, {("predict", "ok"): created_s},
                                       {"ok": Latency(buckets, ok * 0.01, created_s)}),
                         {"conveyor_gateway_rejected_connections": (1.0, created_s)},
                         {"conveyor_gateway_in_flight": in_flight})


def test_merge_adds_every_number_and_keeps_the_earliest_creation() -> None:
    a, b = _counts(3, 200.0, 2.0, bucket=1), _counts(5, 100.0, 4.0, bucket=2)
    b.requests.counts[("metrics", "ok")] = 7  # a label set only one process has
    b.requests.created_s[("metrics", "ok")] = 150.0
    total = merge([a, b])
    assert total.requests.counts == {("predict", "ok"): 8, ("metrics", "ok"): 7}
    assert total.requests.created_s == {("predict", "ok"): 100.0, ("metrics", "ok"): 150.0}
    latency = total.requests.latency["ok"]
    assert latency.buckets[:3] == [0, 3, 5] and sum(latency.buckets) == 8
    assert latency.sum_s == pytest.approx(0.08) and latency.created_s == 100.0
    assert total.counters == {"conveyor_gateway_rejected_connections": (2.0, 100.0)}
    assert total.gauges == {"conveyor_gateway_in_flight": 6.0}
    assert a.requests.latency["ok"].buckets[:3] == [0, 3, 0]  # the parts are left as they were


def test_merge_of_nothing_is_zero_and_of_one_is_itself() -> None:
    assert merge([]) == ProcessCounts(RequestCounts({}, {}, {}))
    one = _counts(3, 200.0, 2.0)
    assert merge([one]) == one


def test_a_snapshot_reads_back_as_written_and_anything_else_is_refused() -> None:
    counts = _counts(3, 200.0, 2.0, bucket=4)
    assert decode(encode(counts)) == counts
    for junk in (b"", b"\x93\x01\x02", b"not msgpack \xc1", encode(counts)[:-3]):
        with pytest.raises(SnapshotUnreadable):
            decode(junk)


def _requests_total(text: str, route: str, outcome: str) -> float:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "conveyor_gateway_requests_total" and sample.labels == {"route": route,
                                                                                       "outcome": outcome}:
                return sample.value
    return 0.0


def _value(text: str, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return sample.value
    raise AssertionError(f"no {name}{labels} in\n{text}")


def test_two_processes_each_answer_the_sum_and_pipeline_numbers_once(tmp_path: Path) -> None:
    """Two `Metrics` on one directory, as two processes of a gateway: each scrape shows the requests of both
    (the other's as of its last snapshot, which a scrape writes first), the in-flight gauges summed, and
    the batch histograms, which each process reads whole from Redis, as they are (not doubled)."""
    settings = ProcessCountsSettings(str(tmp_path), period_s=1.0)

    async def main() -> None:
        status = busy_pipeline(1)
        backend_a, backend_b = Status(status), Status(busy_pipeline(1))
        backend_a.in_flight, backend_b.in_flight = 2, 3
        a = Metrics(backend_a, siblings=SiblingCounts(settings, "101"))
        b = Metrics(backend_b, siblings=SiblingCounts(settings, "102"))
        for _ in range(4):
            a.observe_request("predict", "ok", 0.01)
        text = (await b.scrape()).decode()  # a never published: b shows its own only
        assert _requests_total(text, "predict", "ok") == 0.0
        text = (await a.scrape()).decode()  # a publishes first
        assert _requests_total(text, "predict", "ok") == 4.0
        batches = len(status.stages[0].batches)  # b read as many at its scrape: a shows its own, once
        assert _value(text, "conveyor_stage_batch_size_count", pipeline="default", index="0",
                      stage="stage-0") == batches
        for _ in range(3):
            b.observe_request("predict", "ok", 0.2)
        text = (await b.scrape()).decode()
        assert _requests_total(text, "predict", "ok") == 7.0
        assert _value(text, "conveyor_gateway_request_duration_seconds_count", outcome="ok") == 7.0
        assert _value(text, "conveyor_gateway_request_duration_seconds_bucket", outcome="ok", le="0.01") == 4.0
        assert _value(text, "conveyor_gateway_in_flight") == 5.0
        assert _value(text, "conveyor_gateway_rejected_connections_total") == 0.0
        openmetrics = (await a.scrape(openmetrics=True)).decode()  # the format with exemplars parses too
        families = {f.name: f for f in openmetrics_families(openmetrics)}
        ok = [s for s in families["conveyor_gateway_requests"].samples if s.labels == {"route": "predict",
                                                                                      "outcome": "ok"}]
        assert [s.value for s in ok if s.name.endswith("_total")] == [7.0]
        assert sorted(p.name for p in tmp_path.iterdir()) == ["101", "102"]  # no temporary file left

    asyncio.run(asyncio.wait_for(main(), 30))


def test_a_broken_sibling_file_counts_at_its_last_good_snapshot(tmp_path: Path) -> None:
    settings = ProcessCountsSettings(str(tmp_path))
    reader = SiblingCounts(settings, "1")
    SiblingCounts(settings, "2").publish(_counts(5, 100.0, 0.0))
    assert [c.requests.counts for c in reader.others()] == [{("predict", "ok"): 5}]
    (tmp_path / "2").write_bytes(b"\xc1")  # cannot happen through publish (a rename): a reader keeps the last
    (tmp_path / ".3.tmp").write_bytes(b"\xc1")  # a sibling's half-written snapshot is never read
    assert [c.requests.counts for c in reader.others()] == [{("predict", "ok"): 5}]


def test_one_process_publishes_nothing(tmp_path: Path) -> None:
    metrics = Metrics(Status(busy_pipeline(1)))
    metrics.observe_request("predict", "ok", 0.01)
    metrics.publish()
    text = asyncio.run(asyncio.wait_for(metrics.scrape(), 30)).decode()
    assert _requests_total(text, "predict", "ok") == 1.0 and not list(tmp_path.iterdir())


def test_rendering_a_sum_is_rendering_the_same_numbers_live() -> None:
    live = RequestMetrics("conveyor", LATENCY_BUCKETS)
    for n in range(50):
        live.observe("predict", ("ok", "timeout")[n % 2], n / 100)
    live.observe("metrics", "ok")
    assert live.render(merge([ProcessCounts(live.snapshot())]).requests) == tuple(live.collect())
