"""What a stage's own code may do to its worker: raise any BaseException from ``predict`` (its item's
answer, batched or not, the worker living on) or from ``setup()`` (a failed start, said with its
traceback, never the clean exit of a worker asked to stop); give a ``batch_wait_s`` no clock can hold (refused
where written); give ``batch_key`` costs that do not sort (the batch kept in arrival order)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import REPO_ROOT, conveyor_argv, conveyor_env
from workers import Pipeline, Stage
from workers.batching.grouping import run_grouped
from workers.loop.runner import Failure, run_batch, run_single
from workers.pipeline import PipelineError


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


@pytest.mark.system
def test_a_setup_that_calls_sys_exit_is_a_failed_start_with_its_traceback(redis_url: str, tmp_path: Path) -> None:
    """``sys.exit(0)`` in ``setup()`` ended the worker with code 0, the code of a worker stopped on request:
    three restarts, then "giving up", and nowhere a word of why."""
    log_path = tmp_path / "worker.log"
    with log_path.open("wb") as out:
        proc = subprocess.Popen(conveyor_argv("worker", "tests.error_stages:exits_in_setup", "--stage",
                                              "ExitsInSetup"), cwd=REPO_ROOT, env=conveyor_env(redis_url),
                                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
        try:
            code = proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    log = log_path.read_text(errors="replace")
    assert code != 0, log
    assert "giving up" in log, log
    assert "SystemExit" in log and "in setup" in log, log
    assert "code=0" not in log and log.count("code=3") == 3, log


class _Batched(Stage):
    batch_size = 4
    batch_policy = "deadline"

    def predict(self, xs: list[Any]) -> list[Any]:
        return xs


@pytest.mark.parametrize("wait_s", [sys.maxsize, 1e10, 1e300, 86_401])
def test_a_batch_wait_past_a_day_is_refused_where_written(wait_s: float) -> None:
    """A "forever" written as sys.maxsize was taken: the worker's first batch window overflowed its socket's
    timeout (OverflowError), crashing it at every restart."""
    with pytest.raises(PipelineError, match=r"stage _Batched: batch_wait_s must be at most 86400 \(a day"):
        Pipeline("p").add(_Batched, batch_wait_s=wait_s)
    assert Pipeline("p").add(_Batched, batch_wait_s=86_400).stages[0].batch_wait_s == 86_400


class _Ambiguous:
    """A cost that does not compare as torch's tensors do: ``<`` raises RuntimeError."""

    def __lt__(self, other: object) -> bool:
        raise RuntimeError("Boolean value of Tensor with more than one value is ambiguous")


class _KeyedBy(Stage):
    def __init__(self, key: Any) -> None:
        self.key = key

    def batch_key(self, x: Any) -> Any:
        return self.key(x)

    def predict(self, xs: list[Any]) -> list[Any]:
        return [x + 1 for x in xs]


@pytest.mark.parametrize("key", [lambda x: _Ambiguous(), lambda x: _raise_on_bad(Halt("no cost"))],
                         ids=["uncomparable", "base-exception"])
def test_a_batch_key_whose_costs_do_not_sort_or_that_raises_anything_leaves_the_batch_served(key: Any) -> None:
    """A RuntimeError out of the costs' comparison, or a BaseException out of batch_key, ended the worker at
    every batch of two items or more (its items then answered one crash later, one at a time)."""
    def run(predict: Any, inputs: list[Any], deadlines: Any, payloads: Any) -> list[Any]:
        return run_batch(predict, inputs)

    assert run_grouped(_KeyedBy(key), [1, 2, 3, 4], 4, run) == [(True, 2), (True, 3), (True, 4), (True, 5)]


class _Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no text for this one")


def test_a_batch_key_raising_an_exception_whose_str_raises_leaves_the_batch_served() -> None:
    """The warning of a failing batch_key quoted ``str(exc)``: one whose ``__str__`` raises ended the worker at
    its first such batch, then again after every restart (the warning is said once per process)."""
    def run(predict: Any, inputs: list[Any], deadlines: Any, payloads: Any) -> list[Any]:
        return run_batch(predict, inputs)

    key = lambda x: _raise_on_bad(_Unprintable())  # noqa: E731
    assert run_grouped(_KeyedBy(key), [1, 2, 3], 4, run, stage_name="unprintable-key") == [(True, 2), (True, 3),
                                                                                           (True, 4)]
