"""What went wrong in the user's code, told to the operator: logged, rate-limited, and counted.

A stage that raises answers its requester (the error record), but the operator must see it too:
each error is logged at the worker (type, message, stage, request id), at most once a minute per
stage and exception type, with how many were held back; the first of each type also with its
traceback, at INFO (the others' at DEBUG), so that a new failure can be read without a debug log. A
batched ``predict`` that returns the wrong number of results is isolated by bisection, so every
answer is still right, and the bug would only show as lost throughput: it is logged (stage,
expected and returned counts; once a minute per stage) and counted. Both counts reach Redis with
the heartbeat (``HINCRBY P:counts:<i>``, a :class:`workers.loop.heartbeat.BeatHook`), where
``/metrics`` reads the totals.
"""

from __future__ import annotations

import logging
from typing import Any

from broker.commit import Committer
from broker.errors import SyncClient
from broker.liveness import Beat
from broker.logs import Throttle
from workers.loop.runner import Failure

log = logging.getLogger("conveyor.worker")

# results_kept: results not written because their key held an answer (broker.commit.Committer: a re-run, or
# a request id used again), counted by the process's committers.
_FIELDS = ("stage_errors", "batch_length_errors", "cancelled", "results_kept")


class Problems:
    def __init__(self, stage: str, counts_key: str) -> None:
        self._stage = stage
        self._key = counts_key
        self._throttle = Throttle(60.0)
        self._traced: set[str] = set()  # the exception types whose traceback was logged at INFO
        # Two threads, one writer each: the loop counts up ``_total``, the heartbeat ``_sent``.
        self._total = dict.fromkeys(_FIELDS, 0)
        self._sent = dict.fromkeys(_FIELDS, 0)
        self._sending = dict.fromkeys(_FIELDS, 0)

    def stage_error(self, request_id: bytes, failure: Failure) -> None:
        self._total["stage_errors"] += 1
        held = self._throttle.allow(("error", failure.type))
        if held is not None:
            log.warning("stage raised stage=%s request=%s type=%s message=%s held_back=%d", self._stage,
                        request_id.decode(errors="replace"), failure.type, failure.message[:500], held)
            first = failure.type not in self._traced
            self._traced.add(failure.type)
            log.log(logging.INFO if first else logging.DEBUG,
                    "stage traceback stage=%s request=%s type=%s traceback=%s", self._stage,
                    request_id.decode(errors="replace"), failure.type, failure.traceback.rstrip())

    def cancelled(self, n: int) -> None:
        """``n`` items dropped because their callers left (broker.cancels): acked, never run (or their
        stream stopped)."""
        self._total["cancelled"] += n

    def wrong_length(self, expected: int, returned: int) -> None:
        self._total["batch_length_errors"] += 1
        held = self._throttle.allow("length")
        if held is not None:
            log.warning("batched predict returned the wrong number of results stage=%s expected=%d returned=%d "
                        "held_back=%d: each item was run again alone (correct answers, lost throughput); "
                        "predict(xs) must return one result per input, in order", self._stage, expected, returned,
                        held)

    # -- BeatHook: the counts go to Redis with the heartbeat ------------------------------------

    def queue(self, beat: Beat, ready: bool) -> None:
        self._total["results_kept"] = Committer.kept_total  # the heartbeat's thread: its only writer
        self._sending = {field: self._total[field] - self._sent[field] for field in _FIELDS}
        for field, count in self._sending.items():
            if count:
                beat.count(self._key, field, count)

    def take(self, replies: list[Any]) -> None:
        if not any(isinstance(r, Exception) for r in replies):
            for field in _FIELDS:
                self._sent[field] += self._sending[field]

    def stop(self, client: SyncClient) -> None:
        """What the last beats did not carry is lost with the worker: counts, not requests."""
