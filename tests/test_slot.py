"""gateway.client.slot.Slot: the HTTP front's answer without an event-loop handle per reply."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from gateway.client.slot import Slot


async def _called_at_once() -> None:
    loop = asyncio.get_running_loop()
    seen: list[Any] = []
    slot = Slot(loop)
    slot.add_done_callback(lambda s: seen.append(s.result()))
    assert not slot.done()
    slot.set_result(7)
    assert seen == [7]  # in the caller's stack, not on a later loop turn
    failed = Slot(loop)
    failed.add_done_callback(lambda s: seen.append(s.exception()))
    error = TimeoutError("late")
    failed.set_exception(error)
    assert seen[-1] is error
    with pytest.raises(TimeoutError):
        failed.result()
    with pytest.raises(asyncio.InvalidStateError):
        failed.set_result(1)


async def _late_callback_waits_a_turn() -> None:
    loop = asyncio.get_running_loop()
    seen: list[int] = []
    slot = Slot(loop)
    slot.set_result(3)
    slot.add_done_callback(lambda s: seen.append(s.result()))
    assert seen == []  # not re-entering whoever added it
    await asyncio.sleep(0)
    assert seen == [3]
    with pytest.raises(RuntimeError):
        slot.add_done_callback(lambda s: None)


async def _failing_callback_is_reported() -> None:
    loop = asyncio.get_running_loop()
    reported: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, context: reported.append(context))
    slot = Slot(loop)

    def boom(_: Slot) -> None:
        raise ValueError("consumer bug")

    slot.add_done_callback(boom)
    slot.set_result(1)  # does not raise into the resolver (the reply reader)
    assert isinstance(reported[0]["exception"], ValueError)


async def _cancel_does_not_call_back() -> None:
    loop = asyncio.get_running_loop()
    seen: list[Slot] = []
    slot = Slot(loop)
    slot.add_done_callback(seen.append)
    assert slot.cancel()
    assert slot.done() and slot.cancelled() and seen == []
    assert not slot.cancel()
    with pytest.raises(asyncio.CancelledError):
        slot.result()


@pytest.mark.parametrize("case", [_called_at_once, _late_callback_waits_a_turn, _failing_callback_is_reported,
                                  _cancel_does_not_call_back])
def test_slot(case: Any) -> None:
    asyncio.run(case())
