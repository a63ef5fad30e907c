"""How big a gateway's batch entries to a first stage are: its live workers and item cost, as the views read them.

A turn of several submissions goes to the first stage as batch entries (``submit.lua``; the rule is
:class:`broker.batch_entries.EntrySizing`'s, which forwarding workers follow too): at least one per live
worker of the first stage, none larger than its ``batch_size``, none while its items cost more than
0.5 ms each, and none where a ``max_backlog`` is in force (admission counts entries; the script
decides that). The stage's batch size, and whether its workers read batch entries at all (workers
older than them do not say so in the spec), come from the pipeline's spec; its live workers and its
latest stats entry from its heartbeats and stats, read with the rest of the pipeline's view about once
a second (:mod:`gateway.client.view`). Where any of it cannot be read (an ACL from before batch
entries, a failover), single entries. Off: ``GatewaySettings.batch_entries``
(``conveyor gateway --no-batch-entries``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from broker.spec import StageInfo
from gateway.client.lane import Lane

__all__ = ["size_lanes"]


def size_lanes(lanes: Sequence[Lane], first: StageInfo | None, enabled: bool,
               reads: Sequence[tuple[Any, Any] | None]) -> None:
    """Each lane's :attr:`Lane.sizing` from its partition's first-stage ``reads`` (the two replies of
    :func:`broker.batch_entries.queue_reads`, None where they were not read): batch entries of the stage's
    ``batch_size`` if ``enabled``, its workers read them and both replies could be read, else none."""
    batch_size = first.batch_size if enabled and first is not None and first.batch_entries else 0
    for lane in lanes:
        partition = lane.keys.partition
        replies = reads[partition] if partition < len(reads) else None
        readable = batch_size >= 2 and replies is not None and lane.sizing.take(*replies)
        lane.sizing.batch_size = batch_size if readable else 0
