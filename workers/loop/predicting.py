"""A batch's inputs through the stage's ``predict``: in slices of at most ``batch_size``, each one
watched by the supervisor (its deadlines, :class:`workers.process.watch.BusyCell`) and counted in the
stage's stats as one call.

Why slices: a read of batch entries (:mod:`workers.loop.packing`) may bring more than a batch (a
fresh reader, entries of mixed sizes, one written by hand), and a model with a fixed largest batch must
never see more. The batch is still committed once.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

from broker.commit import BatchStats
from workers.batching.grouping import run_grouped
from workers.loop.routing import Work
from workers.loop.runner import Outcome, run_batch, run_single
from workers.loop.tracebacks import Tracebacks
from workers.pipeline import StageSpec
from workers.process.watch import BusyCell
from workers.stage import Stage


class Predictor:
    def __init__(self, stage: Stage, spec: StageSpec, busy: BusyCell | None,
                 wrong_length: Callable[[int, int], None]) -> None:
        self._stage = stage
        self._spec = spec
        self._busy = busy
        self._tracebacks = Tracebacks()  # a stage error's stack, formatted once per place it is raised from
        self._run_batch = functools.partial(run_batch, wrong_length=wrong_length, tracebacks=self._tracebacks)

    def run(self, work: Work, stats: BatchStats) -> list[Outcome]:
        """The outcome of each item of ``work``, in order."""
        spec = self._spec
        size = spec.batch_size if spec.batched else len(work)
        outcomes: list[Outcome] = []
        for start in range(0, len(work), size):
            part = work[start:start + size]
            began = time.perf_counter()
            if self._busy is not None:
                self._busy.batch(spec, [item.deadline_ms for item, _ in part])
            outcomes += self._call([x for _, x in part])
            self._record(stats, len(part), (time.perf_counter() - began) * 1000)
        if self._busy is not None:
            self._busy.idle()
        return outcomes

    def _call(self, inputs: list[Any]) -> list[Outcome]:
        if self._spec.batched:  # length-aware, if the stage asks for it
            return run_grouped(self._stage, inputs, self._spec.batch_size, self._run_batch)
        return run_single(self._stage.predict, inputs, self._tracebacks)

    def _record(self, stats: BatchStats, size: int, duration_ms: float) -> None:
        """One stats value per predict call: a singleton stage's read of k entries is k calls."""
        if self._spec.batched or size <= 1:
            stats.add(size, duration_ms)
            return
        for _ in range(size):
            stats.add(1, duration_ms / size)
