"""Entries delivered before, as a worker's recovery sees them: those that other consumers have held
too long (``XAUTOCLAIM``, :func:`claim_stale`), and how many times each was delivered (``XPENDING``,
:func:`delivery_counts`). A consumer's own pending entries are read again with
:meth:`broker.streams.StreamReader.read` (``start="0"``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import redis

from broker import protocol
from broker.families import STREAMS
from broker.keys import GROUP
from broker.operations import WORKER, sends
from broker.streams import Entry

__all__ = ["Claimed", "claim_stale", "delivery_counts"]

_DONE = (b"0-0", "0-0")


@dataclass(frozen=True)
class Claimed:
    """One page of stale entries, now held by the claiming consumer."""

    entries: list[Entry]  # a batch entry as the requests it carries; an entry deleted while pending as (id, None)
    cursor: bytes | str  # where the next page starts
    unnamed: bool  # some entry was claimed without its id (Redis 6.2, deleted while pending): read own history

    @property
    def last(self) -> bool:
        """No page after this one."""
        return self.cursor in _DONE


@sends(WORKER, uses={"xautoclaim": STREAMS}, why="every claim_idle_s / 2: entries dead consumers held")
def claim_stale(client: redis.Redis, stream: str, consumer: str, min_idle_ms: int, cursor: bytes | str,
                count: int) -> Claimed:
    """Claim for ``consumer`` up to ``count`` entries of ``stream`` idle ``min_idle_ms`` or more, from
    ``cursor`` (``"0-0"``: the first page)."""
    reply = client.xautoclaim(stream, GROUP, consumer, min_idle_ms, cursor, count=count)
    claimed = reply[1]
    deleted = reply[2] if len(reply) > 2 else []  # Redis >= 7 reports deleted entries
    # Redis 6.2 answers a bare nil (no id) for an entry deleted while pending, yet claims it: it is
    # the consumer's now, and reading its own history names it.
    entries: list[Entry] = []
    for eid, fields in claimed:
        if eid is not None:  # a batch entry as the requests it carries, as a read gives them
            batch = fields and protocol.F_ITEMS in fields
            entries += protocol.expand(eid, fields) if batch else [(eid, fields or None)]
    unnamed = len({eid for eid, _ in entries}) < len(claimed)
    entries += [(eid, None) for eid in deleted]
    return Claimed(entries, reply[0], unnamed)


@sends(WORKER, uses={"xpending": STREAMS}, why="entries delivered before: how many times each was")
def delivery_counts(client: redis.Redis, stream: str, consumer: str, ids: Sequence[bytes]) -> dict[bytes, int]:
    """How many times each of ``ids`` (pending for ``consumer`` in ``stream``; an id may repeat) was
    delivered, as Redis counts it."""
    ordered = sorted(ids, key=_id_key)
    rows = client.xpending_range(stream, GROUP, ordered[0], ordered[-1], len(ordered) * 2, consumername=consumer)
    return {protocol.as_bytes(row["message_id"]): int(row["times_delivered"]) for row in rows}  # type: ignore[arg-type]


def _id_key(entry_id: bytes) -> tuple[int, int]:
    ms, _, seq = entry_id.partition(b"-")
    return int(ms), int(seq or 0)
