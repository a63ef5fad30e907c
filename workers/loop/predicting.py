"""A batch's inputs through the stage's ``predict``: in slices of at most ``batch_size``, each one
watched by the supervisor (its deadlines, :class:`workers.process.watch.BusyCell`) and counted in the
stage's stats as one call.

Why slices: a read of batch entries (:mod:`workers.loop.batch_entries`) may bring more than a batch (a
fresh reader, entries of mixed sizes, one written by hand), and a model with a fixed largest batch must
never see more. The batch is still committed once.

A batched ``predict`` answers with a list, tuple or array of one result per item. What only looks like
one (a dict, whose keys would be taken as the results; a str; a set; a generator; a 0-d array) is a
:class:`BatchResultError`, handled as a wrong number of results is (:func:`workers.loop.runner.run_batch`:
isolated by bisection, each item still failing gets it, logged and counted as a batch length error).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence, Set, Sized
from typing import Any

import numpy as np

from broker.commit import BatchStats
from workers.batching.grouping import run_grouped
from workers.loop.handoff import Handoff
from workers.loop.routing import Work
from workers.loop.runner import (
    EXPIRED,
    USER_ERRORS,
    BatchLengthError,
    Outcome,
    detach,
    detached,
    failure,
    passed,
    run_batch,
    run_live_batch,
    run_single,
)
from workers.loop.tracebacks import Tracebacks
from workers.pipeline import StageSpec
from workers.process.watch import BusyCell
from workers.stage import Stage

Slice = tuple[int, int, float, float, int]  # a predict call: first item, end, began, ended (perf_counter s), size


class BatchResultError(BatchLengthError):
    """A batched predict returned something other than a sequence of results (a dict, a str, a set,
    an iterator, a 0-d array): counted and isolated as a wrong length is."""


def _a(what: str) -> str:
    return f"{'an' if what[:1].lower() in 'aeio' else 'a'} {what}"


def _kind(results: Any) -> tuple[str, str] | None:
    """What ``results`` is and a hint, if it cannot be one result per item (None if it may be)."""
    name = type(results).__name__
    if isinstance(results, Mapping):
        return _a(name), "; to answer each item with a dict, return a list of dicts"
    if isinstance(results, (str, bytes, bytearray)):
        return ("bytes" if name == "bytes" else _a(name)), ""
    if isinstance(results, Set):
        return _a(name), " (a set has no order)"
    if isinstance(results, Iterator):
        return _a(name), "; wrap it in list(...)"
    if getattr(results, "ndim", None) == 0:  # numpy's (and torch's, jax's) scalars and 0-d arrays
        if isinstance(results, np.generic):
            return f"a numpy {name} scalar", ""
        return f"a 0-d {'numpy array' if isinstance(results, np.ndarray) else name}", ""
    if name == "DataFrame" and type(results).__module__.split(".")[0] in ("pandas", "polars"):
        return "a DataFrame", " (iterating one yields its columns)"
    if results is None:
        return "None", ""
    if not isinstance(results, Sized) or not isinstance(results, Iterable):
        return _a(name), ""
    return None


def check_batch_result(results: Any, size: int) -> None:
    """A :class:`BatchResultError` unless ``results`` may be a batched predict's answer for a batch of
    ``size``: a list, a tuple, an array along its first axis, or another sized, ordered sequence (its
    length :func:`workers.loop.runner.run_batch` checks)."""
    kind = type(results)
    if kind is list or kind is tuple or (kind is np.ndarray and results.ndim > 0):
        return
    found = _kind(results)
    if found is not None:
        what, hint = found
        raise BatchResultError(f"predict returned {what} for a batch of {size}; a batched predict returns a "
                               f"list, tuple or array of {size} result{'s' if size != 1 else ''}, one per "
                               f"item{hint}")


def checked(predict: Callable[[list[Any]], Any]) -> Callable[[list[Any]], Any]:
    """``predict``, its answers checked by :func:`check_batch_result`."""
    def call(inputs: list[Any]) -> Any:
        size = len(inputs)  # before predict, which may change its list
        results = predict(inputs)
        check_batch_result(results, size)
        return results
    return call


class Predictor:
    def __init__(self, stage: Stage, spec: StageSpec, busy: BusyCell | None,
                 wrong_length: Callable[[int, int], None], handoff: Handoff | None = None) -> None:
        self._stage = stage
        self._spec = spec
        self._busy = busy
        self._tracebacks = Tracebacks()  # a stage error's stack, formatted once per place it is raised from
        self._wrong_length = wrong_length
        self._handoff = handoff  # entries waiting behind a long call go to other workers
        # The last run's predict calls: (first item, end, start, end in perf_counter seconds, items it
        # ran), for the spans and timings of its traced items (workers.loop.tracing).
        self.slices: list[Slice] = []
        self._called = False  # a batched call of this run was made: the next ones look at deadlines again

    def run(self, work: Work, stats: BatchStats, handoff: bool = True) -> list[Outcome | None]:
        """The outcome of each item of ``work``, in order (None: given to another worker, not run).
        ``handoff``: False for a batch read from several streams (a hand-off gives back to one)."""
        try:
            return self._run_all(work, stats, handoff)
        finally:  # also after an error that leaves the batch: else its worker looks busy for ever (autoscaling)
            if self._busy is not None:
                self._busy.idle()

    def _run_all(self, work: Work, stats: BatchStats, handoff: bool) -> list[Outcome | None]:
        spec = self._spec
        outcomes: list[Outcome | None] = []
        self.slices = []
        self._called = False
        giver = self._handoff if handoff else None
        if giver is not None:
            giver.track(outcomes)
            if not spec.batched:
                return self._run_singles(work, stats, giver, outcomes)
        size = spec.batch_size if spec.batched else len(work)
        for start in range(0, len(work), size):
            part = work[start:start + size]
            begin = len(outcomes)
            kept = None if giver is None else giver.start(start, start + len(part))
            if kept is not None:  # some were given back: run the others
                outcomes += self._run_kept(work, kept, start, len(part), stats)
            else:
                outcomes += self._run_part(part, start, stats)
            if start + size < len(work):  # another call follows before these are encoded
                detach(outcomes, begin)
        return outcomes

    def _run_part(self, part: Work, start: int, stats: BatchStats, end: int = 0) -> list[Outcome]:
        """One call on ``part``, the items ``start`` to ``end`` (or as many as ``part`` holds) but
        those given to another worker."""
        began = time.perf_counter()
        deadlines_ms = [item.deadline_ms for item, _ in part]
        if self._busy is not None:
            self._busy.batch(self._spec, deadlines_ms)
        outcomes = self._call([x for _, x in part], deadlines_ms, [item.data for item, _ in part])
        ended = time.perf_counter()
        self.slices.append((start, end or start + len(part), began, ended, len(part)))
        took_s = ended - began
        if self._handoff is not None:
            self._handoff.took(1, took_s)
        ran = len(part) - outcomes.count(EXPIRED)  # expired ones were never run
        if ran:
            self._record(stats, ran, took_s * 1000)
        return outcomes

    def _run_kept(self, work: Work, kept: list[int], start: int, size: int, stats: BatchStats) -> list[Outcome | None]:
        """A part of which some items were given back: the others run, the given ones are None."""
        ran = iter(self._run_part([work[i] for i in kept], start, stats, start + size) if kept else ())
        keep = set(kept)
        return [next(ran) if i in keep else None for i in range(start, start + size)]

    def _run_singles(self, work: Work, stats: BatchStats, handoff: Handoff,
                     outcomes: list[Outcome | None]) -> list[Outcome | None]:
        """A singleton stage's read, one call per item, each looked at by the hand-off first."""
        if self._busy is not None:
            self._busy.batch(self._spec, [item.deadline_ms for item, _ in work])
        predict, tracebacks, start, append = self._stage.predict, self._tracebacks, handoff.start, outcomes.append
        began, last = time.perf_counter(), len(work) - 1
        for i, (item, x) in enumerate(work):
            if start(i, i + 1) == []:
                append(None)
                continue
            if i and passed(item.deadline_ms):  # it expired as the items before it ran
                append(EXPIRED)
                continue
            try:
                y = predict(x)
                append((True, y if i == last else detached(y)))  # the next call may reuse its buffers
            except USER_ERRORS as exc:  # user code: any exception is that item's answer
                append((False, failure(exc, tracebacks)))
        ran = len(work) - outcomes.count(None) - outcomes.count(EXPIRED)
        ended = time.perf_counter()
        self.slices.append((0, len(work), began, ended, 1))  # one clock for the read: its calls share it evenly
        took_s = ended - began
        handoff.took(ran, took_s)
        if ran:
            self._record(stats, ran, took_s * 1000)
        return outcomes

    def _call(self, inputs: list[Any], deadlines_ms: list[int | None], payloads: list[bytes]) -> list[Outcome]:
        if self._spec.batched:  # length-aware, if the stage asks for it
            return run_grouped(self._stage, inputs, self._spec.batch_size, self._run_batch, deadlines_ms,
                               self._spec.name, payloads)
        return run_single(self._stage.predict, inputs, self._tracebacks, deadlines_ms)

    def _run_batch(self, predict: Callable[[list[Any]], Any], inputs: list[Any],
                   deadlines_ms: Sequence[int | None], payloads: Sequence[bytes]) -> list[Outcome]:
        """One batched call, a failing one bisected on the inputs decoded again from ``payloads``."""
        if self._called:  # the calls before it took time: what expired meanwhile is not run
            return run_live_batch(checked(predict), inputs, self._wrong_length, self._tracebacks, deadlines_ms,
                                  payloads)
        self._called = True  # the read checked every deadline just before the first call
        return run_batch(checked(predict), inputs, self._wrong_length, self._tracebacks, deadlines_ms, payloads)

    def _record(self, stats: BatchStats, size: int, duration_ms: float) -> None:
        """One stats value per predict call: a singleton stage's read of k entries is k calls."""
        if self._spec.batched or size <= 1:
            stats.add(size, duration_ms)
            return
        for _ in range(size):
            stats.add(1, duration_ms / size)
