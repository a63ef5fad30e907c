"""What Redis forgot, sent again: a gateway holds every request it admitted until it is answered.

Redis can lose a request's entry: the embedded Redis of ``conveyor run`` persists nothing, an AOF
fsynced every second loses that second, a replica promoted after its master died lacks what was
not yet replicated, and FLUSHALL or eviction drop keys. A request lost there would otherwise wait
out its deadline. Two checks find them, neither per request in the steady state:

- **Another run**: after the reply reader reconnects, the run id of the server it talks to (one
  ``INFO server``; on a Redis Cluster also every second, since redis-py follows a failover to the
  promoted node without an error). A different one (a restart, or a failover promoted another node)
  may have lost anything, or nothing: on a Cluster a reshard that moved the partition's slot to
  another master shows another run id too, though the streams and their pending entries moved with
  it, and a restart that reloaded its data lost nothing either. So the requests in flight there are
  audited at once (below), and only those Redis lost are sent again: resent whole, those still in a
  stream would run twice. (A partition whose stage count is not known yet cannot be audited: every request
  in flight there is sent again.)
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
from typing import Any

from broker.audit import forgotten
from broker.errors import CONNECTION_OR_REPLY_ERRORS, ReplyError, error_text, is_transient
from broker.server_info import arun_id
from gateway.client.lane import InFlight, Lane

log = logging.getLogger("conveyor.gateway")


class Recall:
    """The two checks that send forgotten requests again, over the hub's table of requests in
    flight (``requests``: by id, in age order, each request's :class:`InFlight` record).

    ``resend(lane, records)`` queues requests on their lane again (the hub's); ``audit_after_s``
    0 turns the audit off (the run-id check stays: it costs nothing until a reconnect); ``enabled``
    False turns both off (what Redis forgets then times out)."""

    def __init__(self, requests: dict[bytes, InFlight], resend: Callable[[Lane, list[InFlight]], None],
                 audit_after_s: float, enabled: bool = True) -> None:
        self.enabled = enabled
        # Insertion order is age order (``InFlight.since_s``): audited or sent again moves to the end.
        self._requests = requests
        self._resend = resend
        self.audit_after_s = audit_after_s
        self.resubmitted = 0
        self.audits = 0  # audits run: one per pipeline partition per round that had old requests, or per another run
        self._run_ids: dict[bytes, str] = {}  # by reply key: one per node a reader talks to

    # -- another run ---------------------------------------------------------------------------

    async def check_run(self, client: Any, reply_key: bytes, lanes: Sequence[Lane]) -> None:
        """After a reconnect: if the server behind ``lanes`` is another run than the one seen
        before, audit every request in flight on them now and send again those it lost. The first call
        only records the run; so does one that finds nothing lost. A connection error of the audit
        (or BUSY, LOADING...) leaves the old run recorded: the reader's next check audits again; an audit
        refused for good (an ACL) sends again every request in flight there."""
        if not self.enabled:
            return
        run = await arun_id(client, lanes[0].keys.stream(0) if lanes else reply_key.decode())
        seen = self._run_ids.get(reply_key)
        if seen is None or seen == run:
            self._run_ids[reply_key] = run
            return
        in_flight = lost = 0
        for lane in lanes:
            ids = [rid for rid, record in self._requests.items() if record.lane is lane]
            in_flight += len(ids)
            try:
                missing = await self._gone(client, lane, ids, unsure_lost=True)
            except ReplyError as exc:
                if is_transient(exc):
                    raise  # BUSY, LOADING...: the reader's next check audits again
                # Refused for good (the gateway's ACL user lacks the audit's commands): raised, it would keep
                # the reader from ever popping again. Every request not queued is sent again, unaudited.
                log.warning("the audit at another run of redis failed: every request in flight there is sent "
                            "again (some may run twice) stream=%s error=%s", lane.keys.stream(0), error_text(exc))
                missing = await self._gone(client, lane, ids, unsure_lost=True, audit=False)
            lost += len(missing)
            if missing:
                self._send_again(missing)
        self._run_ids[reply_key] = run
        log.warning("redis is another run than before (restarted, failed over, or on a Cluster the slot moved to "
                    "another master) run_id=%s: of the %d requests in flight there, %d lost (in no stage's stream, "
                    "without a result) are sent again", run[:12], in_flight, lost)

    async def _gone(self, client: Any, lane: Lane, ids: list[bytes], unsure_lost: bool = False,
                    audit: bool = True) -> list[bytes]:
        """Of ``ids`` (in flight on ``lane``), those Redis lost: in no stage's stream and without a result
        (``audit.lua``). Not those waiting in the outbox, nor the turn on its way (its call may reach Redis
        after the audit's: after a pause, a lost connection's retries). Every one of them when the pipeline's
        stage count is not known yet (nothing to audit against); ``unsure_lost``: those a scan that gave up
        did not meet, if without a result (after another run: no later check is sure to come); ``audit`` False:
        every one of them, unaudited."""
        queued = {r.submission[0] for r in (*lane.outbox, *lane.sending)}
        ids = [i for i in ids if i not in queued]
        stages = lane.stages()
        if not ids or stages < 1 or not audit:
            return ids
        self.audits += 1
        return await forgotten(client, lane.keys, stages, ids, unsure_lost)

    # -- the audit -----------------------------------------------------------------------------

    async def audit_forever(self, client: Any) -> None:
        """Every ``audit_after_s``: audit the requests held longer than that."""
        while True:
            await asyncio.sleep(self.audit_after_s)
            try:
                await self.audit(client, time.monotonic())
            except CONNECTION_OR_REPLY_ERRORS as exc:  # the reader and flusher say more; try next time
                log.info("audit of old requests skipped error=%s", error_text(exc))

    async def audit(self, client: Any, now_s: float) -> None:
        if not self.enabled:
            return
        requests = self._requests
        old = list(self._older_than(now_s - self.audit_after_s))
        by_lane: dict[int, tuple[Lane, list[bytes]]] = {}
        for rid, record in old:
            by_lane.setdefault(id(record.lane), (record.lane, []))[1].append(rid)
            record.since_s = now_s  # audited: again only after another audit_after_s
            requests[rid] = requests.pop(rid)  # to the end: age order kept
        for lane, ids in by_lane.values():
            if lane.stages() < 1:
                continue  # the pipeline's spec not seen yet: nothing to compare with
            missing = await self._gone(client, lane, ids)
            if missing:
                log.warning("redis lost %d requests (in no stage's stream, without a result): sending them "
                            "again stream=%s", len(missing), lane.keys.stream(0))
                self._send_again(missing)

    def _older_than(self, since_s: float) -> Iterable[tuple[bytes, InFlight]]:
        for rid, record in self._requests.items():
            if record.since_s > since_s:
                return  # the rest are younger
            yield rid, record

    # -- sending again ---------------------------------------------------------------------------

    def _send_again(self, request_ids: Iterable[bytes]) -> int:
        """Queue these requests again, but not those waiting in their lane's outbox already, nor the turn on its
        way (``Lane.sending``): its call reaches the new run (after a failover, maybe the old master: the audit
        finds it then, as any call sent just after this check), or fails and the flusher queues it again:
        queued here too, each of its requests would be added twice to the stream, and run twice. How many queued."""
        requests = self._requests
        now_s = time.monotonic()
        by_lane: dict[int, tuple[Lane, list[InFlight]]] = {}
        count = 0
        for rid in request_ids:
            record = requests.pop(rid, None)
            if record is None:  # answered or expired meanwhile
                continue
            record.since_s = now_s
            requests[rid] = record
            by_lane.setdefault(id(record.lane), (record.lane, []))[1].append(record)
        for lane, records in by_lane.values():
            queued = {id(r) for r in (*lane.outbox, *lane.sending)}
            again = [r for r in records if id(r) not in queued]
            self.resubmitted += len(again)
            count += len(again)
            self._resend(lane, again)
        return count
