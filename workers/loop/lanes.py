"""A worker's lanes: one per partition of its pipeline (one lane unless the pipeline is partitioned).

A lane is one partition's stream of the worker's stage, with what the worker needs there: its
stream reader (on the node that serves the stream on a Redis Cluster), its committer, its batch
stats, and its own recovery state. A lane whose node is unreachable (a master failing over) or
that refuses writes is set aside and tried again after a backoff, first draining what this
consumer holds there, while the other lanes keep being served.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from broker.commit import BatchStats, Committer
from broker.connection import CONNECTION_ERRORS, Backoff, error_text, is_transient_reply
from broker.keys import Keys
from broker.streams import StreamReader

log = logging.getLogger("conveyor.worker")


@dataclass
class ReadLane:
    keys: Keys
    reader: StreamReader
    committer: Committer
    stats: BatchStats = field(default_factory=BatchStats)
    recover: bool = True  # drain this consumer's own pending entries here before reading new ones
    drained: bool = False  # that drain has been done once (the one at start)
    retry_at: float = 0.0  # monotonic time before which the lane is left alone
    backoff: Backoff = field(default_factory=Backoff)
    losses: int = 0  # times the lane was lost (set aside, or its group gone): entries read before are recovered

    def lost(self) -> None:
        """Entries this consumer read here are to be recovered (read again as its own pending ones)."""
        self.recover = True
        self.losses += 1

    @property
    def stream(self) -> str:
        return self.reader.stream

    def up(self, now: float) -> bool:
        return now >= self.retry_at

    def set_aside(self, exc: BaseException) -> None:
        log.warning("redis unavailable stream=%s error=%s", self.stream, error_text(exc))
        self.reader.close()
        self.lost()
        self.retry_at = time.monotonic() + self.backoff.next_delay_s()

    def close(self) -> None:
        self.reader.close()
        self.committer.close()


def lane_failure(exc: BaseException) -> bool:
    """Errors that put one lane aside (its server unreachable, failing over, refusing writes);
    anything else is the worker's business."""
    return isinstance(exc, CONNECTION_ERRORS) or is_transient_reply(exc)
