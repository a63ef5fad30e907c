"""What a worker logs of its stage's errors: once a minute per type, and the first of each type with its
traceback at INFO, so that a new failure can be read without a debug log."""

from __future__ import annotations

import logging

import pytest

from workers.loop.problems import Problems
from workers.loop.runner import Failure

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
