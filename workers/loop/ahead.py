"""Read-ahead: a full batch's commit goes out without waiting for its reply, and the worker reads
its next batch while Redis runs it.

Why: without it a worker's turn is read, run, commit, each round trip waited for in turn, and
the commit of a batch of 64 is Redis's longest call (a forward or a result per item): the worker
idles while Redis runs its commit, and Redis idles while the worker runs the next batch. With
read-ahead the worker sends the commit, reads on its stream's own connection (a read that
does not block), runs what it got, and takes the commit's reply only before sending the next
commit: the two overlap. It pays for a cheap stage under load (a backlog to read), and changes nothing
at low load or for a stage that computes for milliseconds (docs/benchmarks-archive.md, "Read-ahead in the workers").

When: only after a **full** batch of more than one item (a backlog is likely: the read finds
entries), on a worker with one lane (a partitioned worker blocks on several streams at once, and a
failure must be its own lane's), and off a Redis Cluster (redis-py routes each commit there and
waits for it: nothing would overlap). Batches that are not full (low load, a lone request) commit
and wait as before, so a read that finds nothing costs no extra round trip where latency matters.
``WorkerSettings.read_ahead`` (``--no-read-ahead``, ``CONVEYOR_READ_AHEAD=0``) turns it off.

Safety is unchanged: a commit still forwards and acks its batch atomically, the commit is on the
wire before the next read is sent, and commits leave in order on one connection. A failure found
when the reply is taken sets the lane aside like any other; the batch read meanwhile is not
committed and stays pending, to be run again after the lane's recovery (at-least-once, as after a
crash). Any path other than the next full batch (upkeep, several lanes, an empty read, stopping)
takes the reply first.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from broker.commit import Commit
from workers.loop.lanes import ReadLane

Settled = Callable[[float | None], None]  # commit_s: how long its reply was waited for; None: read ahead


@dataclass(frozen=True)
class _Sent:
    lane: ReadLane
    settled: Settled


class ReadAhead:
    """At most one commit whose reply is still to be taken."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._sent: _Sent | None = None

    @property
    def outstanding(self) -> ReadLane | None:
        """The lane whose commit is under way, if any."""
        return None if self._sent is None else self._sent.lane

    def commit(self, lane: ReadLane, commit: Commit, full: bool, settled: Settled) -> None:
        """Send a batch's commit and, unless the batch was full, wait for its reply now (else
        :meth:`settle` takes it). ``settled`` runs once the commit is known to have run. A commit
        under way is settled first (raising what it raised: this one is then not sent)."""
        self.settle()
        started = time.perf_counter()
        lane.committer.send(commit)
        if self.enabled and full and lane.committer.sends_ahead:  # a cluster's commit ran in send()
            self._sent = _Sent(lane, settled)
            return
        lane.committer.finish()
        settled(time.perf_counter() - started)

    def commit_all(self, parts: list[tuple[ReadLane, Commit]], settled: Settled) -> None:
        """A batch of several priority levels: each level's commit sent on its lane's connection, then
        every reply taken (one round trip for all); never read ahead. Each sent commit's reply is taken
        even when another failed (a committer holds one at a time); the first failure is then raised."""
        self.settle()
        started = time.perf_counter()
        failures: list[Exception] = []
        sent = []
        for lane, commit in parts:
            try:
                lane.committer.send(commit)
                sent.append(lane)
            except Exception as exc:  # raised below, once every sent reply is in
                failures.append(exc)
        for lane in sent:
            try:
                lane.committer.finish()
            except Exception as exc:
                failures.append(exc)
        if failures:
            raise failures[0]
        settled(time.perf_counter() - started)

    def settle(self) -> None:
        """Take the reply of the commit under way, if any; raises what the commit raised."""
        sent, self._sent = self._sent, None
        if sent is not None:
            sent.lane.committer.finish()
            sent.settled(None)
