"""A batch that ends with an error (a lost Redis node mid-stream) leaves its worker's busy cell idle:
otherwise autoscaling counts that worker busy for ever and the supervisor's frozen check is off for it."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from broker.commit import BatchStats, Commit
from broker.connection import RedisSettings
from broker.keys import Keys
from broker.protocol import Item
from workers import Stage
from workers.loop.problems import Problems
from workers.loop.streaming import StreamRunner
from workers.pipeline import StageSpec
from workers.process.watch import BusyCell, StuckWatch


class Gen(Stage):
    def predict(self, x: Any) -> Iterator[Any]:
        yield x
        yield x


def _lost(*_: Any) -> list[bool]:
    raise redis.ConnectionError("node lost")


def test_a_streaming_batch_that_raises_leaves_the_cell_idle() -> None:
    watch = StuckWatch(1, RedisSettings("redis://127.0.0.1:9/0"))  # never reached
    cell = BusyCell(os.dup(watch.fd), 0)
    spec = StageSpec(Gen, 0, "gen")
    keys = Keys("t")
    runner = StreamRunner(Gen(), spec, redis.Redis(port=9), 60_000, 1 << 20, Problems("gen", keys.counts(0)), cell)
    runner._publish = _lost  # type: ignore[assignment]
    item = Item(b"1-0", b"r1", b"", None, None)
    with pytest.raises(redis.ConnectionError):
        runner.run([(item, "x")], None, keys, Commit(acks=[b"1-0"]), BatchStats())
    assert watch.batch_s(0) is None  # not in a batch any more: the lane is set aside, the worker idles
    time.sleep(0.6)
    cell.batch(spec, [None])  # the next batch is counted from its own start, not the failed one's
    assert (watch.batch_s(0) or 0.0) < 0.5
