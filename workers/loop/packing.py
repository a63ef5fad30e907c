"""How a batch's forwards leave: as batch entries, several requests to one stream entry.

Each stream entry costs Redis an ``XADD``, its share of an ``XREADGROUP`` (a pending-list node
in the group and in the consumer) and an ``XACK``, and the commit's arguments: about 5 us of
Redis CPU per request and hop (``python -m bench.peers.redis_cost``). A batch forwarded as one
entry pays those once. What that costs: the next stage's workers share a forward by whole
entries, so a forward becomes at least one entry per live worker of the next stage (their
heartbeats, counted at each beat), and none larger than its ``batch_size``. Not for a singleton
next stage (``batch_size`` 1: it sizes its reads one request at a time, for slow models), nor for
a forward of one request (the low-load path keeps single entries). Off:
``WorkerSettings.batch_entries`` (``--no-batch-entries``); readers take both kinds regardless.
"""

from __future__ import annotations

from workers.pipeline import StageSpec


class ForwardPacking:
    def __init__(self, enabled: bool, next_stage: StageSpec | None) -> None:
        self._batch_size = next_stage.batch_size if enabled and next_stage is not None and next_stage.batched else 0
        self.live_next = 1  # the next stage's live workers, from the heartbeat thread

    def on_live_next(self, count: int) -> None:
        self.live_next = max(1, count)

    def entries(self, n_items: int) -> int:
        """Batch entries for a forward of ``n_items`` requests (0: one single entry each)."""
        if not self._batch_size or n_items < 2:
            return 0
        return max(self.live_next, -(-n_items // self._batch_size))
