"""What each entry of a batch becomes in the batch's commit (:class:`broker.commit.Commit`).

Before user code: validated and decoded, or dead-lettered (malformed, undecodable, delivered
too often) or answered at once (deadline passed). After it: an error record (the stage's code
raised, the result is too large or cannot be encoded), the result (last stage), or the value
forwarded to the next stage's stream. Pure bookkeeping: nothing here talks to Redis, the
worker's one commit call per batch does.
"""

from __future__ import annotations

import logging
from typing import Any

from broker import codec, protocol, tracing
from broker.commit import Commit
from broker.keys import Keys
from broker.streams import Entry
from workers.loop.problems import Problems
from workers.loop.runner import EXPIRED
from workers.pipeline import StageSpec

log = logging.getLogger("conveyor.worker")

Work = list[tuple[protocol.Item, Any]]  # admitted items with their decoded inputs


def timing(trace: bytes) -> bytes | None:
    """A result record's ``timing`` where the request's producer asked for it (broker.tracing)."""
    return tracing.timings(trace) if tracing.timing_asked(trace) else None


class EntryRouter:
    def __init__(self, spec: StageSpec, last_stage: bool, max_payload_bytes: int, previous_exit: str = "",
                 problems: Problems | None = None, shared_replies: bool = True) -> None:
        self.spec = spec
        self.problems = problems  # told of every item whose predict raised (logged, counted)
        self.last_stage = last_stage
        self.max_payload_bytes = max_payload_bytes
        self.limits = protocol.Limits(max_payload_bytes, shared_replies)  # (not on a Redis Cluster)
        self.previous_exit = previous_exit  # "timeout" when the supervisor killed our predecessor

    def admit(self, entries: list[Entry], deliveries: dict[bytes, int] | None, commit: Commit, keys: Keys) -> Work:
        """Validate, decode and drop what must not reach user code; answer those at once."""
        at = protocol.now_ms()
        work: Work = []
        decode, max_deliveries = codec.decode, self.spec.max_deliveries
        for item in protocol.parse_entries(entries, keys, self.limits, at):
            if isinstance(item, protocol.Rejected):
                self._reject(item, item.reason, commit, keys)
                continue
            count = deliveries.get(item.entry_id, 1) if deliveries else 1
            if count > max_deliveries:
                self._reject(item, self._redelivery_reason(count), commit, keys)
            elif item.deadline_ms is not None and at >= item.deadline_ms:  # item.expired(at), inlined
                self._error(item, protocol.E_DEADLINE, protocol.deadline_passed(item.deadline_ms), commit, keys)
            else:
                try:
                    work.append((item, decode(item.data)))
                except codec.CodecError as exc:
                    self._reject(item, f"undecodable payload: {exc}", commit, keys)
        return work

    def route_all(self, work: Work, outcomes: list[tuple[bool, Any]], commit: Commit, keys: Keys) -> None:
        """``route`` for each item of ``work`` and its outcome; the common case (a forwarded value
        or a result record, encoded and small enough) without a call per item."""
        if self.last_stage:
            record_of, name, limit = protocol.ok_record, self.spec.name, self.max_payload_bytes
            prefix, results = keys.result_prefix, commit.results
            for (item, _), outcome in zip(work, outcomes, strict=True):
                if outcome[0]:
                    trace = item.trace
                    record = record_of(item.request_id, outcome[1], name, None if trace is None else timing(trace))
                    if len(record) <= limit:
                        results.append((prefix + item.request_id, record, item.reply))  # commit.publish, inlined
                        continue
                self.route(item, outcome, commit, keys)  # errors and results too large, said as route says them
            return
        encode, limit, forwards = codec.encode, self.max_payload_bytes, commit.forwards
        for (item, _), outcome in zip(work, outcomes, strict=True):
            ok, value = outcome
            if ok:
                try:
                    data = encode(value)
                except codec.CodecError:
                    data = None
                if data is not None and len(data) <= limit:
                    deadline = item.deadline_ms
                    if item.trace is not None:  # a sampled (or timed) request: the value goes on
                        commit.traces.append((len(forwards) // 4, item.trace))
                    forwards += (item.request_id, data, item.reply or b"",
                                 b"" if deadline is None else b"%d" % deadline)
                    continue
            self.route(item, outcome, commit, keys)  # errors, said as route says them

    def route(self, item: protocol.Item, outcome: tuple[bool, Any], commit: Commit, keys: Keys) -> None:
        """The outcome of user code on ``item``: an error, the result, or the next stage's input."""
        ok, value = outcome
        if not ok:
            if self.problems is not None and outcome is not EXPIRED:  # never run: not the stage's error
                self.problems.stage_error(item.request_id, value)
            self._error(item, value.type, value.message, commit, keys, value.traceback)
        elif self.last_stage:
            record = protocol.ok_record(item.request_id, value, self.spec.name,
                                        None if item.trace is None else timing(item.trace))
            if not self._too_large(item, len(record), commit, keys):
                commit.publish(keys.result_key(item.request_id), record, item.reply)
        else:
            try:
                data = codec.encode(value)
            except codec.CodecError as exc:
                self._error(item, protocol.E_UNENCODABLE, f"result of stage {self.spec.name!r} cannot be encoded: "
                            f"{exc}", commit, keys)
                return
            if not self._too_large(item, len(data), commit, keys):
                commit.forward(item.request_id, data, item.reply, item.deadline_ms, item.trace)

    def _redelivery_reason(self, count: int) -> str:
        limit = f"delivered {count} times (max_deliveries={self.spec.max_deliveries})"
        if self.previous_exit == "timeout":
            return f"timeout: predict ran past max_run_s={self.spec.max_run_s}s; {limit}"
        return f"{limit}: its worker crashed or was killed while processing it"

    def _reject(self, item: protocol.Item | protocol.Rejected, reason: str, commit: Commit, keys: Keys) -> None:
        log.warning("dead-letter stage=%s request=%r reason=%s", self.spec.name, item.request_id, reason)
        commit.dead_letter(item.entry_id, item.request_id, reason, item.data[:1024])
        if item.request_id is not None:
            record = protocol.error_record(item.request_id, protocol.E_DEAD_LETTER, reason, self.spec.name, "")
            commit.publish(keys.result_key(item.request_id), record, item.reply)

    def _error(self, item: protocol.Item, type_: str, message: str, commit: Commit, keys: Keys, tb: str = "") -> None:
        record = protocol.error_record(item.request_id, type_, message, self.spec.name, tb,
                                       None if item.trace is None else timing(item.trace))
        commit.publish(keys.result_key(item.request_id), record, item.reply)

    def _too_large(self, item: protocol.Item, size: int, commit: Commit, keys: Keys) -> bool:
        """A result over max_payload_bytes is this stage's error, said as such (not a dead letter
        of the next stage, nor a huge value in Redis)."""
        limit = self.max_payload_bytes
        if size <= limit:
            return False
        self._error(item, protocol.E_TOO_LARGE, f"result of stage {self.spec.name!r} too large: {size} bytes > "
                    f"max_payload_bytes={limit}", commit, keys)
        return True
