"""A streaming stage's batch: its generator stepped, each step's chunks sent as they are made.

A stage whose ``predict`` yields (:class:`workers.stage.Stage`) runs here instead of
:mod:`workers.loop.predicting`. Unbatched, each item has its own generator, run one after the other;
batched, each slice of at most ``batch_size`` items has one, whose every step is a sequence aligned
with the slice (per item a chunk, ``None`` or :data:`workers.stage.END`). After each step one round
trip (:func:`broker.chunks.publish_step`) pushes the step's chunk records to their callers' reply
lists and reads the cancel markers of the items still running: an item whose caller left leaves at
once, one whose deadline passed ends with ``DeadlineExceeded``; a generator left with no item is closed
(``GeneratorExit`` in the stage's code) before its next step.

An item's stream ends with its result record (``"chunks": n``), pushed with the step that ended it,
so that a short answer is not held for the batch's longest; the batch's one commit later writes the
result keys (without pushing them again) and acks. A continuous batch, which under a steady load may
never end, acks each entry whose items all ended in a commit that pushes their end records and writes
their result keys (:mod:`workers.loop.joiners`). A generator that raises ends every item it still
serves with that error: a stream cannot be bisected as a batch is (:mod:`workers.loop.runner`).

Delivery stays at-least-once: a worker killed mid-stream leaves the batch pending and another runs it
again. Its records carry the delivery count (``run``); from a stage that declares itself
``deterministic`` they also say ``resume``, and the caller skips the chunks it already has.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from broker import codec, protocol
from broker.chunks import StepPublisher
from broker.commit import BatchStats, Commit
from broker.errors import SyncClient
from broker.keys import Keys
from workers.loop.joiners import EndedAcks
from workers.loop.problems import Problems
from workers.loop.routing import Work
from workers.loop.runner import USER_ERRORS, Failure, failure
from workers.loop.tracebacks import Tracebacks
from workers.loop.tracing import StageTracing
from workers.pipeline import StageSpec
from workers.process.watch import BusyCell
from workers.stage import END, LiveBatch, Stage

log = logging.getLogger("conveyor.worker")

__all__ = ["More", "StreamRunner"]

More = Callable[[int], "Work"]  # up to n new items, read and admitted into the batch's commit
# Items measured together (workers.loop.tracing): the first ones of a batch, or a group that joined it:
# their traced indices, when they joined (perf_counter), the tracing's state for them.
_Joined = tuple["Work", list[int], float, tuple[int, float, dict[int, tuple[bytes, bytes, bytes]]]]


@dataclass(slots=True)
class _ItemChunks:
    """One item's stream: how many chunks it sent, and how it ended (None: still running)."""

    item: protocol.Item
    run: int
    seq: int = 0
    final: bytes | None = None  # its result record, once it ended with one
    left: bool = False  # its caller left (cancelled): no record at all
    error: Failure | None = None  # how it failed, if its stage raised
    acked: bool = False  # its entry acked, its result written, before the batch's end (workers.loop.joiners)

    @property
    def running(self) -> bool:
        return self.final is None and not self.left


# What a free slot of a continuous batch is to a step: an item that is not running (its value is ignored).
_FREE = _ItemChunks(protocol.Item(b"0-0", b"free", b"", None, None), 0, left=True)


@dataclass
class _Step:  # what one step sends: records by reply key
    pushes: dict[bytes, list[bytes]] = field(default_factory=dict)

    def add(self, reply: bytes | None, record: bytes) -> None:
        if reply is not None:
            self.pushes.setdefault(reply, []).append(record)


