"""One pipeline partition as a gateway process submits to it: its outbox and its consumed result keys.

A leaf of :mod:`gateway.client.hub` (which flushes lanes) and :mod:`gateway.client.recall` (which
queues forgotten requests on them again).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from broker.keys import Keys
from broker.packing import EntrySizing
from broker.submit import Submission, Submitter

# Consumed result keys are unlinked in groups: they ride on a submission's script call once this
# many wait (one UNLINK for all of them, not one per request at low load), and get a call of their
# own at UNLINK_ALONE. They expire at result_ttl_ms regardless: this only bounds memory sooner.
UNLINK_BATCH = 64
UNLINK_ALONE = 256


class Lane:
    """Where one pipeline partition's requests go: its keys, its packer of ``submit.lua`` calls,
    its outbox, and the result keys its answered requests left to unlink."""

    def __init__(self, keys: Keys, submitter: Submitter, reply_key: bytes, id_prefix: bytes,
                 wake: asyncio.Event, stages: Callable[[], int]) -> None:
        self.keys = keys
        self.stages = stages  # the pipeline's stage count, once its spec was read (0 before)
        self.submitter = submitter
        self.reply_key = reply_key
        self.id_prefix = id_prefix  # every request id of this lane starts with it: answers find their lane
        self.outbox: list[Submission] = []
        self.unlink: list[bytes] = []
        # Requests sent again after a failed submission may run twice: their result keys are left
        # to expire instead of being unlinked, so that the late copy's SET NX loses (one answer).
        self.sent_twice: set[bytes] = set()
        self.counter = 0
        self.wake = wake  # set when the lane has something to send: its flusher's signal
        # Its first stage as batch entries see it (gateway.client.sizing): until known, single entries.
        self.sizing = EntrySizing()

    def take_turn(self) -> tuple[list[Submission], list[bytes]]:
        """This turn's submissions, and the consumed result keys that ride on them (or go alone)."""
        batch, self.outbox = self.outbox, []
        unlink: list[bytes] = []
        if len(self.unlink) >= (UNLINK_BATCH if batch else UNLINK_ALONE):
            unlink, self.unlink = self.unlink, []
        return batch, unlink

    @property
    def due(self) -> bool:
        return bool(self.outbox) or len(self.unlink) >= UNLINK_ALONE
