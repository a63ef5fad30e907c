"""What Redis forgot, sent again: a gateway holds every request it admitted until it is answered.

Redis can lose a request's entry: the embedded Redis of ``conveyor run`` persists nothing, an AOF
fsynced every second loses that second, a replica promoted after its master died lacks what was
not yet replicated, and FLUSHALL or eviction drop keys. A request lost there would otherwise wait
out its deadline. Two checks find them, neither per request in the steady state:

- **Another run**: after the reply reader reconnects, the run id of the server it talks to (one
  ``INFO server``; on a Redis Cluster also every second, since redis-py follows a failover to the
  promoted node without an error). A different one (a restart, or a failover promoted another node)
  may have lost anything: every request in flight there is sent again at once.
- **An audit** (every ``audit_after_s``, only for requests older than that): one ``audit.lua`` per
  pipeline partition finds those in no stage's stream and without a result; they are sent again.

Sent again means the same request id and deadline through ``submit.lua``, so admission applies; a
request whose deadline passed is answered with its timeout by the gateway's timer, not sent. One
answer per request reaches its caller: the result's ``SET NX`` keeps the first, and the hub drops
any later one (counted in ``late_answers``). A stage may run a request twice: delivery stays
at-least-once (docs/guarantees.md).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from broker.audit import forgotten
from broker.connection import CONNECTION_OR_REPLY_ERRORS
from broker.refusals import log_refusal_once
from broker.server_info import arun_id
from broker.submit import Submission
from gateway.client.lane import Lane

log = logging.getLogger("conveyor.gateway")


@dataclass(slots=True)
class Held:
    """A request admitted and not yet answered: its lane, what was submitted, since when (monotonic)."""

    lane: Lane
    submission: Submission
    since_s: float


class Recall:
    """The requests a hub holds, and the two checks that send forgotten ones again.

    ``resend(lane, submissions)`` queues submissions on their lane again (the hub's); ``audit_after_s``
    0 turns the audit off (the run-id check stays: it costs nothing until a reconnect); ``enabled``
    False turns both off and holds nothing (what Redis forgets then times out)."""

    def __init__(self, resend: Callable[[Lane, list[Submission]], None], audit_after_s: float,
                 enabled: bool = True) -> None:
        self.enabled = enabled
        self.held: dict[bytes, Held] = {}  # insertion order is age order: sent again moves to the end
        self._resend = resend
        self.audit_after_s = audit_after_s
        self.resubmitted = 0
        self.audits = 0  # audit.lua calls made
        self._run_ids: dict[bytes, str] = {}  # by reply key: one per node a reader talks to

    def hold(self, request_id: bytes, lane: Lane, submission: Submission, now_s: float) -> None:
        if self.enabled:
            self.held[request_id] = Held(lane, submission, now_s)

    def release(self, request_id: bytes) -> None:
        self.held.pop(request_id, None)

    # -- another run ---------------------------------------------------------------------------

    async def check_run(self, client: Any, reply_key: bytes, lanes: Sequence[Lane]) -> None:
        """After a reconnect: if the server behind ``lanes`` is another run than the one seen
        before, send every request in flight on them again. The first call only records the run."""
        if not self.enabled:
            return
        run = await arun_id(client, lanes[0].keys.stream(0) if lanes else reply_key.decode())
        seen = self._run_ids.get(reply_key)
        self._run_ids[reply_key] = run
        if seen is None or seen == run:
            return
        ids = [rid for rid, held in self.held.items() if held.lane in lanes]
        log.warning("redis is another run than before (restarted, or failed over) run_id=%s: sending the %d "
                    "requests in flight there again", run[:12], len(ids))
        self._send_again(ids)

    # -- the audit -----------------------------------------------------------------------------

    async def audit_forever(self, client: Any) -> None:
        """Every ``audit_after_s``: audit the requests held longer than that."""
        while True:
            await asyncio.sleep(self.audit_after_s)
            try:
                await self.audit(client, time.monotonic())
            except CONNECTION_OR_REPLY_ERRORS as exc:  # the reader and flusher say more; try next time
                log_refusal_once(exc, "audit.lua")
                log.info("audit of old requests skipped error=%r", exc)

    async def audit(self, client: Any, now_s: float) -> None:
        old = list(self._older_than(now_s - self.audit_after_s))
        by_lane: dict[int, tuple[Lane, list[bytes]]] = {}
        for rid, held in old:
            by_lane.setdefault(id(held.lane), (held.lane, []))[1].append(rid)
            held.since_s = now_s  # audited: again only after another audit_after_s
            self.held[rid] = self.held.pop(rid)  # to the end: age order kept
        for lane, ids in by_lane.values():
            stages = lane.stages()
            queued = {s[0] for s in lane.outbox}
            ids = [i for i in ids if i not in queued]
            if stages < 1 or not ids:
                continue  # the pipeline's spec not seen yet: nothing to compare with
            self.audits += 1
            missing = await forgotten(client, lane.keys, stages, ids)
            if missing:
                log.warning("redis lost %d requests (in no stage's stream, without a result): sending them "
                            "again stream=%s", len(missing), lane.keys.stream(0))
                self._send_again(missing)

    def _older_than(self, since_s: float) -> Iterable[tuple[bytes, Held]]:
        for rid, held in self.held.items():
            if held.since_s > since_s:
                return  # the rest are younger
            yield rid, held

    # -- sending again ---------------------------------------------------------------------------

    def _send_again(self, request_ids: Iterable[bytes]) -> None:
        now_s = time.monotonic()
        by_lane: dict[int, tuple[Lane, list[Submission]]] = {}
        for rid in request_ids:
            held = self.held.pop(rid, None)
            if held is None:  # answered or expired meanwhile
                continue
            held.since_s = now_s
            self.held[rid] = held
            by_lane.setdefault(id(held.lane), (held.lane, []))[1].append(held.submission)
        for lane, submissions in by_lane.values():
            queued = {s[0] for s in lane.outbox}
            again = [s for s in submissions if s[0] not in queued]
            self.resubmitted += len(again)
            self._resend(lane, again)
