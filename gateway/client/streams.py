"""A streamed answer as it arrives: the chunks of one request, in order, each once.

The hub's reply reader hands each chunk record (:mod:`broker.chunks`) of a request to its
:class:`StreamSink` (``chunk``), and its final record (``finish``), the result record that carries the
chunk count. The sink keeps the order and says when it cannot: a chunk missing (a sequence number
skipped), or a second run of a stage that does not declare itself deterministic after chunks of the
first were given out, ends the stream with :class:`StreamInterrupted`, never a silent splice of two
runs. A deterministic stage's re-run says ``resume``: its chunks already given are skipped. A re-run is
told by its ``run`` (the delivery count) or, where that restarted at 1 (a batch entry delivered again
is split into new entries), by a chunk whose sequence number was given already: within one run each
sequence number comes once, in order.

Bounded: a consumer that does not take its chunks (a slow HTTP client, an ``async for`` that stalls) may
leave at most ``max_buffered`` of them here; past that the stream ends with :class:`StreamLagged` and the
hub cancels the request, so the stage's generator is closed at its next step (as for a caller who left).

A sink is a `Slot` (``done``, ``cancelled``, ``result``, ``exception``, ``set_result``, ``set_exception``,
``cancel``), so it waits in the hub's one table of requests.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Any

from gateway.client.slot import Slot
from gateway.errors import StageError

__all__ = ["StreamInterrupted", "StreamLagged", "StreamSink"]


class StreamInterrupted(StageError):
    """The stream cannot go on as one answer: a worker died mid-stream and the stage's re-run is not
    declared deterministic, or chunks went missing (Redis lost them)."""

    def __init__(self, message: str, stage: str = "") -> None:
        super().__init__("StreamInterrupted", message, stage)


class StreamLagged(StageError):
    """The consumer fell more than ``max_buffered`` chunks behind: the stream was cancelled."""

    def __init__(self, message: str) -> None:
        super().__init__("StreamLagged", message, "")


class StreamSink(Slot):
    """A `Slot` (its state, result and exception) that also holds the stream's chunks; its consumer listens
    (:meth:`listen`) or awaits (:meth:`next`) instead of taking a done-callback."""

    __slots__ = ("_chunks", "_delivery", "_listener", "_max", "_next", "_wakeup", "on_abandon")

    def __init__(self, loop: asyncio.AbstractEventLoop, max_buffered: int) -> None:
        super().__init__(loop)
        self._max = max_buffered
        self._chunks: deque[Any] = deque()
        self._next = 0  # the sequence number of the next chunk expected
        self._delivery = 0  # the delivery (run) whose chunks are being given out; 0: none yet
        self._wakeup: asyncio.Future[None] | None = None
        self._listener: Callable[[], object] | None = None
        # Called when the sink gives up on its own (interrupted, lagged): the hub cancels the request.
        self.on_abandon: Callable[[StreamSink], object] | None = None

    # -- what the hub calls --------------------------------------------------------------------

    def chunk(self, record: dict[str, Any]) -> None:
        """One chunk record, as the reply reader decoded it."""
        if self.done():
            return
        seq, run = record.get("seq"), record.get("run", 1)
        if type(seq) is not int or type(run) is not int:
            return
        resume = bool(record.get("resume"))
        if run != self._delivery and not self._adopt(run, resume):
            return
        if seq < self._next:  # a chunk given already: the stage runs the request again
            if not resume:  # (a batch entry run again is split into new entries: its run may say 1 again)
                self._give_up(StreamInterrupted(f"the stage ran the request again (its worker stopped mid-stream) "
                                                f"after {self._next} chunks were sent, and it does not declare "
                                                "itself deterministic"))
            return
        if seq > self._next:
            self._give_up(StreamInterrupted(f"chunk {self._next} of the stream is missing (chunk {seq} came "
                                            "next): Redis lost part of it"))
            return
        self._next += 1
        self._chunks.append(record.get("chunk"))
        if len(self._chunks) > self._max:
            self._give_up(StreamLagged(f"the stream's reader fell {len(self._chunks)} chunks behind "
                                       f"(stream_buffer_chunks={self._max}): cancelled"))
            return
        self._wake()

    def finish(self, record: dict[str, Any]) -> bool:
        """The stream's last record (a result record); False if it is not this stream's end (an
        earlier run's, or one whose chunks did not all come). An error record of a later run ends the stream
        (its chunks given or not), else a run again that failed would leave its caller waiting out its timeout;
        one of an earlier run is a straggler (a worker taken for dead that went on); one that says no run (a
        dead letter) ends it whichever run is being given out."""
        if self.done():
            return True
        run, chunks = record.get("run"), record.get("chunks")
        if type(run) is int and run != self._delivery and (run < self._delivery if record.get("ok") is False
                                                           else not self._adopt(run, bool(record.get("resume")))):
            return True
        if type(chunks) is int and chunks > self._next:
            self._give_up(StreamInterrupted(f"the stream ended after {chunks} chunks, of which {self._next} came: "
                                            "Redis lost part of it"))
            return True
        return False

    def _adopt(self, run: int, resume: bool) -> bool:
        """A record of another run than the chunks given so far: whether its chunks may follow them."""
        if run < self._delivery:
            return False  # an earlier run's straggler
        if self._next and not resume:
            self._give_up(StreamInterrupted(f"the stage ran the request again (its worker stopped mid-stream, run "
                                            f"{run}) after {self._next} chunks of the first run were sent, and it "
                                            "does not declare itself deterministic"))
            return False
        self._delivery = run
        return True

    def _give_up(self, exc: BaseException) -> None:
        self.set_exception(exc)
        if self.on_abandon is not None:
            self.on_abandon(self)

    # -- the Slot interface the hub uses ---------------------------------------------------------

    def set_result(self, value: Any) -> None:
        if not self.done():  # a stream ends once: a late end (a run again) is dropped, not an error
            super().set_result(value)
            self._wake()

    def set_exception(self, exc: BaseException) -> None:
        if not self.done():
            super().set_exception(exc)
            self._wake()

    def cancel(self) -> bool:
        if not super().cancel():
            return False
        self._wake()
        return True

    # -- the consumer's side ---------------------------------------------------------------------

    def listen(self, listener: Callable[[], object]) -> None:
        """``listener()`` is called as chunks arrive and at the end (the HTTP front: no task per
        stream); it takes them with :meth:`take`."""
        self._listener = listener
        if self._chunks or self.done():
            self._loop.call_soon(listener)

    def take(self) -> list[Any]:
        """The chunks arrived and not yet taken, oldest first."""
        chunks = list(self._chunks)
        self._chunks.clear()
        return chunks

    @property
    def buffered(self) -> int:
        return len(self._chunks)

    async def next(self) -> tuple[bool, Any]:
        """(True, the next chunk), or (False, the generator's return value) at the end; raises the
        stream's error."""
        while True:
            if self._chunks:
                return True, self._chunks.popleft()
            if self.done():
                return False, self.result()
            self._wakeup = self._loop.create_future()
            try:
                await self._wakeup
            finally:
                self._wakeup = None

    def _wake(self) -> None:
        """Tell the consumer. Its listener runs in the waker's stack (the reply reader's delivery, the deadline
        timer's walk, a refused turn's failures): as a Slot's done-callback (`Slot._run`), its error is
        reported, not raised into them, where it would leave the timer unarmed and an element's other answers
        (or the turn's other failures) undelivered."""
        wakeup = self._wakeup
        if wakeup is not None and not wakeup.done():
            wakeup.set_result(None)
        if self._listener is not None:
            try:
                self._listener()
            except Exception as exc:
                self._loop.call_exception_handler({"message": "exception in a StreamSink's listener", "exception": exc})
