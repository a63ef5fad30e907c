"""Batch assembly: after a batch's first read, more reads while the stage's wait policy says waiting pays.

Two policies (``Stage.batch_policy``): ``"adaptive"`` (:mod:`workers.batching.adaptive`, the
default) dispatches as soon as waiting can no longer pay, ``batch_wait_s`` being only its upper
bound; ``"deadline"`` (:class:`FixedWait`) waits for ``batch_size`` items or the deadline, except after an
idle spell (the first read waited ``batch_wait_s`` or more).
Each further read ends at the client's own deadline (:meth:`broker.streams.StreamReader.read_until`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

from broker.streams import Entry, StreamReader


class WaitPolicy(Protocol):
    """How long to keep filling a batch once its first item is in hand. Asked again after every
    read: ``idle_s`` is how long the first read waited, ``waited_s`` the time since it returned."""

    def wait_s(self, idle_s: float, have: int, batch_size: int, waited_s: float) -> float: ...

    def observe_read(self, count: int, now: float) -> None: ...


@dataclass(frozen=True)
class FixedWait:
    """The ``deadline`` policy, for gathering N callers into one call: wait up to ``batch_wait_s`` from the batch's
    first item, except after a long idle (the first item took longer than ``batch_wait_s`` to
    come), when the worker takes what is already queued and goes."""

    batch_wait_s: float

    def wait_s(self, idle_s: float, have: int, batch_size: int, waited_s: float) -> float:
        if have >= batch_size or idle_s >= self.batch_wait_s:
            return 0.0
        return self.batch_wait_s - waited_s

    def observe_read(self, count: int, now: float) -> None:
        """The deadline policy does not learn."""


def fill(reader: StreamReader, policy: WaitPolicy, entries: list[Entry], asked: int, idle_s: float,
         first_at: float) -> list[Entry]:
    """``entries`` (what the batch's first read got, at ``first_at``, after waiting ``idle_s``)
    and more, up to ``asked``, for as long as ``policy`` says waiting pays."""
    policy.observe_read(len(entries), first_at)
    while asked - len(entries) >= reader.per_entry:  # room for an entry as large as they come lately
        wait_s = policy.wait_s(idle_s, len(entries), asked, time.monotonic() - first_at)
        if wait_s <= 0:
            break
        more = reader.read_until(asked - len(entries), wait_s)
        if not more:
            break
        policy.observe_read(len(more), time.monotonic())
        entries += more
    return entries
