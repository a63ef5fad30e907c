"""How a batch's forwards leave: as batch entries, several requests to one stream entry.

The rule (how many entries, and when not to pack) is :class:`broker.batch_entries.EntrySizing`'s, which a
gateway's submissions to a first stage follow too. Here: a worker's view of its next stage, kept
current by a heartbeat hook (:class:`NextStage`, once per beat). Off: ``WorkerSettings.batch_entries``
(``--no-batch-entries``); readers take both kinds regardless.
"""

from __future__ import annotations

from typing import Any

from broker.batch_entries import EntrySizing
from broker.errors import SyncClient
from broker.keys import Keys
from broker.liveness import Beat
from workers.pipeline import Pipeline, StageSpec


class ForwardSizing(EntrySizing):
    """:class:`EntrySizing` of the next stage: batched (and packing on), or never packed."""

    def __init__(self, enabled: bool, next_stage: StageSpec | None) -> None:
        super().__init__(next_stage.batch_size if enabled and next_stage is not None and next_stage.batched else 0)

    @property
    def enabled(self) -> bool:
        return bool(self.batch_size)


class NextStage:
    """A heartbeat hook (:class:`workers.loop.heartbeat.BeatHook`): the next stage's live workers
    and its latest batch stats, for :class:`ForwardSizing`."""

    def __init__(self, keys: Keys, next_index: int, packing: ForwardSizing) -> None:
        self._keys = keys
        self._index = next_index
        self._forward_sizing = packing

    def queue(self, beat: Beat, ready: bool) -> None:
        if ready:
            beat.next_stage_reads(self._keys, self._index)

    def take(self, replies: list[Any]) -> None:
        if len(replies) == 2:
            self._forward_sizing.take(*replies)

    def stop(self, client: SyncClient) -> None:
        """Nothing to undo."""


def fed_per_entry(pipeline: Pipeline, spec: StageSpec) -> float:
    """Requests per entry a stage's reads expect at first: batch entries of up to its batch from a
    batched stage before it, else single entries (:class:`broker.streams.StreamReader`). A first
    stage starts at one: what gateways send it depends on their load."""
    fed = spec.index > 0 and spec.batched and pipeline.stages[spec.index - 1].batched
    return float(spec.batch_size) if fed else 1.0
