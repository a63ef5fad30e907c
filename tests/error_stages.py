"""Stages whose results are too large or cannot be encoded (imported by worker processes as
``tests.error_stages``). An int n becomes n bytes in ``Make``; ``Double`` doubles what it gets; ``Dates``
answers a date JSON cannot carry for "far", and one it can, with its batch's size, for anything else; ``Times``
answers a time at a multiplied unit for "2D"."""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import numpy as np

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


class Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no text for this one")


class Halt(BaseException):
    """A library's own BaseException (gevent's Timeout, trio's Cancelled are ones)."""


class Raises(Stage):
    """What user code raises beyond Exception, or an exception an error record cannot carry as it is."""

    batch_size = 8

    def predict(self, xs: list[Any]) -> list[Any]:
        for x in xs:
            if x == "exit":
                sys.exit(2)  # as argparse's error() does
            if x == "interrupt":
                raise KeyboardInterrupt
            if x == "cancelled":
                raise asyncio.CancelledError("a task of the stage's own event loop")
            if x == "halt":
                raise Halt("stop here")
            if x == "surrogate":
                raise FileNotFoundError(b"no such file: caf\xe9".decode("utf-8", "surrogateescape"))
            if x == "unprintable":
                raise Unprintable
            if x == "huge":
                raise ValueError("x" * 1_000_000)
        return xs


class Dates(Stage):
    """Two requests gathered into one batch: a date past the year 9999 for one, a plain date for the other."""

    batch_size = 2
    batch_wait_s = 1.0
    batch_policy = "deadline"

    def predict(self, xs: list[Any]) -> list[Any]:
        return [np.datetime64("10000-01-01") if x == "far" else {"day": np.datetime64("2026-11-29"), "batch": len(xs)}
                for x in xs]


class Times(Stage):
    """A time at a unit with a multiplier for "2D" (orjson dies writing one), the input itself otherwise."""

    def predict(self, x: Any) -> Any:
        return np.datetime64(100, "2D") if x == "2D" else x


class ExitsInSetup(Stage):
    """A setup() that ends the program, as a library's command-line entry point does."""

    def setup(self) -> None:
        sys.exit(0)

    def predict(self, x: Any) -> Any:
        return x


sizes = Pipeline("t-sizes").add(Make).add(Double)
versions_old = Pipeline("t-versions").add(Make)
versions_new = Pipeline("t-versions").add(Make).add(Double)  # the same name, a stage more
raises = Pipeline("t-raises").add(Raises)
dates = Pipeline("t-dates").add(Dates)
times = Pipeline("t-times").add(Times)
exits_in_setup = Pipeline("t-exits-in-setup").add(ExitsInSetup)
