"""Runs user code on a batch and isolates the items that make it fail.

A batched ``predict`` that raises, or returns the wrong number of results, is re-run on
each half of the batch, recursively, so only the offending items get the error and the
innocent ones their results. A batch with one bad item costs about 2*log2(n) extra calls.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Failure:
    """What a requester learns when stage code fails on its item."""

    type: str
    message: str
    traceback: str


class BatchLengthError(Exception):
    """A batched predict returned a number of results different from its inputs."""


Outcome = tuple[bool, Any]  # (True, value) or (False, Failure)


def _failure(exc: BaseException) -> Failure:
    return Failure(type(exc).__name__, str(exc), "".join(traceback.format_exception(exc)))


def run_single(predict: Callable[[Any], Any], inputs: Sequence[Any]) -> list[Outcome]:
    outcomes: list[Outcome] = []
    for x in inputs:
        try:
            outcomes.append((True, predict(x)))
        except Exception as exc:  # user code: any exception is that item's answer
            outcomes.append((False, _failure(exc)))
    return outcomes


def _call_batch(predict: Callable[[list[Any]], Any], inputs: list[Any]) -> list[Any]:
    results = predict(inputs)
    try:
        results = list(results)
    except TypeError as exc:
        raise BatchLengthError(f"batched predict must return a sequence, got {type(results).__name__}") from exc
    if len(results) != len(inputs):
        raise BatchLengthError(f"batched predict returned {len(results)} results for {len(inputs)} inputs")
    return results


def run_batch(predict: Callable[[list[Any]], Any], inputs: list[Any]) -> list[Outcome]:
    if not inputs:
        return []
    try:
        return [(True, y) for y in _call_batch(predict, inputs)]
    except Exception as exc:  # user code: isolate who caused it
        if len(inputs) == 1:
            return [(False, _failure(exc))]
    mid = len(inputs) // 2
    return run_batch(predict, inputs[:mid]) + run_batch(predict, inputs[mid:])
