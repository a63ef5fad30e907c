"""The worker loop's side of the hot-worker preference (:mod:`workers.batching.handoff` decides).

Three moments of a batch of the only partition:
- before its first read: the peers to unblock, unless a read was sent ahead already;
- after that read: a burst read whole while peers were idle is partly given back to them
  (``share.lua``, :mod:`broker.share`);
- after ``predict``, before the commit: the next read is sent ahead, so this worker is queued on
  the stream before its answer goes out.
"""

from __future__ import annotations

import logging

import redis

from broker.connection import CONNECTION_ERRORS
from broker.share import Sharer
from workers.batching.collector import BatchCollector, Entry, StreamReader
from workers.batching.handoff import HotHandoff, is_refusal

log = logging.getLogger("conveyor.worker")


class HotReads:
    """One worker's reads under the handoff: its reader, collector, and ``share.lua``."""

    def __init__(self, handoff: HotHandoff, reader: StreamReader, collector: BatchCollector, sharer: Sharer) -> None:
        self.handoff = handoff
        self._reader = reader
        self._collector = collector
        self._sharer = sharer

    def collect(self, count: int, idle_block_ms: int | None) -> list[Entry]:
        """The next batch: the reply of a read sent ahead, or a read that first unblocks the idle
        peers if this worker is hot; less what it shared of a burst with them. A batch that was
        shared does not wait for more (its window would only delay what this worker kept)."""
        reader = self._reader
        unblock = () if reader.read_pending else self.handoff.unblock_ids(reader.run_id)
        entries = self._collector.first_read(count, idle_block_ms, unblock)
        if reader.unblock_refused:
            self.handoff.refused(reader.unblock_refused)
        if not entries:
            self.handoff.after_idle()
            return entries
        kept = self._share(entries, self._collector.asked)
        return self._collector.fill(kept, wait=len(kept) == len(entries))

    def _share(self, entries: list[Entry], asked: int) -> list[Entry]:
        parts = self.handoff.to_share(len(entries), asked, self._reader.idle_peers)
        if not parts:
            return entries
        given_from = len(entries) - sum(parts)
        groups: list[list[bytes]] = []
        for part in parts:
            groups.append([entry_id for entry_id, _ in entries[given_from:given_from + part]])
            given_from += part
        try:
            given = self._sharer.give_back(groups)
        except redis.ResponseError as exc:
            if not is_refusal(exc):
                raise  # OOM, LOADING, ...: the loop waits it out and drains what is still ours
            log.warning("share.lua refused (%s): bursts stay with the worker that reads them", exc)
            self.handoff.share_refused = True
            return entries
        return [entry for entry in entries if entry[0] not in given]

    def after_predict(self, size: int, count: int, first_wait_s: float, run_s: float,
                      next_count: int, idle_block_ms: int | None, may_read: bool) -> None:
        """After a batch that found no queue and ran long enough, queue this worker's next read
        ahead of its idle peers *before* the commit: the commit publishes the answer, and the
        caller's next request could otherwise reach Redis first and go to a peer. ``may_read``:
        false when stopping, or when housekeeping (which needs the reading connection) is due."""
        self.handoff.after_batch(size, count, run_s, first_wait_s)
        unblock = self.handoff.unblock_ids(self._reader.run_id)
        if unblock and may_read:
            try:
                self._collector.read_ahead(next_count, idle_block_ms, unblock)
            except CONNECTION_ERRORS as exc:  # the batch must still commit; the next read reconnects
                log.debug("read ahead failed error=%r", exc)
