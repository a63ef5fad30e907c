"""What a gateway's view pays each second to keep one stage's last-minute batch stats.

    python -m bench.status_window [--batches-per-s 14000] [--entries-per-s 20] [--refreshes 10]

A stage's workers write a stats entry about every 100 ms each, one value per batch (a singleton stage:
one per item). The view reads the new entries every second and shapes the window's throughput and
p50/p99 of batch durations. Side by side on the same entries: the tally
(:class:`gateway.monitor.window.StatsWindow`, counted as entries come and go) and what the reader did
before, every batch of the window flattened and sorted at each refresh. Printed: milliseconds per
refresh of each, and both answers (they must agree).
"""

from __future__ import annotations

import argparse
import math
import random
import time

from broker.status import Entry
from gateway.monitor.window import StatsWindow, batches_of, id_key

WINDOW_MS = 60_000


def entries(rng: random.Random, first_ms: int, count: int, batches: int) -> list[Entry]:
    """``count`` stats entries from ``first_ms`` on, ``batches`` singleton batches each (durations in us)."""
    def durations_ms() -> bytes:
        return b" ".join(b"%.3f" % (rng.randint(2, 40) / 1000) for _ in range(batches))

    return [(b"%d-0" % (first_ms + k), {b"n": b" ".join([b"1"] * batches), b"ms": durations_ms()})
            for k in range(count)]


def nearest_rank(ordered: list[float], p: float) -> float:
    return ordered[max(1, math.ceil(p / 100 * len(ordered))) - 1]


def tallied(seconds: list[list[Entry]], refreshes: int) -> tuple[float, list[tuple[int, float, float]]]:
    """Seconds per refresh and the answers of each, counting as entries come and go (StatsWindow)."""
    window = StatsWindow()
    window.take([], 0)
    answers, spent_s = [], 0.0
    for second, new in enumerate(seconds):
        started = time.perf_counter()
        window.take(new, second * 1000 - WINDOW_MS)
        p50, p99 = window.tally.percentiles(50, 99)
        answer = (window.tally.batches, p50, p99)
        if second >= len(seconds) - refreshes:
            spent_s += time.perf_counter() - started
            answers.append(answer)
    return spent_s / refreshes, answers


def sorted_each_time(seconds: list[list[Entry]], refreshes: int) -> tuple[float, list[tuple[int, float, float]]]:
    """The same, as the reader did before: each entry's batches kept, the window's every batch sorted."""
    held: list[tuple[int, list[tuple[int, float]]]] = []
    answers, spent_s = [], 0.0
    for second, new in enumerate(seconds):
        started = time.perf_counter()
        held += [(id_key(entry_id)[0], batches_of(fields)) for entry_id, fields in new]
        held = [(ms, batches) for ms, batches in held if ms >= second * 1000 - WINDOW_MS]
        durations = sorted(seconds for _, batches in held for _, seconds in batches)
        answer = (len(durations), nearest_rank(durations, 50), nearest_rank(durations, 99))
        if second >= len(seconds) - refreshes:
            spent_s += time.perf_counter() - started
            answers.append(answer)
    return spent_s / refreshes, answers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches-per-s", type=int, default=14_000)
    parser.add_argument("--entries-per-s", type=int, default=20)
    parser.add_argument("--refreshes", type=int, default=10)
    args = parser.parse_args()
    rng = random.Random(1)
    per_entry = args.batches_per_s // args.entries_per_s
    # a full minute, then the refreshes measured: one second's new entries each
    seconds = [entries(rng, second * 1000, args.entries_per_s, per_entry)
               for second in range(WINDOW_MS // 1000 + args.refreshes)]
    tally_s, answers = tallied(seconds, args.refreshes)
    sort_s, before = sorted_each_time(seconds, args.refreshes)  # after: its lists do not burden the other's GC
    if answers != before:
        raise SystemExit(f"the two disagree: {answers} != {before}")
    batches, p50, p99 = answers[-1]
    print(f"{args.batches_per_s:,} batches/s, {args.entries_per_s} entries/s, a window of {batches:,} batches: "
          f"tally {tally_s * 1e3:.1f} ms per refresh, sorting every batch {sort_s * 1e3:.1f} ms; "
          f"p50 / p99 {p50 * 1e6:.0f} / {p99 * 1e6:.0f} us")


if __name__ == "__main__":
    main()
