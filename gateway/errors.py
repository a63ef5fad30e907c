"""Exceptions a gateway caller can meet besides the builtin ``TimeoutError``."""

from __future__ import annotations


class StageError(Exception):
    """A stage's code raised on this request (or conveyor refused the item at a stage)."""

    def __init__(self, type: str, message: str, stage: str, traceback: str = "") -> None:
        super().__init__(f"{type} in stage {stage}: {message}" if stage else f"{type}: {message}")
        self.type = type
        self.message = message
        self.stage = stage
        self.traceback = traceback


class DeadlineExceeded(StageError, TimeoutError):
    """A stage met the request past its deadline and answered so, a moment before this gateway's own
    timer would have: a ``TimeoutError`` as that timer's is (``except TimeoutError`` catches both)."""


class Overloaded(Exception):
    """The first stage's backlog (or this gateway's in-flight count) is at its limit."""


class UnknownPipeline(Exception):
    """No worker has registered this pipeline in this Redis (a mistyped name, another prefix or
    Redis, or workers that never started): nothing would ever answer, so nothing is sent."""

    def __init__(self, pipeline: str, message: str) -> None:
        super().__init__(message)
        self.pipeline = pipeline


class PayloadTooLarge(ValueError):
    """An input whose encoded form is over the workers' ``max_payload_bytes``: refused before Redis
    (a worker would dead-letter it)."""


class WrongRoute(ValueError):
    """A streaming pipeline asked for one answer, or a unary one for a stream: said before Redis."""
