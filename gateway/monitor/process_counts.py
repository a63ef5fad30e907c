"""The per-process numbers of ``conveyor gateway --processes N``, summed over its processes for ``/metrics``.

Why: the kernel hands each scrape to one of the N processes (SO_REUSEPORT), and each process counts only
the requests it answered. Rendered as they are, the counters would jump from one process's values to
another's between scrapes: Prometheus would see resets, ``rate()`` would be noise and the totals 1/N of
the truth. So every process publishes a snapshot of its own numbers to a directory its parent made
(`ProcessCountsSettings`), and a scrape renders its own live numbers plus every sibling's last snapshot.

What is per process, and summed: requests by route and outcome, the request latency histograms, the
connections answered 503 at once (counters; ``_created`` is the earliest of the processes'), and the
in-flight predictions, open connections, requests resent and late answers (gauges: each process holds its
own share, so the sum is the gateway's). What every process reads from Redis (the stage gauges, the batch
and item histograms, ``redis_reachable``, ``pipeline_ready``) is pipeline-wide, the same in each process:
it is rendered as this process has it, never summed.

Monotonic across scrapes: a process writes its snapshot right before it answers a scrape (and on a timer,
every ``period_s``, and once drained), so whatever one scrape showed of a process, the next scrape, at
any process, shows at least as much of it: its live numbers if it is the one scraped, else a snapshot
taken no earlier. Files are named by process id and never removed while the gateway runs: a process
that exits (drained, or killed) stays summed in at its last numbers, so the total does not drop, and a
process started in its place counts from zero in a file of its own. Its gauges stay at their last values
too: zero after a drain, possibly not after a kill (the parent then stops the whole set).

The snapshots are msgpack (plain data, never pickle), written to a temporary name then renamed over the
old one (``os.replace``): a reader sees a whole snapshot, never half of one. A snapshot that cannot be
read is skipped for that sibling's last good one. Nothing here runs per request.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import msgpack
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from broker.logs import Throttle
from gateway.monitor.request_metrics import Latency, RequestCounts

__all__ = ["ProcessCounts", "ProcessCountsSettings", "SiblingCounts", "SnapshotUnreadable", "decode", "encode",
           "merge", "replace_families"]

log = logging.getLogger(__name__)

_FORMAT = 1  # the snapshot's layout; a process reads only its own layout (siblings run the same code)


class SnapshotUnreadable(ValueError):
    """A snapshot's bytes are not a snapshot of this layout."""


@dataclass(frozen=True)
class ProcessCountsSettings:
    """Where the processes of one gateway publish their numbers (a private directory their parent made
    and removes), and how often each publishes besides each scrape and its drain."""

    directory: str
    period_s: float = 1.0


@dataclass
class ProcessCounts:
    """One process's own numbers, or several processes' summed.

    ``counters``: by metric name, the value and when it was created (Unix seconds); ``gauges``: by metric
    name, the value."""

    requests: RequestCounts
    counters: dict[str, tuple[float, float]] = field(default_factory=dict)
    gauges: dict[str, float] = field(default_factory=dict)


def merge(parts: Sequence[ProcessCounts]) -> ProcessCounts:
    """The sum of ``parts``: counts, buckets, sums and gauges added, each creation time the earliest.

    A latency histogram whose bucket count differs from the first one seen for its outcome is left out
    (processes of one gateway share their buckets; this guards the arithmetic, not a real case)."""
    total = ProcessCounts(RequestCounts({}, {}, {}))
    counts, created, latency = total.requests.counts, total.requests.created_s, total.requests.latency
    for part in parts:
        for key, count in part.requests.counts.items():
            counts[key] = counts.get(key, 0) + count
            when = part.requests.created_s.get(key, 0.0)
            created[key] = min(created.get(key, when), when)
        for outcome, hist in part.requests.latency.items():
            into = latency.get(outcome)
            if into is None:
                latency[outcome] = Latency(list(hist.buckets), hist.sum_s, hist.created_s)
            elif len(into.buckets) == len(hist.buckets):
                into.buckets = [a + b for a, b in zip(into.buckets, hist.buckets, strict=True)]
                into.sum_s += hist.sum_s
                into.created_s = min(into.created_s, hist.created_s)
        for name, (value, when) in part.counters.items():
            have = total.counters.get(name)
            total.counters[name] = (value, when) if have is None else (have[0] + value, min(have[1], when))
        for name, value in part.gauges.items():
            total.gauges[name] = total.gauges.get(name, 0.0) + value
    return total


