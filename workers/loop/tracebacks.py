"""A stage error's traceback, its stack formatted once per place it was raised from.

Python 3.11's ``traceback.format_exception`` reads each frame's source line and parses it (``ast``) to place
its carets, which is most of a worker's CPU under a storm of requests that all fail the same way (a client
sending what the stage cannot take). The text of a traceback's stack depends only on where each of its frames
stands (code object and instruction), so it is kept by that; the exception's own lines (type, message, notes)
are formatted every time. Chained exceptions and exception groups, whose text depends on more, are formatted
in full each time.
"""

from __future__ import annotations

import builtins
import traceback
from types import CodeType, TracebackType

__all__ = ["Tracebacks"]

HEADER = "Traceback (most recent call last):\n"
# Exception groups (Python 3.11 on), formatted in full: their text nests their members' tracebacks.
_GROUPS: tuple[type[BaseException], ...] = tuple(
    t for t in (getattr(builtins, "BaseExceptionGroup", None),) if isinstance(t, type))


class Tracebacks:
    """``format(exc)`` is ``"".join(traceback.format_exception(exc))``, its stack part memoized
    (at most ``max_stacks`` of them: a stage raises from a handful of places; past that the memo
    starts again, so that code raising from ever new places keeps its memory bounded)."""

    def __init__(self, max_stacks: int = 256) -> None:
        self._max_stacks = max_stacks
        self._stacks: dict[tuple[tuple[CodeType, int], ...], str] = {}

    def format(self, exc: BaseException) -> str:
        tb = exc.__traceback__
        if tb is None or exc.__cause__ is not None or isinstance(exc, _GROUPS) \
                or (exc.__context__ is not None and not exc.__suppress_context__):
            return "".join(traceback.format_exception(exc))
        where = []
        frame: TracebackType | None = tb
        while frame is not None:
            where.append((frame.tb_frame.f_code, frame.tb_lasti))
            frame = frame.tb_next
        key = tuple(where)
        stack = self._stacks.get(key)
        if stack is None:
            if len(self._stacks) >= self._max_stacks:
                self._stacks.clear()
            stack = self._stacks[key] = "".join(traceback.format_tb(tb))
        return HEADER + stack + "".join(traceback.format_exception_only(exc))

    def __len__(self) -> int:
        return len(self._stacks)
