"""The number types of workers' command lines (``conveyor worker``, ``run``, ``k8s``): click's ranges, with the
refusals of :mod:`broker.numbers` (NaN, infinities, ``1_0``, an option's own limit) said in one line."""

from __future__ import annotations

import click

from broker.numbers import PlainNumbers

__all__ = ["Count", "Seconds"]


class Seconds(PlainNumbers, click.FloatRange):
    """A float option (seconds, all of them): FloatRange alone lets NaN and infinities through."""


class Count(PlainNumbers, click.IntRange):
    """A whole-number option: IntRange alone takes ``1_0`` (int() reads it as 10)."""
