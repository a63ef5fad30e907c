"""gateway.monitor.request_metrics renders what prometheus-client's Counter and Histogram rendered, exactly."""

from __future__ import annotations

import random

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from gateway.monitor.metrics import LATENCY_BUCKETS
from gateway.monitor.request_metrics import RequestMetrics


def _samples(registry: CollectorRegistry) -> list[str]:
    """Exposition lines without the ``_created`` values (creation times differ by construction)."""
    lines = generate_latest(registry).decode().splitlines()
    return [line.rsplit(" ", 1)[0] if "_created{" in line else line for line in lines]


def test_same_exposition_as_prometheus_client() -> None:
    ours = CollectorRegistry()
    stats = RequestMetrics("conveyor", LATENCY_BUCKETS)
    ours.register(stats)
    theirs = CollectorRegistry()
    requests = Counter("conveyor_gateway_requests", "HTTP requests answered, by route and outcome.",
                       ["route", "outcome"], registry=theirs)
    latency = Histogram("conveyor_gateway_request_duration_seconds", "End-to-end latency of predict requests "
                        "(request head read to response written), by outcome.", ["outcome"],
                        buckets=LATENCY_BUCKETS, registry=theirs)
    rng = random.Random(7)
    durations = [*LATENCY_BUCKETS, 0.0, 500.0] + [rng.expovariate(20) for _ in range(2000)]
    for n, duration in enumerate(durations):
        outcome = ("ok", "timeout", "stage_error")[n % 3]
        stats.observe("predict", outcome, duration)
        requests.labels("predict", outcome).inc()
        latency.labels(outcome).observe(duration)
    for route, outcome in (("other", "not_found"), ("metrics", "ok"), ("other", "not_found")):
        stats.observe(route, outcome)
        requests.labels(route, outcome).inc()
    assert _samples(ours) == _samples(theirs)


def test_openmetrics_parses_with_several_outcomes() -> None:
    """Each outcome's histogram lines together, its `_created` with them: they came after every label
    set, which OpenMetrics' parser refuses ("Invalid metric grouping") once two outcomes exist."""
    from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_latest
    from prometheus_client.openmetrics.parser import text_string_to_metric_families

    stats = RequestMetrics("conveyor", LATENCY_BUCKETS)
    registry = CollectorRegistry()
    registry.register(stats)
    for outcome in ("ok", "timeout", "stage_error"):
        stats.observe("predict", outcome, 0.01)
    families = {f.name: f for f in text_string_to_metric_families(openmetrics_latest(registry).decode())}
    created = [s for s in families["conveyor_gateway_request_duration_seconds"].samples if s.name.endswith("_created")]
    assert {s.labels["outcome"] for s in created} == {"ok", "timeout", "stage_error"}
