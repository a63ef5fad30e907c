"""What a stage's own code may do to its worker: raise any BaseException from ``predict`` (its item's
answer, batched or not, the worker living on)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from workers.loop.runner import Failure, run_batch, run_single


class Halt(BaseException):
    """A library's own BaseException (gevent's Timeout, trio's Cancelled are ones)."""


RAISED: list[BaseException] = [asyncio.CancelledError("cancelled"), Halt("halt"), GeneratorExit(), SystemExit(2)]


def _raise_on_bad(x: Any) -> Any:
    if isinstance(x, BaseException):
        raise x
    return x


@pytest.mark.parametrize("exc", RAISED, ids=lambda e: type(e).__name__)
def test_any_base_exception_from_predict_is_its_items_answer(exc: BaseException) -> None:
    single = run_single(_raise_on_bad, ["a", exc, "b"])
    batched = run_batch(lambda xs: [_raise_on_bad(x) for x in xs], ["a", exc, "b"])
    for outcomes in (single, batched):
        assert [ok for ok, _ in outcomes] == [True, False, True]
        assert [value for ok, value in outcomes if ok] == ["a", "b"]
        failure = outcomes[1][1]
        assert isinstance(failure, Failure) and failure.type == type(exc).__name__
