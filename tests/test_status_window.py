"""The window a gateway's view keeps of each stage's batch stats (gateway.monitor.window): its counts
and nearest-rank percentiles, kept up as stats entries come in and leave the window, equal what a
reader that sorted every batch of the window would say. Pure logic: no Redis."""

from __future__ import annotations

import math
import random

from gateway.monitor.window import BatchTally, StatsWindow


def nearest_rank(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[max(1, math.ceil(p / 100 * len(ordered))) - 1]


def stats_entry(ms: int, batches: list[tuple[int, float]]) -> tuple[bytes, dict[bytes, bytes]]:
    """A stats entry as workers write it: sizes and durations in ms (3 decimals), space-separated."""
    return (b"%d-0" % ms, {b"n": b" ".join(b"%d" % n for n, _ in batches),
                           b"ms": b" ".join(b"%.3f" % (s * 1000) for _, s in batches)})


def test_a_tally_gives_the_percentiles_of_the_sorted_batches() -> None:
    rng = random.Random(7)
    batches = [(rng.randint(1, 64), round(rng.expovariate(2000), 6)) for _ in range(5000)]
    tally, older, newer = BatchTally(), BatchTally(batches[:4000]), BatchTally(batches[4000:])
    tally.absorb(older)
    tally.absorb(newer)
    for p in (1, 50, 90, 99, 100):
        assert tally.percentiles(p) == (nearest_rank([s for _, s in batches], p),)
    assert (tally.batches, tally.items) == (5000, sum(n for n, _ in batches))
    tally.drop(older)
    rest = [s for _, s in batches[4000:]]
    assert tally.percentiles(50, 99) == (nearest_rank(rest, 50), nearest_rank(rest, 99))
    assert (tally.batches, tally.items) == (1000, sum(n for n, _ in batches[4000:]))
    tally.drop(newer)
    assert (tally.batches, tally.items, dict(tally.durations)) == (0, 0, {})  # nothing left behind


def test_the_window_counts_what_comes_in_and_drops_what_leaves() -> None:
    """Entries arrive across reads; older ones leave the window; the tally is always the window's."""
    rng = random.Random(11)
    window, held = StatsWindow(), []
    start_ms, window_ms = 1_000_000, 10_000
    assert window.take([], start_ms - window_ms) == []  # the first look only sets the mark
    for read in range(30):
        now = start_ms + read * 1000
        new = []
        for k in range(rng.randint(0, 4)):
            batches = [(rng.randint(1, 8), rng.randint(1, 40) / 1e6) for _ in range(rng.randint(1, 50))]
            new.append(stats_entry(now - 900 + k, batches))
            held.append((now - 900 + k, [(n, float(b"%.3f" % (s * 1000)) / 1000) for n, s in batches]))  # as read
        fresh = window.take(new, now - window_ms)
        assert fresh == [b for _, batches in held[len(held) - len(new):] for b in batches]
        in_window = [b for ms, batches in held if ms >= now - window_ms for b in batches]
        assert (window.tally.batches, window.tally.items) == (len(in_window), sum(n for n, _ in in_window))
        if in_window:
            durations = [s for _, s in in_window]
            assert window.tally.percentiles(50, 99) == (nearest_rank(durations, 50), nearest_rank(durations, 99))
