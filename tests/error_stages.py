"""Stages whose results are too large or cannot be encoded (imported by worker processes as
``tests.error_stages``). An int n becomes n bytes in ``Make``; ``Double`` doubles what it gets."""

from __future__ import annotations

from typing import Any

from workers import Pipeline, Stage

UNENCODABLE_FIRST = "unencodable-in-Make"
UNENCODABLE_LAST = "unencodable-in-Double"


class Make(Stage):
    def predict(self, x: Any) -> Any:
        if x == UNENCODABLE_FIRST:
            return object()
        return b"x" * x if isinstance(x, int) else x


class Double(Stage):
    def predict(self, x: Any) -> Any:
        if x == UNENCODABLE_LAST:
            return object()
        return x + x


sizes = Pipeline("t-sizes").add(Make).add(Double)
