"""Entries delivered before: what this consumer left pending, and what dead consumers left.

A worker first drains its own pending list (entries it held when it died, or when it lost
Redis), then now and then claims entries that other consumers have held for ``claim_idle_s``
(``XAUTOCLAIM``, :mod:`broker.pending`). Such entries run one at a time once delivered more than once: if one of them
crashed or hung a worker, it alone pays for it again, and past ``max_deliveries`` it goes to
the dead-letter stream (:mod:`workers.loop.routing`). A batch entry delivered again is not run:
it is split into single entries of the same stage (:mod:`workers.loop.batch_entries`), which then go
the same way, so an item that kills its worker does not take its batch's others with it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from broker import protocol
from broker.commit import Commit
from broker.errors import SyncClient
from broker.pending import claim_stale, delivery_counts
from broker.streams import Entry
from workers.loop.lanes import ReadLane
from workers.pipeline import StageSpec

log = logging.getLogger("conveyor.worker")

Process = Callable[[ReadLane, list[Entry], dict[bytes, int]], None]  # run and commit entries, with delivery counts


class Recovery:
    def __init__(self, client: SyncClient, spec: StageSpec, consumer: str, process: Process,
                 stopping: Callable[[], bool]) -> None:
        self._client = client
        self._spec = spec
        self._consumer = consumer
        self._process = process
        self._stopping = stopping
        self._own_rereads: dict[bytes, int] = {}  # re-reads of our pending list after losing Redis

    def drain_own_pending(self, lane: ReadLane, own_retry: bool = False) -> None:
        """Finish what this consumer held when it died. Entries delivered before run one at a
        time: if one of them crashed or hung the worker, it alone pays for it again.

        ``own_retry``: this same process re-reads after losing Redis, not after a crash. Each
        re-read counts as a delivery in Redis; it is subtracted, so flapping Redis never sends
        innocent entries to the dead-letter stream.

        After a crash they are read one at a time: a read of this consumer's history counts a delivery
        for every entry it returns, so a read of several would count one, for each crash, against every
        entry still waiting behind an input that kills the worker, and take them to the dead-letter
        stream with it."""
        while not self._stopping():
            entries = lane.reader.read(self._spec.batch_size if own_retry else 1, start="0")
            if not entries:
                return
            if own_retry:
                for entry_id in dict.fromkeys(entry_id for entry_id, _ in entries):  # a batch entry's once
                    self._own_rereads[entry_id] = self._own_rereads.get(entry_id, 0) + 1
            self._redelivered(lane, entries)

    def claim_stale(self, lane: ReadLane) -> None:
        """Take over the entries other consumers have held for over ``claim_idle_s``."""
        min_idle_ms = int(self._spec.claim_idle_s * 1000)
        cursor: bytes | str = "0-0"
        unnamed = False  # an entry claimed without its id (Redis 6.2): reading our own history names it
        while not self._stopping():
            page = claim_stale(self._client, lane.stream, self._consumer, min_idle_ms, cursor,
                               self._spec.batch_size)
            unnamed = unnamed or page.unnamed
            if page.entries:
                log.warning("claimed stale entries stage=%s count=%d requests=%s", self._spec.name, len(page.entries),
                            request_ids(page.entries))
                self._redelivered(lane, page.entries)
            if page.last:
                break
            cursor = page.cursor
        if unnamed:
            self.drain_own_pending(lane)

    def committed(self, acks: list[bytes]) -> None:
        """Entries acked: their re-read counts are no longer needed."""
        if self._own_rereads:
            for entry_id in acks:
                self._own_rereads.pop(entry_id, None)

    def _redelivered(self, lane: ReadLane, entries: list[Entry]) -> None:
        deliveries = self._delivery_counts(lane.stream, entries)
        fresh = [e for e in entries if deliveries.get(e[0], 1) <= 1]
        if fresh:
            self._process(lane, fresh, deliveries)
        for group in _by_entry([e for e in entries if deliveries.get(e[0], 1) > 1]):
            if len(group) > 1:
                self._split(lane, group)  # a batch entry, expanded (its items follow each other)
            else:
                self._process(lane, group, deliveries)

    def _split(self, lane: ReadLane, items: list[Entry]) -> None:
        """A batch entry delivered again (``items``: its requests), put back on its stream as single
        entries and acked, in one commit. (Recovery runs with no commit of the lane outstanding.)"""
        commit = Commit(acks=[items[0][0]])
        for _, fields in items:
            if fields is not None:
                trace = fields.get(protocol.F_TRACE)
                if trace:  # a sampled request keeps its trace context
                    commit.back_traces.append((len(commit.back) // 4, trace))
                commit.back += protocol.item_values(fields)
        log.warning("batch entry delivered again, split into single entries stage=%s entry=%r items=%d requests=%s",
                    self._spec.name, items[0][0], len(items), request_ids(items))
        lane.committer(commit)
        self.committed(commit.acks)

    def _delivery_counts(self, stream: str, entries: list[Entry]) -> dict[bytes, int]:
        """Each entry's deliveries, less this process's own re-reads after losing Redis."""
        counts = delivery_counts(self._client, stream, self._consumer, [e[0] for e in entries])
        return {entry_id: n - self._own_rereads.get(entry_id, 0) for entry_id, n in counts.items()}


def request_ids(entries: list[Entry], most: int = 16) -> str:
    """The request ids of ``entries``, for a log line about them (a grep for a request's id finds it):
    comma-separated, the first ``most`` of them, then how many more; as read (not yet validated)."""
    ids = [fields.get(protocol.F_ID, b"?")[:128].decode("utf-8", "replace") for _, fields in entries
           if fields is not None]
    more = f",+{len(ids) - most} more" if len(ids) > most else ""
    return ",".join(ids[:most]) + more


def _by_entry(entries: list[Entry]) -> list[list[Entry]]:
    """Runs of consecutive items of one stream entry (a batch entry expands to several)."""
    groups: list[list[Entry]] = []
    for entry in entries:
        if groups and groups[-1][0][0] == entry[0]:
            groups[-1].append(entry)
        else:
            groups.append([entry])
    return groups
