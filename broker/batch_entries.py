"""How many batch entries a hop of several requests becomes: the rule a forwarding worker and a
gateway's submissions share (docs/protocol.md, "Batch entries").

Each stream entry costs Redis an ``XADD``, its share of an ``XREADGROUP`` (a pending-list node
in the group and in the consumer) and an ``XACK``, and its script arguments, for every request and
hop (``python -m bench.peers.redis_cost`` measures it). A batch entry pays those once
for several requests. What that costs: the stage's workers share work by whole entries. So a hop
becomes at least one entry per live worker of the stage it feeds, and none larger than its
``batch_size``; and only while that stage's items are cheap (:data:`PACK_MAX_ITEM_S`): for a stage
that computes for milliseconds per item the Redis work saved is negligible, and how finely its workers
share a burst is what counts (whole entries share coarsely and lengthen the tail: docs/decisions.md). Not
to a singleton stage (``batch_size`` 1: it sizes its reads one
request at a time, for slow models), nor for a hop of one request (the low-load path keeps single
entries). The live workers and the item cost come from the stage's heartbeats and its latest stats
entry (:func:`queue_reads`, :meth:`EntrySizing.take`), read about once a second by the caller.
"""

from __future__ import annotations

from typing import Any

from broker import protocol
from broker.families import HEARTBEATS, STATS
from broker.keys import LIVE_AFTER_MS, Keys
from broker.operations import GATEWAY, WORKER, sends

# Batch entries only while the fed stage's predict takes at most this per item (its latest stats
# entry): below it the Redis work saved per request and hop is a noticeable share of the item's own cost;
# above it, how finely the stage's workers share a burst matters more.
PACK_MAX_ITEM_S = 0.0005


class EntrySizing:
    """What one stage looks like to whoever feeds it: its batch size (0: not batched, or packing
    off), its live workers and its predict time per item lately."""

    def __init__(self, batch_size: int = 0) -> None:
        self.batch_size = batch_size  # the fed stage's batch_size if it is batched and packing is on, else 0
        self.live = 1  # the fed stage's live workers (at least one)
        self.item_s: float | None = None  # the fed stage's predict time per item lately (None: not known)

    def entries(self, n_items: int) -> int:
        """Batch entries for a hop of ``n_items`` requests (0: one single entry each)."""
        if self.batch_size < 2 or n_items < 2 or (self.item_s or 0.0) > PACK_MAX_ITEM_S:
            return 0
        return max(self.live, -(-n_items // self.batch_size))

    def take(self, live: Any, stats: Any) -> bool:
        """The replies of :func:`queue_reads`' two commands (an exception where one failed); whether
        both could be read (if not, the caller should not pack: the stage's cost is not known)."""
        if isinstance(live, list):
            self.live = max(1, len(live))
        if isinstance(stats, list) and stats:
            item_s = item_time_s(stats[0][1])
            if item_s is not None:
                self.item_s = item_s
        return isinstance(live, list) and isinstance(stats, list)


@sends(WORKER, GATEWAY, uses={"zrange": HEARTBEATS, "xrevrange": STATS},
       why="a stage's live workers and latest batch stats, about once a second")
def queue_reads(pipe: Any, keys: Keys, index: int) -> None:
    """Queue the two reads :meth:`EntrySizing.take` wants on a redis-py pipeline (sync or async):
    stage ``index``'s live workers (heartbeats) and its latest batch stats entry."""
    pipe.zrange(keys.heartbeats(index), protocol.now_ms() - LIVE_AFTER_MS, "+inf", byscore=True)
    pipe.xrevrange(keys.stats(index), count=1)


def item_time_s(fields: dict[bytes, bytes]) -> float | None:
    """Predict time per item in one stats entry (``n``: batch sizes, ``ms``: their durations)."""
    try:
        items = sum(int(n) for n in fields.get(b"n", b"").split())
        ms = sum(float(d) for d in fields.get(b"ms", b"").split())
    except ValueError:
        return None
    return ms / 1000 / items if items > 0 else None
