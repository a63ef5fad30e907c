"""A request's answer delivered straight to its one consumer, without an event-loop handle.

An `asyncio.Future` runs its done-callbacks through ``loop.call_soon``: one `Handle` per
answer, run on the loop's next turn. The HTTP front has exactly one consumer per request (its
connection, which writes the reply), so `Gateway.submit(..., direct=True)` hands it a `Slot`
instead: whoever completes it (the reply reader, the deadline timer, a refused submission, the
gateway's close) calls the callback at once, in its own stack. The Python API keeps futures
(awaiting needs one).

A `Slot` has the parts of the `asyncio.Future` interface that the gateway and the HTTP front
use: ``done``, ``cancelled``, ``result``, ``exception``, ``set_result``, ``set_exception``,
``cancel`` and one ``add_done_callback``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

__all__ = ["Answer", "Slot", "Waiter", "awaitable", "failure", "new_answer"]

_PENDING, _DONE, _CANCELLED = 0, 1, 2


class Answer(asyncio.Future[Any]):
    """The Python API's waiter: a future that knows its request's id (the hub finds its record by it
    when its caller leaves, rather than looking through every request in flight), and cancels its
    request when it is cancelled itself: by the task awaiting it, or ``cancel()`` on ``submit``'s future."""

    __slots__ = ("on_cancel", "request_id")
    request_id: bytes
    on_cancel: Callable[[Answer], object]  # set by new_answer (an __init__ here would cost every request)

    def cancel(self, msg: Any = None) -> bool:
        cancelled = super().cancel(msg)
        if cancelled:
            self.on_cancel(self)
        return cancelled


def new_answer(loop: asyncio.AbstractEventLoop, on_cancel: Callable[[Answer], object]) -> Answer:
    answer = Answer(loop=loop)
    answer.on_cancel = on_cancel
    return answer


class Slot:
    __slots__ = ("_callback", "_exception", "_loop", "_result", "_state", "request_id")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = b""  # set as the hub takes the request
        self._loop = loop
        self._state = _PENDING
        self._result: Any = None
        self._exception: BaseException | None = None
        self._callback: Callable[[Slot], object] | None = None

    def done(self) -> bool:
        return self._state != _PENDING

    def cancelled(self) -> bool:
        return self._state == _CANCELLED

    def result(self) -> Any:
        if self._state == _CANCELLED:
            raise asyncio.CancelledError()
        if self._state == _PENDING:
            raise asyncio.InvalidStateError("result is not set")
        if self._exception is not None:
            raise self._exception
        return self._result

    def exception(self) -> BaseException | None:
        if self._state == _CANCELLED:
            raise asyncio.CancelledError()
        if self._state == _PENDING:
            raise asyncio.InvalidStateError("exception is not set")
        return self._exception

    def add_done_callback(self, fn: Callable[[Slot], object]) -> None:
        """One callback only (its consumer). Added to a slot already done, it runs on the next
        loop turn, as a future's would: the caller is not re-entered."""
        if self._callback is not None:
            raise RuntimeError("a Slot takes one done-callback")
        self._callback = fn
        if self._state != _PENDING:
            self._loop.call_soon(self._run, fn)

    def set_result(self, value: Any) -> None:
        self._complete(value, None)

    def set_exception(self, exc: BaseException) -> None:
        self._complete(None, exc)

    def _complete(self, value: Any, exc: BaseException | None) -> None:
        if self._state != _PENDING:
            raise asyncio.InvalidStateError("slot already done")
        self._result, self._exception, self._state = value, exc, _DONE
        fn = self._callback
        if fn is not None:
            self._run(fn)

    def cancel(self) -> bool:
        """Marks the slot cancelled *without* calling back: its consumer cancels it only as it
        drops the request (a drain timeout, a second stop), so there is nobody left to tell."""
        if self._state != _PENDING:
            return False
        self._state = _CANCELLED
        return True

    def _run(self, fn: Callable[[Slot], object]) -> None:
        """A failing consumer must not break its caller (the reply reader, the deadline timer):
        reported as the loop reports a failing callback."""
        try:
            fn(self)
        except Exception as exc:
            self._loop.call_exception_handler({"message": "exception in a Slot's done-callback", "exception": exc})


# What a pending request's consumer waits on: a future (the Python API), or a `Slot` (the HTTP front).
Waiter = asyncio.Future[Any] | Slot


def awaitable(waiter: Waiter) -> asyncio.Future[Any]:
    """A future done when ``waiter`` is (``waiter`` itself if it is one), for a coroutine that must
    await a `Slot` (a rare path: the usual one adds a callback)."""
    if isinstance(waiter, asyncio.Future):
        return waiter
    future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

    def done(_: Any) -> None:
        if not future.done():
            future.set_result(None)

    waiter.add_done_callback(done)
    return future


def failure(waiter: Waiter) -> Exception | None:
    """The exception a done ``waiter`` holds, or None: read, never raised. Raised (by ``result()``)
    it makes a reference cycle per failed request (its traceback holds the consumer's frame, that
    frame the waiter, the waiter the exception), which only the garbage collector frees: a storm of
    failing requests keeps it busy and its full collections
    stall every connection. As ``result()`` does, a cancelled waiter raises CancelledError, and an
    exception that is not an ``Exception`` (a BaseException) is raised."""
    exc = waiter.exception()
    if exc is None or isinstance(exc, Exception):
        return exc
    raise exc
