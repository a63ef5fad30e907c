"""Streaming stages for tests/test_streaming.py: each yields its answer piece by piece, and records
what it ran and what was closed in a file (``STREAM_RUNS``), so a test sees the worker's side."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from workers import END, Pipeline, Stage


def _note(line: str) -> None:
    path = os.environ.get("STREAM_RUNS")
    if path:
        with Path(path).open("a") as f:
            f.write(line + "\n")


class Upper(Stage):
    """A unary stage before the streaming one."""

    def predict(self, x: Any) -> Any:
        return x


class Words(Stage):
    """Yields each word of a text, ``pause_s`` apart; a text with "boom" raises after its first word."""

    pause_s = 0.0

    def predict(self, text: str) -> Iterator[str]:
        _note(f"start {text}")
        try:
            for n, word in enumerate(text.split()):
                if word == "boom" and n:
                    raise RuntimeError("boom in the middle")
                yield word
                time.sleep(self.pause_s)
        except GeneratorExit:
            _note(f"closed {text}")
            raise
        _note(f"end {text}")
        return len(text.split())


class Count(Stage):
    """Batched: item ``n`` yields 0..n-1, then END; a step per number, ``pause_s`` apart."""

    batch_size = 8
    batch_wait_s = 0.005
    pause_s = 0.0

    def predict(self, ns: list[int]) -> Iterator[list[Any]]:
        _note(f"batch {len(ns)}")
        try:
            for step in range(max(ns) + 1):
                yield [step if step < n else (END if step == n else None) for n in ns]
                time.sleep(self.pause_s)
        except GeneratorExit:
            _note("closed batch")
            raise


class CheckedCount(Count):
    """Count that refuses what is not a count as it starts, quoting it (a caller's input): one batch."""

    batch_wait_s = 0.3
    batch_policy = "deadline"

    def predict(self, ns: list[Any]) -> Iterator[list[Any]]:
        _note(f"checked {len(ns)}")
        for n in ns:
            if not isinstance(n, int):
                raise TypeError(f"expected a count, got {n!r}")
        yield from super().predict(ns)


class Tokens(Stage):
    """Batched: puts a start token before each id list in place (a common slip), refuses a negative id
    before its first step, then yields each list's ids one step at a time."""

    batch_size = 8
    batch_wait_s = 0.3
    batch_policy = "deadline"

    def predict(self, xs: list[list[int]]) -> Iterator[list[Any]]:
        for x in xs:
            x.insert(0, 101)
        if any(i < 0 for x in xs for i in x):
            raise ValueError("negative token id")
        for step in range(max(len(x) for x in xs) + 1):
            yield [x[step] if step < len(x) else (END if step == len(x) else None) for x in xs]


words = Pipeline("t-words").add(Words)
checked_counts = Pipeline("t-checked-counts").add(CheckedCount)
slow_words = Pipeline("t-slow-words").add(Words, pause_s=0.05)
counts = Pipeline("t-counts").add(Count)
tokens = Pipeline("t-tokens").add(Tokens)
two = Pipeline("t-two").add(Upper).add(Words)


class Slow(Stage):
    """Unary, 0.1 s per item: a backlog whose callers leave."""

    def predict(self, x: Any) -> Any:
        _note(f"ran {x}")
        time.sleep(0.1)
        return x


slow = Pipeline("t-slow").add(Slow)
slow_parts = Pipeline("t-slow-parts", partitions=2).add(Slow)  # requests without a key go round robin


class Ticks(Stage):
    """Batched and deterministic: item n yields n * 1000 + 0 .. 31, a step each 10 ms."""

    batch_size = 16
    batch_wait_s = 0.002
    deterministic = True
    claim_idle_s = 2.0

    def predict(self, ns: list[int]) -> Iterator[list[int]]:
        for step in range(32):
            yield [n * 1000 + step for n in ns]
            time.sleep(0.01)


class Dice(Ticks):
    """The same chunks, but the stage does not say a re-run yields them again."""

    deterministic = False


ticks = Pipeline("t-ticks").add(Ticks, workers=2)
dice = Pipeline("t-dice").add(Dice, workers=2)


class Growing(Stage):
    """Continuous: item n yields n, n - 1, ..., 1 then ends, a step each 20 ms; new items join between
    steps (each generator start is noted)."""

    batch_size = 8
    batch_wait_s = 0.002
    continuous = True

    def predict(self, batch: Any) -> Iterator[list[Any]]:
        _note("generator start")
        left: dict[int, int] = {}
        while batch:
            for slot in batch.joined():
                left[slot] = batch[slot]
            step: list[Any] = [None] * len(batch)
            for slot in range(len(batch)):
                if batch.occupied(slot):
                    step[slot] = left[slot] if left[slot] > 0 else END
                    left[slot] -= 1
            yield step
            time.sleep(0.02)


growing = Pipeline("t-growing").add(Growing)
# Its worker is stuck 0.3 s after every deadline of its live batch's items passed (the supervisor replaces it).
watched_growing = Pipeline("t-watched-growing").add(Growing, stuck_grace_s=0.3)
# Admission bounded: the entries its live batch holds must not count once their streams ended.
bounded_growing = Pipeline("t-bounded-growing").add(Growing, max_backlog=16)


class Fragile(Growing):
    """Growing, but the item "boom" makes its generator raise at its second step, after noting it and a
    pause (in which a test sends the items that join next); with "end" instead, the generator returns."""

    batch_size = 4

    def predict(self, batch: Any) -> Iterator[list[Any]]:
        _note("generator start")
        left: dict[int, Any] = {}
        while batch:
            for slot in batch.joined():
                left[slot] = batch[slot]
            step: list[Any] = [None] * len(batch)
            for slot in range(len(batch)):
                if not batch.occupied(slot):
                    continue
                if left[slot] in ("boom", "end"):
                    step[slot] = "b"
                    left[slot] += "!"
                elif left[slot] in ("boom!", "end!"):
                    _note("ending")
                    time.sleep(0.5)
                    if left[slot] == "boom!":
                        raise RuntimeError("boom")
                    return
                else:
                    step[slot] = left[slot] if left[slot] > 0 else END
                    left[slot] -= 1
            yield step
            time.sleep(0.02)


fragile = Pipeline("t-fragile").add(Fragile)


class Odd(Stage):
    """Yields each word of a text, but "nan" as the float NaN and "raw" as bytes (neither can be sent as
    JSON); returns NaN when the text ends with "!"."""

    def predict(self, text: str) -> Iterator[Any]:
        for word in text.rstrip("!").split():
            yield {"nan": float("nan"), "raw": b"\xff"}.get(word, word)
        return float("nan") if text.endswith("!") else len(text.split())


odd = Pipeline("t-odd").add(Odd)


class Big(Stage):
    """Item n yields n chunks of 100 KB each, as fast as it can: more than a slow reader takes."""

    def predict(self, n: int) -> Iterator[str]:
        try:
            for j in range(n):
                yield f"{j:06d}" + "x" * 100_000
        except GeneratorExit:
            _note(f"closed {n}")
            raise
        _note(f"end {n}")


big = Pipeline("t-big").add(Big)


class Numbers(Stage):
    """Unary: "nan" answers NaN (no JSON), anything else a numpy array of it twice (JSON as a list)."""

    def predict(self, x: Any) -> Any:
        return float("nan") if x == "nan" else np.array([x, x])


numbers = Pipeline("t-numbers").add(Numbers)


class Relapse(Stage):
    """Deterministic: yields each word of a text. Its first run SIGKILLs its own worker after the first two
    words went out (a marker file, ``STREAM_RUNS`` + ".killed", says it did); its run again raises at the
    word "boom", after the words before it (those the caller has)."""

    deterministic = True
    claim_idle_s = 1.0

    def predict(self, text: str) -> Iterator[str]:
        marker = Path(os.environ["STREAM_RUNS"] + ".killed")
        for n, word in enumerate(text.split()):
            if n == 2 and not marker.exists():
                marker.touch()
                os.kill(os.getpid(), signal.SIGKILL)
            if word == "boom":
                raise RuntimeError("boom on the run again")
            yield word


relapse = Pipeline("t-relapse").add(Relapse)


class Doomed(Growing):
    """Growing, but the item "poison" yields "p" for 30 steps (noting each run's start), then SIGKILLs its
    worker on its first two runs and ends on the third: an input that kills whatever batch it is in."""

    batch_size = 4

    def predict(self, batch: Any) -> Iterator[list[Any]]:
        steps: dict[int, int] = {}
        while batch:
            for slot in batch.joined():
                steps[slot] = 30 if batch[slot] == "poison" else batch[slot]
                if batch[slot] == "poison":
                    _note("poison run")
            step: list[Any] = [None] * len(batch)
            for slot in range(len(batch)):
                if not batch.occupied(slot):
                    continue
                if batch[slot] == "poison" and steps[slot] == 0 and _runs().count("poison run") <= 2:
                    os.kill(os.getpid(), signal.SIGKILL)
                step[slot] = (steps[slot] if batch[slot] != "poison" else "p") if steps[slot] > 0 else END
                steps[slot] -= 1
            yield step
            time.sleep(0.02)


def _runs() -> list[str]:
    return Path(os.environ["STREAM_RUNS"]).read_text().splitlines()


doomed = Pipeline("t-doomed").add(Doomed)
