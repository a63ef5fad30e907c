"""Stages of the traces tests (tests/test_traces.py): two stages, one that can be slow or be killed in
``predict`` once, one that fails on a marked input; and a streaming pipeline of one stage."""

from __future__ import annotations

import os
import time
from typing import Any

from workers import Pipeline, Stage

MARK_ENV = "CONVEYOR_TEST_KILL_MARK"  # a file: absent, "kill-once" creates it and hangs (the test SIGKILLs)


class Prep(Stage):
    claim_idle_s = 1.0

    def predict(self, x: Any) -> Any:
        if x == "slow":
            time.sleep(1.0)
        if x == "kill-once":
            mark = os.environ[MARK_ENV]
            if not os.path.exists(mark):
                with open(mark, "w") as f:
                    f.write(str(os.getpid()))
                time.sleep(60)  # killed here by the test
        return x


class Post(Stage):
    batch_size = 16
    batch_wait_s = 0.002

    def predict(self, xs: list[Any]) -> list[Any]:
        if "boom" in [x for x in xs if isinstance(x, str)]:
            raise ValueError("boom in Post")
        return [f"{x}!" if isinstance(x, str) else x for x in xs]


class Words(Stage):
    """A streaming stage: a chunk per word, or an error after the first if asked."""

    def predict(self, x: Any) -> Any:
        for word in str(x).split():
            if word == "boom":
                raise ValueError("boom in Words")
            yield word


pipeline = Pipeline("t-traces").add(Prep).add(Post)
stream_pipeline = Pipeline("t-trace-stream").add(Words)
