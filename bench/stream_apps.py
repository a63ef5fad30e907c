"""The streaming workload of ``bench.streams``: conveyor's stage, and the chunks both sides make.

One stage, batched (at most 64 items, 2 ms window, one worker process): item ``n`` streams
:data:`CHUNKS` small JSON chunks, one step per chunk for the whole batch, and no sleep, so what is
measured is the serving machinery (batching, hand-off of every chunk, HTTP), not a model. Both
sides make the same chunk values with :func:`chunk`; the first chunk of each item also carries
``t``, the microseconds the stage's own code took from its start to its first yield, so the
benchmark can set the time to first chunk seen by a client against the stage's own share of it.

conveyor: ``conveyor worker bench.stream_apps:pipeline --stage Ticks`` and ``conveyor gateway
bench-streams`` (``POST /v1/stream``). A batched streaming stage yields, per step, a list with one
value per item (returning ends every item still running, each with its ``done`` event).

mosec's side is :mod:`bench.stream_mosec`, a module of its own: importing mosec parses the process's
command line (its log level), which breaks ``conveyor worker``'s, so the stage here must not import it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from workers import END, Pipeline, Stage

CHUNKS = 32
BATCH_SIZE = 64
BATCH_WAIT_MS = 2
PIPELINE_NAME = "bench-streams"
STAGE_NAME = "Ticks"


def chunk(n: Any, i: int) -> dict[str, Any]:
    """Chunk ``i`` of item ``n``: a few bytes of JSON, the same on both sides."""
    return {"n": n, "i": i}


def first_chunk(n: Any, began: float) -> dict[str, Any]:
    """Chunk 0, with ``t``: the stage's own microseconds from its start to this, its first yield."""
    return {"n": n, "i": 0, "t": round((time.perf_counter() - began) * 1e6, 1)}


class Ticks(Stage):
    """conveyor's side: a batched streaming stage, one step per chunk for the whole batch."""

    batch_size = BATCH_SIZE
    batch_wait_s = BATCH_WAIT_MS / 1000

    def predict(self, ns: list[Any]) -> Iterator[list[Any]]:
        began = time.perf_counter()
        yield [first_chunk(n, began) for n in ns]
        for i in range(1, CHUNKS):
            yield [chunk(n, i) for n in ns]
        # returning ends every item (each gets its done event)


pipeline = Pipeline(PIPELINE_NAME).add(Ticks)
# The same stage under the "deadline" batch policy (always waits batch_wait_s for a fuller batch, as mosec's
# batcher does), for ``bench.streams --batch-policy deadline``: the default "adaptive" policy starts a batch
# as soon as waiting cannot pay (for a streaming stage: against a whole stream's wait for a caller who misses it).
pipeline_deadline = Pipeline(PIPELINE_NAME + "-deadline").add(Ticks, batch_policy="deadline")


class LiveTicks(Stage):
    """The same chunks from a continuous batch (``continuous = True``): items join the running generator
    between its steps instead of waiting for the batch before them to end; ``t`` counts from the step
    at which the stage saw the item join."""

    name = STAGE_NAME  # the benchmark starts the worker of stage "Ticks", whichever variant
    batch_size = BATCH_SIZE
    batch_wait_s = BATCH_WAIT_MS / 1000
    continuous = True

    def predict(self, batch: Any) -> Iterator[list[Any]]:
        steps: dict[int, int] = {}
        joined_at: dict[int, float] = {}
        while batch:
            for slot in batch.joined():
                steps[slot], joined_at[slot] = 0, time.perf_counter()
            out: list[Any] = [None] * len(batch)
            for slot in range(len(batch)):
                if batch.occupied(slot):
                    i = steps[slot]
                    out[slot] = END if i >= CHUNKS else (
                        first_chunk(batch[slot], joined_at[slot]) if i == 0 else chunk(batch[slot], i))
                    steps[slot] = i + 1
            yield out


pipeline_continuous = Pipeline(PIPELINE_NAME + "-continuous").add(LiveTicks)
