"""A module defining two pipelines, for ``conveyor run tests.two_pipelines`` (tests/test_which_redis.py)."""

from __future__ import annotations

from workers import Pipeline, Stage


class Double(Stage):
    def predict(self, x: int) -> int:
        return 2 * x


class Negate(Stage):
    def predict(self, x: int) -> int:
        return -x


double = Pipeline("two-double").add(Double)
negate = Pipeline("two-negate").add(Negate)
