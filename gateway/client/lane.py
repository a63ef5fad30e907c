"""One pipeline partition as a gateway process submits to it, and the record of each request in flight.

A leaf of :mod:`gateway.client.hub` (which flushes lanes and keeps the records), of
:mod:`gateway.client.recall` (which queues forgotten requests on their lane again) and of
:mod:`gateway.client.deadlines`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from broker.batch_entries import EntrySizing
from broker.keys import Keys
from broker.submit import Submission, Submitter
from gateway.client.slot import Waiter
from gateway.client.streams import StreamSink
from gateway.client.trace_context import RequestTrace

# Consumed result keys are unlinked in groups: they ride on a submission's script call once this
# many wait (one UNLINK for all of them, not one per request at low load), and get a call of their
# own at UNLINK_ALONE. They expire at result_ttl_ms regardless: this only bounds memory sooner.
UNLINK_BATCH = 64
UNLINK_ALONE = 256


class InFlight:
    """Everything a gateway knows of one request until it is answered (or expires, or is refused):
    who waits for its answer, its lane, what was submitted (id, data, deadline), its timeout, since
    when it is held (monotonic: reset when audited or sent again, see gateway.client.recall), and
    whether its result key is left to expire rather than unlinked once answered: a request sent more
    than once (a late copy's ``SET NX`` must lose: one answer), or one under its caller's own id (a
    request under that id again is refused while the result lives: ``Gateway.predict``). The hub keeps
    one per request, by id; the outboxes, the deadline timer and the resends read them."""

    __slots__ = ("keep_result", "lane", "serial", "since_s", "submission", "timeout_s", "trace", "waiter")

    def __init__(self, waiter: Waiter | StreamSink, lane: Lane, submission: Submission, since_s: float,
                 timeout_s: float, trace: RequestTrace | None = None) -> None:
        self.waiter = waiter
        self.lane = lane
        self.submission = submission
        self.since_s = since_s
        self.timeout_s = timeout_s
        self.keep_result = False
        self.trace = trace  # a sampled or timed request's (gateway.client.trace_context); nearly always None
        self.serial = 0  # its deadline's (gateway.client.deadlines)


class Lane:
    """Where one pipeline partition's requests go: its keys, its packer of ``submit.lua`` calls,
    its outbox, and the result keys its answered requests left to unlink."""

    def __init__(self, keys: Keys, submitter: Submitter, reply_key: bytes, id_prefix: bytes,
                 wake: asyncio.Event, stages: Callable[[], int]) -> None:
        self.keys = keys
        self.stages = stages  # the pipeline's stage count, once its spec was read (0 before)
        self.submitter = submitter
        self.reply_key = reply_key
        self.id_prefix = id_prefix  # every request id of this lane starts with it
        self.outbox: list[InFlight] = []  # requests to submit in the next turn, in order
        self.sending: list[InFlight] = []  # the turn taken, until its call's reply (the audit leaves it)
        self.unlink: list[bytes] = []
        self.counter = 0
        self.traced = False  # the outbox holds a request with a trace: the turn carries its value
        self.wake = wake  # set when the lane has something to send: its flusher's signal
        # Its first stage as batch entries see it (gateway.client.sizing): until known, single entries.
        self.sizing = EntrySizing()

    def traces(self, batch: list[InFlight]) -> list[tuple[int, bytes]]:
        """The ``trace`` values of a turn's requests that carry one (index in the turn, value)."""
        return [(i, record.trace.field) for i, record in enumerate(batch) if record.trace is not None]

    def take_turn(self) -> tuple[list[InFlight], list[bytes]]:
        """This turn's requests, and the consumed result keys that ride on them (or go alone)."""
        batch, self.outbox = self.outbox, []
        self.sending = batch
        self.traced = False
        unlink: list[bytes] = []
        if len(self.unlink) >= (UNLINK_BATCH if batch else UNLINK_ALONE):
            unlink, self.unlink = self.unlink, []
        return batch, unlink

    @property
    def due(self) -> bool:
        return bool(self.outbox) or len(self.unlink) >= UNLINK_ALONE
