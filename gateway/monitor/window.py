"""A stage's batch stats over a window of recent time, as a reader keeps them from the stats stream
(``P:stats:<i>``: workers write an entry about every 100 ms, its fields ``n`` and ``ms`` one value per
batch): counted as entries come in and leave the window, so that a reader that reads every second
(a gateway's view) pays for the new entries only, not for every batch of the window again.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections import Counter
from collections.abc import Sequence
from itertools import accumulate

from broker.protocol import as_bytes
from broker.status import Entry

__all__ = ["STATS_MAXLEN", "BatchTally", "StatsWindow", "batches_of", "id_key", "ms_of"]

STATS_MAXLEN = 1_000  # commit.lua trims the stats stream to about this many entries


def batches_of(fields: dict[bytes, bytes]) -> list[tuple[int, float]]:
    """(size, seconds) of each batch one stats entry records; [] for an entry no worker wrote
    (ignored rather than failing the whole status)."""
    try:
        sizes, durations = fields[b"n"].split(), fields[b"ms"].split()
        if len(sizes) != len(durations):
            return []
        return [(int(n), float(ms) / 1000) for n, ms in zip(sizes, durations, strict=True)]
    except (KeyError, ValueError, AttributeError):
        return []


class BatchTally:
    """Batches counted over a window, as they come in and leave it: how many, their items, and their
    durations by value. Workers write durations in whole microseconds, so a stage has few distinct
    values: nearest-rank percentiles stay exact without the window's every batch kept and sorted at each
    read (a singleton stage runs tens of thousands of batches a second)."""

    __slots__ = ("batches", "durations", "items")

    def __init__(self, batches: Sequence[tuple[int, float]] = ()) -> None:
        self.batches = len(batches)
        self.items = sum(size for size, _ in batches)
        self.durations: Counter[float] = Counter(seconds for _, seconds in batches)

    def absorb(self, other: BatchTally) -> None:
        """Count ``other``'s batches too (a stats entry's tally, as it enters the window)."""
        self.batches += other.batches
        self.items += other.items
        self.durations += other.durations

    def drop(self, other: BatchTally) -> None:
        """Count ``other``'s batches no more (a stats entry's tally absorbed before, leaving the window)."""
        self.batches -= other.batches
        self.items -= other.items
        self.durations -= other.durations  # a duration no batch has left goes

    def percentiles(self, *ps: float) -> tuple[float, ...]:
        """Nearest-rank percentiles of the durations, for a tally of at least one batch."""
        values = sorted(self.durations)
        ranks = list(accumulate(self.durations[seconds] for seconds in values))  # batches at or below each
        return tuple(values[bisect_left(ranks, max(1, math.ceil(p / 100 * self.batches)))] for p in ps)


def id_key(entry_id: bytes | str) -> tuple[int, int]:
    ms, _, seq = as_bytes(entry_id).partition(b"-")
    return int(ms), int(seq or 0)


def ms_of(entry: Entry) -> int:
    return id_key(entry[0])[0]


class StatsWindow:
    """One stage's batches of the window as a reader holds them (a tally per stats entry, by its id, and
    one of them all), and the last entry it saw."""

    __slots__ = ("complete_ms", "entries", "fresh_fields", "mark", "tally")

    def __init__(self) -> None:
        self.fresh_fields: list[dict[bytes, bytes]] = []  # the last take's new entries
        self.entries: list[tuple[tuple[int, int], BatchTally]] = []
        self.tally = BatchTally()  # of the entries held
        self.mark: bytes | None = None
        self.complete_ms = 0  # the entries held are all the stream had since this time (Unix ms)

    def start(self, window_start: int) -> bytes:
        """Where the next ``XRANGE`` starts: the window's start at the first look, then after the mark."""
        return b"%d" % window_start if self.mark is None else b"(" + self.mark

    def take(self, new: list[Entry], window_start: int) -> list[tuple[int, float]]:
        """The entries read since the mark in, those older than the window out; the batches of the
        fresh ones ([] at the first look, which only sets the mark)."""
        first = self.mark is None
        if len(new) >= STATS_MAXLEN:  # the stream turned over since the mark: the older entries are gone
            self.complete_ms = ms_of(new[0])
        if new:
            self.mark = new[-1][0]
        elif first:
            self.mark = b"%d-0" % window_start
        self.fresh_fields = [] if first else [fields for _, fields in new]
        fresh = []
        for entry_id, fields in new:
            batches = batches_of(fields)
            fresh += batches
            entry = BatchTally(batches)
            self.entries.append((id_key(entry_id), entry))
            self.tally.absorb(entry)
        cut = 0
        while cut < len(self.entries) and self.entries[cut][0] < (window_start, 0):
            self.tally.drop(self.entries[cut][1])
            cut += 1
        del self.entries[:cut]
        return [] if first else fresh
