"""A failed request leaves no reference cycle behind: in the gateway, its error is read from its
waiter, not raised (gateway.client.slot.failure); a raised one's traceback held the consumer's frame,
the frame the waiter, the waiter the error, and a storm of failing requests kept the collector busy
15 % of the gateway's time. Each route's finisher is checked with the collector off: the error must
be freed as soon as the last reference to its waiter goes."""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import Callable, Iterator

import pytest

from gateway.client.slot import Slot, failure
from gateway.errors import StageError
from gateway.http import openai
from gateway.http.codecs import JSON
from gateway.http.oip import routes as v2
from gateway.http.oip.items import ItemFailed
from gateway.http.predict import Predict
from gateway.http.types import Reply


class _Tracked(StageError):
    """A StageError that can be watched (a weak reference) until it is freed."""


@pytest.fixture
def no_collector() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _native(slot: Slot) -> Reply:
    return Predict(debug=False)._finish(JSON, slot)


def _v2(slot: Slot) -> Reply:
    return v2._respond(None, False, slot)  # type: ignore[arg-type]  # a failure never reads the plan


def _v2_row(slot: Slot) -> Reply:
    return v2._respond_row(None, slot)  # type: ignore[arg-type]


def _openai(slot: Slot) -> Reply:
    return openai._finish(None, slot)  # type: ignore[arg-type]  # nor the query


FINISHERS: dict[str, Callable[[Slot], Reply]] = {"native": _native, "v2": _v2, "v2-row": _v2_row,
                                                  "openai": _openai}


@pytest.mark.parametrize("name", sorted(FINISHERS))
@pytest.mark.usefixtures("no_collector")
def test_a_stage_error_is_freed_without_the_collector(name: str) -> None:
    loop = asyncio.new_event_loop()
    try:
        slot = Slot(loop)
        error = _Tracked("TypeError", "unsupported operand", "Scale")
        watch = weakref.ref(error)
        slot.set_exception(error if name != "openai" else ItemFailed(0, error))
        del error
        reply = FINISHERS[name](slot)
        assert 400 <= reply.status < 500, reply  # answered as the stage's error
        del slot, reply
        assert watch() is None, "the error outlived its request: a reference cycle"
    finally:
        loop.close()


def test_failure_reads_without_raising() -> None:
    loop = asyncio.new_event_loop()
    try:
        ok, failed, cancelled, fatal = Slot(loop), Slot(loop), Slot(loop), Slot(loop)
        ok.set_result(1)
        error = StageError("TypeError", "m", "Scale")
        failed.set_exception(error)
        cancelled.cancel()
        fatal.set_exception(KeyboardInterrupt())
        assert failure(ok) is None
        assert failure(failed) is error and error.__traceback__ is None
        with pytest.raises(asyncio.CancelledError):  # as result() would
            failure(cancelled)
        with pytest.raises(KeyboardInterrupt):  # not an Exception: raised, as result() would
            failure(fatal)
    finally:
        loop.close()
