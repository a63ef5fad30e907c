"""Numbers a person gives conveyor (command-line options, their environment variables): written plainly,
finite, and within what Redis and the protocol take where each is used.

A bad number must be refused where it is written, in one line naming the option, not crash a worker
later (a TTL past what Redis takes failed every commit, in a loop), busy-loop (``--interval-s nan``) or
kill workers at once (``--grace-s nan``). The limits live here, next to the reasons for them, so that
both command lines (workers' and gateway's, which may not import each other) refuse the same values.

broker imports no click (it holds no command line): :class:`PlainNumbers` is mixed into the click
number types each command line declares (``class Seconds(PlainNumbers, click.FloatRange)``) and calls
only what every click parameter type has, ``convert`` and ``fail``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NoReturn

from broker.protocol import MAX_DEADLINE_AHEAD_MS

__all__ = ["MAX_EXPIRE_MS", "MAX_PIN_TTL_MS", "MAX_TIMEOUT_S", "PlainNumbers", "SettingsError", "count_problem",
           "expire_ms_problem", "expire_problem", "number_problem", "pin_ttl_problem", "timeout_problem", "ttl_ms",
           "written_problem"]

Check = Callable[[float], "str | None"]
MAX_TIMEOUT_S = MAX_DEADLINE_AHEAD_MS / 1000  # a week: the furthest deadline a stream entry may carry
# SET ... PX and PEXPIRE (result keys, reply lists: broker/commit.lua, chunks.lua, pins.py) refuse a TTL whose
# sum with the server's clock in Unix ms passes 2**63 - 1 (t_string.c, expire.c). The TTL is added at every
# commit for as long as the workers run: less what the clock reads up to year 10000, it holds whatever the date.
YEAR_10000_MS = 253_402_300_800_000
MAX_EXPIRE_MS = 2**63 - 1 - YEAR_10000_MS
# broker/pins.lua holds the pin TTL as a Lua number (a double) and hands it to PEXPIRE, which Redis up to 7.0
# turns back into text with %.17g: from 1e17 on that is e-notation ("1e+17"), which PEXPIRE refuses. The
# largest whole number of ms whose double is below 1e17 (doubles there are 16 apart; ...992 rounds up to 1e17).
MAX_PIN_TTL_MS = 99_999_999_999_999_991


class SettingsError(ValueError):
    """A setting made in code (a settings dataclass: gateway, HTTP, worker, Redis, TTLs) that nothing could run
    with: the message names the class, the setting and its range. Raised where the settings are made, so that a
    library caller learns it there, as a command line's user does at start, not from a worker's loop later."""


def number_problem(value: object, low: float, high: float = math.inf, low_open: bool = False) -> str | None:
    """What is wrong with ``value`` as a finite number from ``low`` (excluded with ``low_open``) to ``high``, else
    None. NaN passes every comparison's negation and infinity every lower bound: both are named here."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or not (
            (value > low if low_open else value >= low) and value <= high):
        above = f"> {low:g}" if low_open else f">= {low:g}"
        return f"must be a finite number {above}{'' if high == math.inf else f' and <= {high:g}'}, got {value!r}"
    return None


def count_problem(value: object, low: int = 1, high: int | None = None) -> str | None:
    """What is wrong with ``value`` as an integer from ``low`` (to ``high``, where given), else None (a float such
    as 2.5 or 1e9 is refused: it would be compared and formatted as a count where Redis and the front take
    integers)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        return f"must be an integer >= {low}{'' if high is None else f' and <= {high}'}, got {value!r}"
    return None


def written_problem(text: object, check: Check | None = None) -> str | None:
    """What is wrong with ``text`` as written, before its type converts it, else None: underscores (Python's
    ``int`` and ``float`` read ``1_0`` as 10, likely a typo for something else), then ``check`` (an option's
    own limit) on its float value. Text that is no number at all is left to the type, which says so."""
    if isinstance(text, str) and "_" in text:
        return f"{text!r} is not a plain number: write it without underscores"
    if check is None:
        return None
    try:
        number = float(text)  # type: ignore[arg-type]  # a str, or the declared default
    except (TypeError, ValueError):
        return None
    return check(number)


def finite_problem(number: object) -> str | None:
    """NaN and infinities pass click's ranges (every comparison with NaN is false; inf is above any minimum):
    as seconds they busy-loop, kill at once or overflow a conversion."""
    if isinstance(number, float) and not math.isfinite(number):
        return f"{number!r} is not a finite number"
    return None


class PlainNumbers:
    """Mixed in ahead of a click number type: refuses ``1_0``, NaN and infinities, and what ``check`` (an
    option's own limit, given as ``check=``) refuses, before the type's range (its message says more)."""

    check: Check | None = None
    fail: Callable[..., NoReturn]  # click.ParamType's

    def __init__(self, *args: Any, check: Check | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # the click type's: min, max, min_open, ...
        self.check = check

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        problem = written_problem(value, self.check)
        if problem is not None:
            self.fail(problem, param, ctx)
        number = super().convert(value, param, ctx)  # type: ignore[misc]  # the click type's own, and its range
        problem = finite_problem(number)
        if problem is not None:
            self.fail(problem, param, ctx)
        return number


def timeout_problem(value: object) -> str | None:
    """What is wrong with ``value`` as a request's timeout (a positive number of seconds up to a week), else
    None. NaN and infinities are refused: every request would fail, not the settings."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not (
            math.isfinite(value) and 0 < value <= MAX_TIMEOUT_S):
        return f"must be a positive number of seconds up to a week ({MAX_TIMEOUT_S:g}), got {value!r}"
    return None


def ttl_ms(seconds: float) -> int:
    """A TTL option's seconds as the workers send them to Redis: whole milliseconds."""
    return int(seconds * 1000)


def _ttl_problem(seconds: float, most_ms: int, why: str) -> str | None:
    if not math.isfinite(seconds):
        return f"{seconds!r} is not a finite number"
    if ttl_ms(seconds) > most_ms:
        most_s = most_ms // 1000
        while ttl_ms(most_s) > most_ms:  # a float this large is 2 or more apart from the next: say one that is taken
            most_s -= 1
        return f"{seconds:g} s is more than {why}: at most {most_s} s"
    return None


def expire_ms_problem(value: object, most_ms: int = MAX_EXPIRE_MS) -> str | None:
    """What is wrong with ``value`` as a TTL in whole ms that Redis takes (``SET PX``, ``PEXPIRE``: 0 and
    below are refused, and so is a sum with the clock past 2**63 - 1, see ``MAX_EXPIRE_MS``), else None."""
    return count_problem(value, 1, most_ms)


def expire_problem(seconds: float) -> str | None:
    """A result key's or reply list's TTL (``SET PX``, ``PEXPIRE``) Redis would refuse at every commit."""
    return _ttl_problem(seconds, MAX_EXPIRE_MS, "Redis takes for a key's expiry")


def pin_ttl_problem(seconds: float) -> str | None:
    """A pin claim's TTL that broker/pins.lua could not hand to ``PEXPIRE`` (see ``MAX_PIN_TTL_MS``)."""
    return _ttl_problem(seconds, MAX_PIN_TTL_MS, "Redis takes for a pin claim's expiry (a Lua number in pins.lua)")
