"""How a batch's forwards leave: as batch entries, several requests to one stream entry.

Each stream entry costs Redis an ``XADD``, its share of an ``XREADGROUP`` (a pending-list node
in the group and in the consumer) and an ``XACK``, and the commit's arguments: about 5 us of
Redis CPU per request and hop (``python -m bench.peers.redis_cost``). A batch forwarded as one
entry pays those once. What that costs: the next stage's workers share work by whole entries.
So a forward becomes at least one entry per live worker of the next stage, and none larger
than its ``batch_size``; and only while the next stage's items are cheap (``PACK_MAX_ITEM_S``):
for a stage that computes for milliseconds per item, 5 us is nothing, and how finely its workers
share a burst is what counts (on the embeddings example, batch entries to its embed stage cost
1.3x the p99 at 64 in flight: docs/benchmarks.md). Both come from the heartbeat (:class:`NextStage`,
once per beat). Not for a singleton next stage (``batch_size`` 1: it sizes its reads one request at
a time, for slow models), nor for a forward of one request (the low-load path keeps single
entries). Off: ``WorkerSettings.batch_entries`` (``--no-batch-entries``); readers take both kinds regardless.
"""

from __future__ import annotations

from typing import Any

import redis

from broker import protocol
from broker.keys import LIVE_AFTER_MS, Keys
from workers.pipeline import Pipeline, StageSpec

# Batch entries only while the next stage's predict takes at most this per item (its latest stats
# entry): below it the ~5 us saved per request and hop is 1 % of the item's cost or more.
PACK_MAX_ITEM_S = 0.0005


class ForwardPacking:
    def __init__(self, enabled: bool, next_stage: StageSpec | None) -> None:
        self._batch_size = next_stage.batch_size if enabled and next_stage is not None and next_stage.batched else 0
        self.live_next = 1  # the next stage's live workers, from the heartbeat thread
        self.next_item_s: float | None = None  # the next stage's predict time per item, lately (None: not known)

    @property
    def enabled(self) -> bool:
        return bool(self._batch_size)

    def entries(self, n_items: int) -> int:
        """Batch entries for a forward of ``n_items`` requests (0: one single entry each)."""
        if not self._batch_size or n_items < 2 or (self.next_item_s or 0.0) > PACK_MAX_ITEM_S:
            return 0
        return max(self.live_next, -(-n_items // self._batch_size))


class NextStage:
    """A heartbeat hook (:class:`workers.loop.heartbeat.BeatHook`): the next stage's live workers
    and its latest batch stats, for :class:`ForwardPacking`."""

    def __init__(self, keys: Keys, next_index: int, packing: ForwardPacking) -> None:
        self._hb_key = keys.heartbeats(next_index)
        self._stats_key = keys.stats(next_index)
        self._packing = packing

    def queue(self, pipe: redis.client.Pipeline, ready: bool) -> None:
        if ready:
            pipe.zrange(self._hb_key, protocol.now_ms() - LIVE_AFTER_MS, "+inf", byscore=True)
            pipe.xrevrange(self._stats_key, count=1)

    def take(self, replies: list[Any]) -> None:
        if len(replies) != 2:
            return
        live, stats = replies
        if not isinstance(live, Exception):
            self._packing.live_next = max(1, len(live))
        if not isinstance(stats, Exception) and stats:
            item_s = item_time_s(stats[0][1])
            if item_s is not None:
                self._packing.next_item_s = item_s

    def stop(self, client: redis.Redis) -> None:
        """Nothing to undo."""


def item_time_s(fields: dict[bytes, bytes]) -> float | None:
    """Predict time per item in one stats entry (``n``: batch sizes, ``ms``: their durations)."""
    try:
        items = sum(int(n) for n in fields.get(b"n", b"").split())
        ms = sum(float(d) for d in fields.get(b"ms", b"").split())
    except ValueError:
        return None
    return ms / 1000 / items if items > 0 else None


def fed_per_entry(pipeline: Pipeline, spec: StageSpec) -> float:
    """Requests per entry a stage's reads expect at first: batch entries of up to its batch from a
    batched stage before it, else single entries (:class:`broker.streams.StreamReader`)."""
    fed = spec.index > 0 and spec.batched and pipeline.stages[spec.index - 1].batched
    return float(spec.batch_size) if fed else 1.0
