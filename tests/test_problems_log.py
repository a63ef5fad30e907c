"""What a worker logs of its stage's errors: once a minute per type, and the first of each type with its
traceback at INFO, so that a new failure can be read without a debug log."""

from __future__ import annotations

import logging

import pytest

from broker import protocol
from broker.commit import Commit
from broker.keys import Keys
from workers import Pipeline, Stage
from workers.loop.problems import Problems
from workers.loop.routing import EntryRouter
from workers.loop.runner import EXPIRED, Failure

pytestmark = pytest.mark.unit


def test_the_first_error_of_each_type_is_logged_with_its_traceback_at_info(caplog: pytest.LogCaptureFixture) -> None:
    """A new failure can be read without a debug log: its first occurrence carries the traceback at INFO."""
    caplog.set_level(logging.INFO, "conveyor.worker")
    problems = Problems("Scale", "k")
    boom = Failure("ZeroDivisionError", "division by zero", "Traceback (most recent call last):\n  File x\n")
    problems.stage_error(b"r-1", boom)
    problems.stage_error(b"r-2", boom)  # held back by the once-a-minute throttle
    problems.stage_error(b"r-3", Failure("KeyError", "'x'", "Traceback (most recent call last):\n  File y\n"))
    traced = [r for r in caplog.records if r.levelno == logging.INFO and "stage traceback" in r.getMessage()]
    assert [("ZeroDivisionError" in r.getMessage(), "File x" in r.getMessage()) for r in traced[:1]] == [(True, True)]
    assert len(traced) == 2 and "KeyError" in traced[1].getMessage()


def test_an_item_answered_unrun_past_its_deadline_is_not_counted_a_stage_error() -> None:
    """Items expired behind a long call were logged "stage raised ... DeadlineExceeded" and counted in
    conveyor_stage_errors, as if the model failed."""
    spec = Pipeline("t-unit").add(Named).stages[0]
    problems = Problems("Named", "k")
    router = EntryRouter(spec, True, 1 << 20, problems=problems)
    commit = Commit()
    item = protocol.Item(b"1-1", b"r-1", b"", b"P:reply:g", None)
    router.route(item, EXPIRED, commit, Keys("t-unit"))
    router.route(item, (False, Failure("ValueError", "bad", "")), commit, Keys("t-unit"))
    assert problems._total["stage_errors"] == 1
    assert len(commit.results) == 2 and b"DeadlineExceeded" in commit.results[0][1]


class Named(Stage):
    def predict(self, x: object) -> object:
        return x
