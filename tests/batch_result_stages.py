"""Stages for tests/test_batch_results.py: a batched predict that answers with something other than
one result per item (issue 37: a dict's keys were taken as the answers)."""

from __future__ import annotations

from typing import Any

import numpy as np

from workers import Pipeline, Stage


class Kinds(Stage):
    """Doubles each input's value and answers the batch as the kind its first input names: always
    as many results as inputs, so that only the kind is wrong. Inputs are ``[kind, value]``."""

    batch_size = 8
    batch_wait_s = 0.05

    def predict(self, xs: list[Any]) -> Any:
        kind = xs[0][0]
        values = [2 * x[1] for x in xs]
        if kind == "dict":  # what the new user wrote: one key per item, and the keys became the answers
            return {i: {"result": v} for i, v in enumerate(values)}
        if kind == "str":
            return "r" * len(xs)
        if kind == "set":
            return set(values)
        if kind == "generator":
            return (v for v in values)
        if kind == "0-d":
            return np.asarray(sum(values))
        if kind == "tuple":
            return tuple(values)
        if kind == "array":
            return np.asarray(values)
        if kind == "rows":  # shape (n, 3): n results of shape (3,)
            return np.stack([np.full(3, v) for v in values])
        return values


kinds = Pipeline("t-kinds").add(Kinds, name="kinds")


class ScalesInPlace(Stage):
    """What a new user writes to preprocess images: each array scaled in place, then the batch refused
    when one item is bad. Its bisection's calls must see the items as they arrived."""

    batch_size = 8

    def predict(self, xs: list[dict[str, Any]]) -> list[float]:
        for x in xs:
            x["pixels"] /= 255.0
        if any(x["bad"] for x in xs):
            raise ValueError("bad image")
        return [float(x["pixels"].sum()) for x in xs]


class Images(ScalesInPlace):
    """The same, served: a batch of eight gathered by its deadline."""

    batch_wait_s = 0.5
    batch_policy = "deadline"


images = Pipeline("t-images").add(Images, name="images")
