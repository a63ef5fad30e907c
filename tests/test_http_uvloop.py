"""The HTTP front's tests again on uvloop (``--loop uvloop``): its transports differ from asyncio's
in the details the front relies on (pause/resume, half-close, write buffers, timers)."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Iterator

import pytest

from tests import test_http

uvloop = pytest.importorskip("uvloop")

# every test of test_http.py that takes no parameters (the parametrized ones vary inputs, not the loop)
TESTS = [f for name, f in sorted(vars(test_http).items())
         if name.startswith("test_") and callable(f) and not inspect.signature(f).parameters]


@pytest.fixture(autouse=True)
def uvloop_policy() -> Iterator[None]:
    old = asyncio.get_event_loop_policy()
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    try:
        yield
    finally:
        asyncio.set_event_loop_policy(old)


@pytest.mark.parametrize("test", TESTS, ids=[f.__name__ for f in TESTS])
def test_on_uvloop(test: Callable[[], None]) -> None:
    loops: list[str] = []
    asyncio.run(_which_loop(loops))
    assert loops == ["uvloop"]
    test()


async def _which_loop(loops: list[str]) -> None:
    loops.append(type(asyncio.get_running_loop()).__module__.split(".")[0])


def test_auto_is_uvloop_where_installed_and_runs_on_it() -> None:
    """``--loop auto`` (the default) resolves to uvloop here, and run_loop really runs on it."""
    from gateway.serve import resolve_loop, run_loop

    assert resolve_loop("auto") == "uvloop"
    assert resolve_loop("asyncio") == "asyncio"
    loops: list[str] = []
    asyncio.set_event_loop_policy(asyncio.DefaultEventLoopPolicy())  # undo this module's fixture
    run_loop(_which_loop(loops), "auto")
    run_loop(_which_loop(loops), "asyncio")
    assert loops == ["uvloop", "asyncio"]
