"""At low load, the worker that has just run a batch takes the next one (hot-worker preference).

Redis hands an entry to the clients blocked on a stream first come, first served. A worker that
finishes a batch blocks again behind its idle peers, so at low load a stage's workers take turns
and every request runs on the worker whose caches have gone coldest: the other workers, the
caller and everything else on the machine have run since. For a model that is measured: with
two embed workers at one request in flight, each text cost about 1 ms more than with one worker
(docs/benchmarks.md), the model itself running 1 ms slower on the colder worker.

So a worker coming back from a batch that did not fill (nothing was queued) and that took at
least ``HOT_MIN_PREDICT_S`` sends, in one write on its reading connection, ``CLIENT UNBLOCK`` for
each idle peer's reading connection and then its own ``XREADGROUP ... BLOCK``. Redis runs one
client's commands in order, so this worker is queued on the stream before the peers, whose
reads come back empty and are sent again (each peer's loop already treats an empty read as a
timeout). Nothing is lost: an unblocked read had taken nothing, and a peer that is busy, or
whose read was just served, is not blocked, so ``CLIENT UNBLOCK`` does nothing to it.

That write goes out *before* the batch's commit, its reply taken after it (the read is sent
ahead, :meth:`workers.batching.collector.StreamReader.send_read`). The commit publishes the answer, and a
caller with one request in flight sends the next one as soon as it has it: a read sent after the
commit raced that request, and for a pipeline's first stage lost it to a peer about half the
time (the workers kept taking turns). Sent before, it is in Redis before the answer leaves.
Housekeeping, which needs the reading connection, is not skipped for long: no read is sent
ahead when it is due.

Under load nothing changes: a full batch means entries were queued, and then no one waits (for a
singleton stage, whose reads are usually of one entry, a first read that did not have to wait
says the same). A peer filling a batch window (``read_until``) that is unblocked waits on for the
time it has left, behind this worker.
Cheap stages (under ``HOT_MIN_PREDICT_S``) skip it too: their working set is small, and the
peers' wake-ups would cost more than warm caches save.

The same preference would keep a *burst* on one worker: requests sent together (eight callers
answered by one batch send their next ones together, and the stage before forwards them in one
commit) arrive at once, and the first worker in line reads them all while its peers idle. So
``CLIENT UNBLOCK``'s replies are counted (1: that peer was blocked, so idle), and a read that
emptied the stream (fewer entries than asked for) and got several gives the idle peers an even
share back (``share.lua``, atomically, one call per peer: a blocked read takes all it can, and
Redis serves the blocked readers after each call), when each part would take at least
``SHARE_MIN_S`` here. They are blocked behind this worker and take it at once. A batch shared
does not wait out its batch window. With the embeddings example at 8 in flight this doubled the
rate (docs/benchmarks.md). A full read is a backlog, which idle peers read anyway.

The peers' client ids come from ``P:readers:<i>`` (consumer -> ``<server run id>:<client id>``
of its reading connection), which every worker writes and reads with its heartbeat
(:mod:`workers.loop.heartbeat`). Client ids are never reused while a Redis server runs, and start
again from 1 when it restarts: a worker only unblocks ids published with the run id of the server
it reads from itself (the ids are kept with the run id they were learned on, and compared with
the reader's own at each read), and forgets its peers when it loses its connection.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import redis

log = logging.getLogger("conveyor.worker")

HOT_MIN_PREDICT_S = 0.001  # a batch at least this long makes its worker worth keeping hot
SHARE_MIN_S = 0.002  # share a burst only if the part given to idle peers would take this long here
WAITED_MIN_S = 0.0005  # a first read that waited this long found nothing queued


def is_refusal(exc: redis.ResponseError) -> bool:
    """A refusal that will not go away (an ACL, a renamed command), unlike BUSY, OOM or LOADING."""
    text = str(exc).lower()
    return isinstance(exc, redis.exceptions.NoPermissionError) or "no permissions" in text or "unknown" in text


@dataclass
class ReadPeers:
    """Shared by the worker's loop and its heartbeat thread (each field replaced whole)."""

    # (server run id, the stage's other live workers' reading connections on that server): one
    # field, so that the loop never pairs ids with the wrong server while the heartbeat replaces it
    learned: tuple[str | None, tuple[int, ...]] = (None, ())
    refused: bool = False  # Redis refused CLIENT UNBLOCK or P:readers (an ACL, a renamed command)


class HotHandoff:
    """Decides, batch by batch, whether the next read jumps ahead of the idle peers."""

    def __init__(self, peers: ReadPeers, enabled: bool) -> None:
        self.peers = peers
        self.enabled = enabled  # one partition only: with several, reads wait on all streams at once
        self._hot = False
        self._item_s = 0.0  # the last batch's run time per entry
        self.share_refused = False  # Redis refused share.lua (an ACL): keep every burst whole

    def after_batch(self, size: int, count: int, run_s: float, first_wait_s: float) -> None:
        """A batch of ``size`` entries (out of ``count`` asked for) ran for ``run_s`` (predict and
        routing); its first read waited ``first_wait_s`` for an entry."""
        # A read of one (a singleton stage's usual read) says nothing about a queue: its wait does.
        queued = size >= count and (count > 1 or first_wait_s < WAITED_MIN_S)
        self._hot = not queued and run_s >= HOT_MIN_PREDICT_S
        self._item_s = run_s / max(1, size)

    def to_share(self, size: int, count: int, idle_peers: int) -> list[int]:
        """The parts of the ``size`` entries just read (``count`` asked for) to give back, one per
        idle peer that this read's ``CLIENT UNBLOCK`` found (an even share each, this worker
        keeping at least as many as any), when the read emptied the stream (a burst, not a backlog: a full
        read leaves a backlog that idle peers read anyway) and every part is worth the
        hand-over. Fewer peers get a part if that is what makes each worth it; [] keeps all."""
        if not self.enabled or self.share_refused or idle_peers < 1 or size < 2 or size >= count:
            return []
        for peers in range(min(idle_peers, size - 1), 0, -1):
            rest = size - -(-size // (peers + 1))  # this worker keeps the ceiling of an even share
            parts = [rest // peers + (i < rest % peers) for i in range(peers)]
            if min(parts) * self._item_s >= SHARE_MIN_S:
                return parts
        return []

    def forget_peers(self) -> None:
        """The connection to Redis is lost: the peers' ids may be of a server that is gone."""
        self.peers.learned = (None, ())
        self._hot = False

    def after_idle(self) -> None:
        """A read came back empty: this worker is no hotter than its peers."""
        self._hot = False

    def unblock_ids(self, server: str | None) -> tuple[int, ...]:
        """The peers to unblock before the next read (none: read as usual). ``server``: the run id
        of the server this worker's reader is connected to; ids learned on another (before a
        restart, numbered from 1 again) would unblock strangers."""
        if not (self._hot and self.enabled) or self.peers.refused:
            return ()
        learned_on, ids = self.peers.learned
        return ids if learned_on is not None and learned_on == server else ()

    def refused(self, error: str) -> None:
        """Redis refused CLIENT UNBLOCK: read as usual from now on, and say so once."""
        if not self.peers.refused:
            log.warning("CLIENT UNBLOCK refused (%s): idle workers keep their turns", error)
        self.peers.refused = True