class StreamRunner:
    def __init__(self, stage: Stage, spec: StageSpec, client: SyncClient, reply_ttl_ms: int, max_payload_bytes: int,
                 problems: Problems, busy: BusyCell | None, tracing: StageTracing | None = None) -> None:
        self._tracing = tracing  # the worker's: each item's wait, and its stream as its predict span
        self._stage = stage
        self._spec = spec
        self._publish = StepPublisher(client, reply_ttl_ms)
        self._limit = max_payload_bytes
        self._problems = problems
        self._busy = busy
        self._tracebacks = Tracebacks()
        self._ended: EndedAcks | None = None
        self._done: list[_ItemChunks] = []

    def run(self, work: Work, deliveries: dict[bytes, int] | None, keys: Keys, commit: Commit,
            stats: BatchStats, more: More | None = None, ended: EndedAcks | None = None) -> int:
        """Stream every item of ``work``; their result records into ``commit`` (written, not pushed
        again: each was pushed as its stream ended). Returns how many items ran. ``more(n)``: up to
        ``n`` new items, read and admitted into ``commit`` (a continuous stage's joiners); ``ended``:
        a continuous batch's, which may outlive many of its items: its entries acked as they end."""
        self._ended = ended
        tracing = self._tracing
        traced = tracing.before(work, stats, deliveries) if tracing is not None else []
        began = time.perf_counter()
        streams = [_ItemChunks(item, deliveries.get(item.entry_id, 1) if deliveries else 1) for item, _ in work]
        joins: list[_Joined] = []
        try:  # idle also after an error (a node lost mid-stream): else its worker looks busy for ever
            if self._spec.continuous:
                more = more or (lambda n: [])
                if tracing is not None:
                    more = self._measured(more, tracing, stats, joins, bool(traced))
                done = self._run_continuous(list(zip(streams, (x for _, x in work), strict=True)), keys, stats, more)
            else:
                self._run_slices(work, streams, keys, stats)
                done = streams
        finally:
            if self._busy is not None:
                self._busy.idle()
        if tracing is not None:
            self._measure_ends(tracing, stats, [(work, traced, began, tracing.held()), *joins], done)
        return self._results(done, keys, commit)

    @staticmethod
    def _measure_ends(tracing: StageTracing, stats: BatchStats, groups: list[_Joined], done: list[_ItemChunks]) -> None:
        """The predict spans of the batch's items, the first ones' and each group of joiners' (``done``:
        their streams, in the order they were read), all ending now."""
        ended, at = time.perf_counter(), 0
        for group, traced, began, held in groups:
            streams, at = done[at:at + len(group)], at + len(group)
            if traced:
                tracing.resume(held)
                outcomes = [(True, None) if s.error is None else (False, s.error) for s in streams]
                tracing.after(group, traced, outcomes, [(0, len(group), began, ended, len(group))], stats)

    @staticmethod
    def _measured(more: More, tracing: StageTracing, stats: BatchStats, joins: list[_Joined], counted: bool) -> More:
        """``more``, its items measured as they join the running call: their waits counted, the traced
        ones' wait spans recorded now, their predict spans at the batch's end (as its first items')."""
        first = tracing.held()

        def measured(count: int) -> Work:
            nonlocal counted  # the call's batch id is drawn once, by its first traced items
            new = more(count)
            if new:
                traced = tracing.before(new, stats, None, same_call=counted)
                counted = counted or bool(traced)
                joins.append((new, traced, time.perf_counter(), tracing.held()))
                tracing.resume(first)
            return new

        return measured

    def _run_slices(self, work: Work, streams: list[_ItemChunks], keys: Keys, stats: BatchStats) -> None:
        """Each slice of at most ``batch_size`` (one item for a singleton stage) streamed to its end."""
        size = self._spec.batch_size if self._spec.batched else 1
        for start in range(0, len(work), size):
            part = streams[start:start + size]
            began = time.perf_counter()
            if self._busy is not None:
                self._busy.batch(self._spec, [s.item.deadline_ms for s in part])
            inputs = [x for _, x in work[start:start + size]]
            if self._spec.batched:
                self._run_batched(part, inputs, keys)
            else:
                self._run_one(part[0], inputs[0], keys)
            stats.add(len(part), (time.perf_counter() - began) * 1000)

    @staticmethod
    def _results(streams: list[_ItemChunks], keys: Keys, commit: Commit) -> int:
        for stream in streams:
            if stream.final is not None and not stream.acked:
                commit.publish(keys.result_key(stream.item.request_id), stream.final, None)
        return len(streams)

    # -- a continuous batch: new items join between steps -------------------------------------------

    def _run_continuous(self, queue: list[tuple[_ItemChunks, Any]], keys: Keys, stats: BatchStats,
                        more: More) -> list[_ItemChunks]:
        """Generators over a `LiveBatch` until nothing is queued or readable: between steps, the slots of
        items that ended or left are freed and free slots take queued items, then new ones (``more``)."""
        done = self._done = [stream for stream, _ in queue]  # every item's, as they join (self._ended's)
        while queue:
            began = time.perf_counter()
            batch = LiveBatch(self._spec.batch_size)
            slots: list[_ItemChunks | None] = [None] * self._spec.batch_size
            joined = len(self._join(batch, slots, queue, keys, more, done))
            if not joined:
                break
            self._run_live(batch, slots, queue, keys, more, done)
            stats.add(joined, (time.perf_counter() - began) * 1000)
        return done

    def _run_live(self, batch: LiveBatch, slots: list[_ItemChunks | None], queue: list[tuple[_ItemChunks, Any]],
                  keys: Keys, more: More, done: list[_ItemChunks]) -> None:
        """One generator over ``batch`` until it is empty or the generator ends (returns or raises):
        an ended generator takes no more items, and those that joined it since its last step, which
        it never served, go back to the head of ``queue`` for a new one (after its first step: a
        generator that ends at once ends its items, so that every round makes progress)."""
        try:
            steps: Iterator[Any] = self._stage.predict(batch)
        except USER_ERRORS as exc:  # user code
            self._failed([s for s in slots if s is not None], exc, keys)
            return
        try:
            joined: list[tuple[_ItemChunks, Any]] = []  # since the last step; the first step's items are its own
            while batch:
                live = [s for s in slots if s is not None]
                step = _Step()
                new = {id(stream) for stream, _ in joined}
                if not self._step(steps, [s or _FREE for s in slots], step, spare=new):
                    self._send(step, live, keys)
                    queue[:0] = [(stream, x) for stream, x in joined if stream.running]
                    return
                self._send(step, live, keys)
                for slot, stream in enumerate(slots):
                    if stream is not None and not stream.running:
                        slots[slot] = None
                        batch.free(slot)
                joined = self._join(batch, slots, queue, keys, more, done)
        finally:
            _close(steps)

    def _join(self, batch: LiveBatch, slots: list[_ItemChunks | None], queue: list[tuple[_ItemChunks, Any]], keys: Keys,
              more: More, done: list[_ItemChunks]) -> list[tuple[_ItemChunks, Any]]:
        """Free slots take queued items, then newly read ones; returns those that joined. The supervisor's
        watch is told the deadlines of the items the batch now holds: it is stuck only past those."""
        free = [slot for slot, stream in enumerate(slots) if stream is None]
        if free and len(queue) < len(free):
            fresh = [(_ItemChunks(item, 1), x) for item, x in more(len(free) - len(queue))]
            done += [stream for stream, _ in fresh]
            queue += fresh
        joined: list[tuple[_ItemChunks, Any]] = []
        while free and queue:
            stream, x = queue.pop(0)
            if not stream.running:
                continue
            slot = free.pop(0)
            slots[slot] = stream
            batch.fill(slot, x)
            joined.append((stream, x))
        if joined and self._busy is not None:  # not its first items' deadlines: a live batch outlives them
            self._busy.batch(self._spec, [s.item.deadline_ms for s in slots if s is not None])
        return joined

    # -- one generator per item ------------------------------------------------------------------

    def _run_one(self, stream: _ItemChunks, x: Any, keys: Keys) -> None:
        if self._gone([stream], keys):
            return
        try:
            chunks: Iterator[Any] = self._stage.predict(x)
        except USER_ERRORS as exc:  # user code
            self._failed([stream], exc, keys)
            return
        try:
            while stream.running:
                step = _Step()
                try:
                    chunk = next(chunks)
                except StopIteration as stop:
                    self._end(stream, step, stop.value)
                except USER_ERRORS as exc:  # user code: the item's answer is its error
                    self._fail(stream, step, exc)
                else:
                    self._chunk(stream, step, chunk)
                self._send(step, [stream], keys)
        finally:
            _close(chunks)

    # -- one generator per slice of a batch ------------------------------------------------------

    def _run_batched(self, part: list[_ItemChunks], inputs: list[Any], keys: Keys) -> None:
        """A batch's generator, stepped to its end. One that fails before its first step (the usual place: an
        input it cannot take) sent nothing yet, so its halves run again, on the items decoded again, as a unary
        batch's are: only the bad items get the error, never another caller's message (it may quote the input)."""
        if self._gone(part, keys):
            return
        steps: Iterator[Any] | None = None
        try:
            steps = self._stage.predict(inputs[:])
            first = next(steps)
            _check_step(first, len(part))
        except StopIteration:
            first = [END] * len(part)
        except USER_ERRORS as exc:  # user code
            _close(steps)
            if len(part) == 1:
                self._failed(part, exc, keys)
                return
            mid, inputs = len(part) // 2, [codec.decode(s.item.data) for s in part]  # not as predict left them
            self._run_batched(part[:mid], inputs[:mid], keys)
            self._run_batched(part[mid:], inputs[mid:], keys)
            return
        try:
            step = _Step()
            self._apply(part, first, step)
            self._send(step, part, keys)
            while steps is not None and any(s.running for s in part):
                step = _Step()
                self._step(steps, part, step)
                self._send(step, part, keys)
        finally:
            _close(steps)

    def _step(self, steps: Iterator[Any], part: list[_ItemChunks], step: _Step, spare: set[int] | None = None) -> bool:
        """One step of a batched stream into ``step``: its chunks and the items it ended. False if the
        generator ended (returned or raised), which ends every item it still serves, but for those
        in ``spare`` (ids of items it never served: they stay running)."""
        try:
            values = next(steps)
            _check_step(values, len(part))
        except StopIteration:  # every item still running ends with it
            for stream in part:
                if stream.running and id(stream) not in (spare or ()):
                    self._end(stream, step, None)
            return False
        except USER_ERRORS as exc:  # user code: every item it still serves gets the error
            for stream in part:
                if stream.running and id(stream) not in (spare or ()):
                    self._fail(stream, step, exc)
            return False
        self._apply(part, values, step)
        return True

    def _apply(self, part: list[_ItemChunks], values: Sequence[Any], step: _Step) -> None:
        for stream, value in zip(part, values, strict=True):
            if value is None or not stream.running:  # nothing this step, or a finished (or free) slot
                continue
            if value is END:
                self._end(stream, step, None)
            else:
                self._chunk(stream, step, value)

    # -- records ----------------------------------------------------------------------------------

    def _chunk(self, stream: _ItemChunks, step: _Step, value: Any) -> None:
        item = stream.item
        record = {"id": item.request_id.decode(), "seq": stream.seq, "chunk": value, "run": stream.run}
        if self._spec.deterministic:
            record["resume"] = True
        try:
            data = codec.encode(record)
        except codec.CodecError as exc:
            self._final(stream, step, self._error(stream, protocol.E_UNENCODABLE, f"chunk {stream.seq} of stage "
                                                  f"{self._spec.name!r} cannot be encoded: {exc}"))
            return
        if len(data) > self._limit:
            self._final(stream, step, self._error(stream, protocol.E_TOO_LARGE, f"chunk {stream.seq} of stage "
                        f"{self._spec.name!r} too large: {len(data)} bytes > max_payload_bytes={self._limit}"))
            return
        stream.seq += 1
        step.add(item.reply, data)

    def _end(self, stream: _ItemChunks, step: _Step, value: Any) -> None:
        item = stream.item
        record = {"id": item.request_id.decode(), "ok": True, "value": value, "chunks": stream.seq,
                  "run": stream.run}
        try:
            data = codec.encode(record)
        except codec.CodecError as exc:
            data = self._error(stream, protocol.E_UNENCODABLE, f"return value of stage {self._spec.name!r} cannot be "
                               f"encoded: {exc}")
        self._final(stream, step, data)

    def _fail(self, stream: _ItemChunks, step: _Step, exc: BaseException) -> None:
        why = stream.error = failure(exc, self._tracebacks)
        self._problems.stage_error(stream.item.request_id, why)
        self._final(stream, step, self._error(stream, why.type, why.message, why.traceback))

    def _error(self, stream: _ItemChunks, type_: str, message: str, traceback: str = "") -> bytes:
        """The error record ending ``stream``, with its run: a reader drops an earlier run's (a zombie worker's)."""
        return protocol.error_record(stream.item.request_id, type_, message, self._spec.name, traceback, run=stream.run)

    def _final(self, stream: _ItemChunks, step: _Step, record: bytes) -> None:
        stream.final = record
        step.add(stream.item.reply, record)

    def _failed(self, part: list[_ItemChunks], exc: BaseException, keys: Keys) -> None:
        """``predict`` raised before its first step: every item's error."""
        step = _Step()
        for stream in part:
            self._fail(stream, step, exc)
        self._send(step, part, keys)

    # -- Redis ------------------------------------------------------------------------------------

    def _gone(self, part: list[_ItemChunks], keys: Keys) -> bool:
        """Before a generator starts: its items already cancelled leave, those past their deadline end
        (``DeadlineExceeded``); True if none is left to run."""
        self._send(_Step(), part, keys)
        return not any(s.running for s in part)

    def _send(self, step: _Step, part: list[_ItemChunks], keys: Keys) -> None:
        """The step's records out (with a ``DeadlineExceeded`` end for items past their deadline: a reply
        list's reader waits for an end record), the running items' markers in: a caller who left, leaves."""
        now = protocol.now_ms()
        for stream in (s for s in part if s.running and s.item.deadline_ms is not None and now >= s.item.deadline_ms):
            self._final(stream, step, self._error(stream, protocol.E_DEADLINE, protocol.deadline_passed(
                stream.item.deadline_ms or 0, f"after {stream.seq} chunks of the stream")))
        ended = self._ended.take(self._done) if self._ended is not None else []  # acked with their ends, after
        # the step's chunks (workers.loop.joiners): held back, the ends this step made; those of earlier steps are out
        made = {id(record) for records in step.pushes.values() for record in records} if ended else set()
        held = {id(s.final) for s in ended if s.final is not None and id(s.final) in made}
        running = [s for s in part if s.running]
        pushes = [(reply, protocol.array_of(kept)) for reply, records in step.pushes.items()
                  if (kept := [record for record in records if id(record) not in held])]
        if pushes or running:
            left = self._publish(pushes, [keys.cancel_prefix + s.item.request_id for s in running])
            for stream in (s for s, cancelled in zip(running, left, strict=True) if cancelled):
                stream.left = True
                self._problems.cancelled(1)
        if ended and self._ended is not None:
            self._ended.ack(ended, held)

    def close(self) -> None:
        self._publish.close()


def _check_step(values: Any, size: int) -> None:
    """A batched stream's step must be a sequence of one value per item (a chunk, None or END)."""
    sized = hasattr(values, "__len__") and hasattr(values, "__getitem__") and getattr(values, "ndim", 1) > 0
    if isinstance(values, (str, bytes, dict)) or not sized or len(values) != size:
        raise TypeError(f"a streaming batched predict yields a sequence of {size} values per step (per item a "
                        f"chunk, None for nothing this step, or END), got {type(values).__name__}"
                        + (f" of {len(values)}" if sized else ""))


def _close(generator: Any) -> None:
    """Close the stage's generator (GeneratorExit in its code, so it may free what it holds); what it
    raises then is logged, never the batch's end."""
    close = getattr(generator, "close", None)
    if close is None:
        return
    try:
        close()
    except USER_ERRORS:  # user code
        log.exception("a streaming predict raised as it was closed")

