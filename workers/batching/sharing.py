"""Bursts shared with idle peers: requests that arrive together do not queue on one worker while
another idles.

Requests sent together (eight callers answered by one batch send their next ones together, and
the stage before forwards them in one commit) arrive at once, and the first worker blocked on the
stream reads them all while its peers stay idle: with the embeddings example at 8 in flight, two
embed workers ran at the rate of one. So a batch's first read that

- waited for its first entry (this worker was idle: the entries came as a burst, not a backlog),
- got several entries but fewer than it asked for (the stream is empty now: a full read leaves a
  backlog, which idle peers read anyway),
- and holds enough work that each part given away would take at least ``SHARE_MIN_S`` here,

asks Redis which peers are idle (live by their heartbeat, nothing pending: one round trip) and
gives each an even share back (``share.lua``, :mod:`broker.share`; this worker keeps at least as
many as any). They are blocked on the stream and take it at once; the batch that was shared does
not wait out its window. Nothing is lost: the script moves an entry
back whole, and only while it is still pending for this consumer. A batch entry (several requests,
forwarded by the stage before: :mod:`workers.loop.batch_entries`) is given whole or kept whole.

Off with the stage option ``share_bursts=False``; cheap stages never get here (no part would be
worth ``SHARE_MIN_S``, so not even the question is asked). docs/benchmarks.md has the figures.
"""

from __future__ import annotations

import logging

from broker.errors import ReplyError, is_refusal
from broker.keys import Keys
from broker.refusals import log_refusal_once
from broker.share import Sharer
from broker.streams import Entry
from workers.batching.adaptive import ewma

log = logging.getLogger("conveyor.worker")

SHARE_MIN_S = 0.002  # share a burst only if each part given to an idle peer would take this long here
WAITED_MIN_S = 0.0005  # a first read that waited this long found nothing queued: a burst


def parts_to_share(size: int, asked: int, idle_peers: int, item_s: float) -> list[int]:
    """The parts of ``size`` entries just read (``asked`` for) to give back, one per idle peer (an
    even share each, this worker keeping the largest), when the read emptied the stream and each
    part is worth the hand-over; fewer peers get a part if that makes each worth it. [] keeps all."""
    if idle_peers < 1 or size < 2 or size >= asked:
        return []
    for peers in range(min(idle_peers, size - 1), 0, -1):
        rest = size - -(-size // (peers + 1))  # this worker keeps the ceiling of an even share
        parts = [rest // peers + (i < rest % peers) for i in range(peers)]
        if min(parts) * item_s >= SHARE_MIN_S:
            return parts
    return []


class BurstSharing:
    """One worker's sharing: it learns the stage's cost per item from the batches it runs."""

    def __init__(self, sharer: Sharer) -> None:
        self._sharer = sharer
        self._item_s = 0.0  # run time per entry, averaged over recent batches
        self._refused = False  # Redis refused share.lua or XINFO (an ACL): keep every burst whole

    def observe(self, size: int, run_s: float) -> None:
        if size:
            self._item_s = ewma(self._item_s or None, run_s / size, 0.2)

    def share(self, keys: Keys, stage: int, entries: list[Entry], asked: int, idle_s: float) -> list[Entry]:
        """``entries`` (just read from stage ``stage``'s stream under ``keys``) less what this
        worker gave its idle peers of them."""
        size = len(entries)
        if self._refused or idle_s < WAITED_MIN_S or not parts_to_share(size, asked, 1, self._item_s):
            return entries  # not a burst, or not worth even one part: no question asked
        try:
            stream = keys.stream(stage)
            parts = parts_to_share(size, asked, self._sharer.idle_peers(stream, keys.heartbeats(stage)), self._item_s)
            if not parts:
                return entries
            given = self._sharer.give_back(stream, _groups(entries, parts))
        except ReplyError as exc:
            if not is_refusal(exc):
                raise  # OOM, LOADING, ...: the loop waits it out and drains what is still ours
            log_refusal_once(exc, "share.lua" if "script" in str(exc).lower() else None, keys.stream(stage))
            log.warning("burst sharing refused by Redis (%s): bursts stay with the worker that reads them", exc)
            self._refused = True
            return entries
        return [entry for entry in entries if entry[0] not in given]


def _groups(entries: list[Entry], parts: list[int]) -> list[list[bytes]]:
    """The entry ids of each part, the parts taken from the end of ``entries``. A batch entry's items
    (consecutive, one id) go whole, with the part its first item falls in (none: this worker keeps it)."""
    groups: list[list[bytes]] = [[] for _ in parts]
    part, end = -1, len(entries) - sum(parts)
    for i, (entry_id, _) in enumerate(entries):
        while part + 1 < len(parts) and i >= end:
            part += 1
            end += parts[part]
        if part >= 0 and (i == 0 or entries[i - 1][0] != entry_id):
            groups[part].append(entry_id)
    return groups
