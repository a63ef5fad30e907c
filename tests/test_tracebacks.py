"""workers.loop.tracebacks.Tracebacks: a stage error's text is exactly what
``traceback.format_exception`` gives, its stack formatted once per place it was raised from."""

from __future__ import annotations

import builtins
import traceback
from collections.abc import Callable

import pytest

from workers.loop.runner import run_batch, run_single
from workers.loop.tracebacks import Tracebacks


def _deep(x: object, depth: int) -> object:
    if depth:
        return _deep(x, depth - 1)
    return x * 2  # type: ignore[operator]  # None * 2: the TypeError under test


def _keyed(x: dict[str, int]) -> int:
    return x["missing"]


def _chained(x: object) -> object:
    try:
        return _keyed({})
    except KeyError as exc:
        raise ValueError(f"bad input {x!r}") from exc


def _in_handler(x: object) -> object:
    try:
        return _keyed({})
    except KeyError:
        raise ValueError(f"bad input {x!r}")  # noqa: B904  # the implicit chain (__context__)


def _suppressed(x: object) -> object:
    try:
        return _keyed({})
    except KeyError:
        raise ValueError(f"bad input {x!r}") from None


def _noted(x: object) -> object:
    exc = ValueError(f"bad input {x!r}")
    if hasattr(exc, "add_note"):  # Python 3.11 on
        exc.add_note(f"item {x!r}")
    raise exc


def _recursing(x: int) -> int:
    return _recursing(x + 1)


RAISERS: dict[str, Callable[[object], object]] = {
    "simple": lambda x: _deep(None, 0), "deep": lambda x: _deep(None, 5), "chained": _chained,
    "in-handler": _in_handler, "suppressed": _suppressed, "noted": _noted,
    "recursion": lambda x: _recursing(0),
}


def _raised(raiser: Callable[[object], object], x: object) -> BaseException:
    try:
        raiser(x)
    except Exception as exc:
        return exc
    raise AssertionError("did not raise")


@pytest.mark.parametrize("name", sorted(RAISERS))
def test_as_format_exception_every_time(name: str) -> None:
    tracebacks = Tracebacks()
    for x in (1, "two", 3.0):  # the same place, another message: the memo must not keep the message
        exc = _raised(RAISERS[name], x)
        assert tracebacks.format(exc) == "".join(traceback.format_exception(exc))


def test_groups_are_formatted_in_full() -> None:
    group_type = getattr(builtins, "ExceptionGroup", None)
    if group_type is None:
        pytest.skip("exception groups are Python 3.11 on")
    try:
        raise group_type("several", [_raised(RAISERS["simple"], 1), _raised(RAISERS["chained"], 2)])
    except Exception as exc:  # the group under test
        assert Tracebacks().format(exc) == "".join(traceback.format_exception(exc))


def test_one_stack_per_place_and_bounded() -> None:
    tracebacks = Tracebacks(max_stacks=2)
    for x in range(5):
        tracebacks.format(_raised(RAISERS["simple"], x))
    assert len(tracebacks) == 1  # five errors from one place: one stack formatted
    tracebacks.format(_raised(RAISERS["deep"], 0))
    assert len(tracebacks) == 2
    tracebacks.format(_raised(RAISERS["noted"], 0))  # a third place: the memo starts again
    assert len(tracebacks) == 1


def test_runners_use_the_memo() -> None:
    tracebacks = Tracebacks()

    def predict(x: object) -> object:
        return _deep(x, 1)

    singles = run_single(predict, [None, 2, None], tracebacks)
    assert [ok for ok, _ in singles] == [False, True, False]
    batch = run_batch(lambda xs: [predict(x) for x in xs], [None, 3, None, None], tracebacks=tracebacks)
    assert [ok for ok, _ in batch] == [False, True, False, False]
    assert len(tracebacks) == 2  # the single's place and the batch's
    for ok, value in singles + batch:
        if not ok:
            assert value.type == "TypeError" and value.traceback.startswith("Traceback (most recent call last):")
            assert value.traceback.endswith("TypeError: unsupported operand type(s) for *: 'NoneType' and 'int'\n")
