"""The adaptive batching policy (the default) and the read size of singleton stages.

A fixed window makes every lone request pay ``batch_wait_s`` per batched stage for company
that never comes. The adaptive policy treats ``batch_wait_s`` as an upper bound and keeps
filling a batch only while waiting can pay: one more item is worth waiting for when its
expected gap (from the observed arrival rate) costs the items in hand less, in total, than
the fixed cost of the separate batch that item would otherwise need (commit and read round
trips, measured). Otherwise the batch goes at once, and what arrives while it runs forms the
next one: under load that makes batches as large as the load, with no wait at all.

A streaming stage (``predict`` yields; not a continuous one, which takes joiners between steps) holds
its worker for all the steps of a batch, so an item that just misses a batch waits for that batch's end,
not a commit's round trip: there the cost of a separate batch is the larger of the two, the streaming
batches' recent duration.

Estimates are exponentially weighted moving averages (EWMA), updated per read and per batch,
so the policy follows load shifts within a few dozen batches.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SINGLETON_READ_MAX = 64  # entries one singleton worker reads at once, shared among live workers
SINGLETON_READ_WORK_S = 0.002  # ... and no more than about this much measured work


def ewma(old: float | None, new: float, alpha: float) -> float:
    return new if old is None else old + alpha * (new - old)


@dataclass
class AdaptiveWait:
    """Dispatch as soon as waiting can no longer pay; never wait longer than ``batch_wait_s``."""

    batch_wait_s: float
    alpha: float = 0.2
    gap_s: float | None = None  # mean time between items arriving to this worker
    overhead_s: float = 0.0005  # fixed cost of one batch: read + commit round trips
    streams: bool = False  # the stage streams: a batch holds its worker for all its steps
    stream_s: float = 0.0  # ... how long, lately (an item that misses a batch waits for its end)
    _last_read_at: float | None = field(default=None, repr=False)

    def observe_read(self, count: int, now: float) -> None:
        """``count`` entries came back from a read at ``now``: they arrived since the previous one.
        The gap is averaged, not the rate: an average of count/dt is dominated by the shortest dt
        (a noisy machine made a lone request look like a burst, and wait)."""
        if self._last_read_at is not None and now > self._last_read_at and count > 0:
            self.gap_s = ewma(self.gap_s, (now - self._last_read_at) / count, self.alpha)
        self._last_read_at = now

    def observe_batch(self, size: int, predict_s: float, commit_s: float | None) -> None:
        """A read costs about what a commit does (one round trip): count it twice. The estimate
        follows the cheapest recent commits, rising at most 5 % per batch: a commit that waited for
        a busy CPU says nothing about what batching saves, and must not make lone requests wait.
        ``commit_s`` None: the commit's reply was taken after the next read (workers.loop.ahead),
        so its round trip was not measured."""
        if commit_s is not None:
            self.overhead_s = min(2 * commit_s, self.overhead_s * 1.05)
        if self.streams and size:
            self.stream_s = ewma(self.stream_s or None, predict_s, self.alpha)

    def wait_s(self, idle_s: float, have: int, batch_size: int, waited_s: float) -> float:
        """How long to wait for more entries now (0: dispatch what is in hand)."""
        remaining = self.batch_wait_s - waited_s
        gap_s = self.gap_s
        if have >= batch_size or remaining <= 0 or gap_s is None:
            return 0.0
        if have * gap_s >= max(self.overhead_s, self.stream_s):
            return 0.0  # the items in hand would lose more waiting than a separate batch costs
        return min(remaining, 2 * gap_s)  # twice the expected gap: arrivals are not a metronome


@dataclass
class SingletonReadSize:
    """How many entries a worker of a ``batch_size`` 1 stage reads in one XREADGROUP.

    One read per item would cost a round trip per item; one read of everything queued would
    leave the stage's other workers idle while this one works through it. The read takes at most
    ``SINGLETON_READ_MAX / live workers`` and about ``SINGLETON_READ_WORK_S`` of measured work.
    """

    alpha: float = 0.2
    item_s: float | None = None  # measured predict time per item
    live_workers: int = 1

    def observe_batch(self, size: int, predict_s: float, commit_s: float | None) -> None:
        if size > 0:
            self.item_s = ewma(self.item_s, predict_s / size, self.alpha)

    def count(self) -> int:
        share = max(1, SINGLETON_READ_MAX // max(1, self.live_workers))
        if not self.item_s:
            return 1  # nothing measured yet: a slow model must not be handed a pile at once
        return max(1, min(share, int(SINGLETON_READ_WORK_S / self.item_s)))