def encode(counts: ProcessCounts) -> bytes:
    """``counts`` as msgpack: lists and numbers only."""
    requests = counts.requests
    return msgpack.packb({
        "format": _FORMAT,
        "requests": [[route, outcome, count, requests.created_s.get((route, outcome), 0.0)]
                     for (route, outcome), count in requests.counts.items()],
        "latency": [[outcome, hist.buckets, hist.sum_s, hist.created_s] for outcome, hist in requests.latency.items()],
        "counters": [[name, value, when] for name, (value, when) in counts.counters.items()],
        "gauges": [[name, value] for name, value in counts.gauges.items()],
    })


def decode(data: bytes) -> ProcessCounts:
    """The `ProcessCounts` that `encode` wrote; `SnapshotUnreadable` for anything else."""
    try:
        raw = msgpack.unpackb(data)
        if not isinstance(raw, dict) or raw.get("format") != _FORMAT:
            raise SnapshotUnreadable(f"not a snapshot of layout {_FORMAT}")
        requests = RequestCounts({}, {}, {})
        for route, outcome, count, when in raw["requests"]:
            requests.counts[(str(route), str(outcome))] = int(count)
            requests.created_s[(str(route), str(outcome))] = float(when)
        for outcome, buckets, sum_s, when in raw["latency"]:
            requests.latency[str(outcome)] = Latency([int(b) for b in buckets], float(sum_s), float(when))
        counters = {str(name): (float(value), float(when)) for name, value, when in raw["counters"]}
        return ProcessCounts(requests, counters, {str(name): float(value) for name, value in raw["gauges"]})
    except SnapshotUnreadable:
        raise
    except (ValueError, TypeError, KeyError, msgpack.UnpackException) as exc:
        raise SnapshotUnreadable(f"{type(exc).__name__}: {exc}") from None


def replace_families(collected: Iterable[Metric], total: ProcessCounts, requests: Sequence[Metric]) -> list[Metric]:
    """``collected`` (one process's registry) with its per-process families replaced by the sums: the two
    request families by ``requests`` (rendered from ``total.requests``), each counter and gauge of ``total``
    by its summed value, help text and order kept. Every other family is kept as it is."""
    by_name = {family.name: family for family in requests}
    out: list[Metric] = []
    for family in collected:
        if family.name in by_name:
            out.append(by_name[family.name])
        elif family.name in total.counters:
            value, when = total.counters[family.name]
            out.append(CounterMetricFamily(family.name, family.documentation, value=value, created=when))
        elif family.name in total.gauges:
            out.append(GaugeMetricFamily(family.name, family.documentation, value=total.gauges[family.name]))
        else:
            out.append(family)
    return out


class SiblingCounts:
    """One process's side of the shared directory: it writes its own snapshot (file ``name``, its process
    id) and reads every other file there, keeping each sibling's last readable snapshot."""

    def __init__(self, settings: ProcessCountsSettings, name: str) -> None:
        self.settings = settings
        self.name = name
        self._last: dict[str, ProcessCounts] = {}
        self._throttle = Throttle(60.0)  # a broken file is said once a minute, not at every scrape

    def publish(self, counts: ProcessCounts) -> None:
        """Write ``counts`` as this process's snapshot, whole or not at all (a temporary file renamed over
        the last one). Raises `OSError` if the directory cannot be written."""
        directory = Path(self.settings.directory)
        temporary = directory / f".{self.name}.tmp"
        temporary.write_bytes(encode(counts))
        os.replace(temporary, directory / self.name)

    def others(self) -> list[ProcessCounts]:
        """Every sibling's latest snapshot: this process's own file and temporary files left out; a file
        that cannot be read now counts at its last readable snapshot (if any)."""
        try:
            names = [n for n in os.listdir(self.settings.directory) if n.isdigit() and n != self.name]
        except OSError as exc:
            if self._throttle.allow("directory") is not None:
                log.warning("sibling counts unreadable directory=%s error=%s", self.settings.directory, exc)
            names = []
        for name in names:
            try:
                self._last[name] = decode(Path(self.settings.directory, name).read_bytes())
            except FileNotFoundError:
                continue  # the directory is being removed: the gateway stops
            except (OSError, SnapshotUnreadable) as exc:
                if self._throttle.allow(name) is not None:
                    log.warning("sibling counts unreadable file=%s error=%s", name, exc)
        return list(self._last.values())

