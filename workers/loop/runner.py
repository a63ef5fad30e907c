"""Runs user code on a batch and isolates the items that make it fail.

A batched ``predict`` that raises, or returns the wrong number of results, is re-run on
each half of the batch, recursively, so only the offending items get the error and the
innocent ones their results. A batch with one bad item costs about 2*log2(n) extra calls.

``predict`` gets a list of its own (it may consume or pad it), and a bisection's calls get the items
as they arrived, decoded again from their payloads: a ``predict`` that changed them in place (``x /= 255``
on an array, a list padded) before it failed would otherwise answer the innocent items from what it made
of them (an image divided by 255 twice), with a 200 and no error. Results that must outlive a
later call on the same read are detached (:func:`detach`): a model that writes into a buffer it reuses
(ONNX Runtime's IOBinding, a TensorRT engine, a preallocated output) returns views of that buffer,
which the next call would overwrite before they are encoded.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from broker import codec, protocol
from workers.loop.tracebacks import Tracebacks


@dataclass(frozen=True, slots=True)
class Failure:
    """What a requester learns when stage code fails on its item."""

    type: str
    message: str
    traceback: str


class BatchLengthError(Exception):
    """A batched predict returned a number of results different from its inputs."""

    def __init__(self, message: str, returned: int = -1) -> None:
        super().__init__(message)
        self.returned = returned


Outcome = tuple[bool, Any]  # (True, value) or (False, Failure)

# What user code may raise that is its item's answer: anything, BaseException subclasses too (sys.exit in
# argparse's error(), a KeyboardInterrupt raised by hand, asyncio's CancelledError out of an event loop the
# stage runs, a library's own), which would otherwise end the worker at every delivery and take the item to
# the dead-letter stream as "its worker crashed". A worker's own SIGINT and SIGTERM only set a flag while
# predict runs (workers.process.child), so nothing of conveyor's own is raised through user code there.
USER_ERRORS: tuple[type[BaseException], ...] = (BaseException,)


def failure(exc: BaseException, tracebacks: Tracebacks | None) -> Failure:
    text = tracebacks.format(exc) if tracebacks is not None else "".join(traceback.format_exception(exc))
    try:
        message = str(exc)
    except Exception as err:  # user code: an exception whose __str__ raises still answers its item
        message = f"<str() of this {type(exc).__name__} raised {type(err).__name__}: {err!r}>"
    return Failure(type(exc).__name__, message, text)


_PLAIN = frozenset({str, int, float, bool, bytes, type(None)})
# Containers nested deeper are left as they are: the codec carries 511 levels and says why it refuses more (a
# cycle too). The walk keeps its own stack: a recursive one meets Python's limit near 490 levels (RecursionError).
_MAX_DETACH_DEPTH = 512


def _rebuilt_as(value: Any) -> type | None:
    """What :func:`detached` rebuilds ``value`` as (a subclass as plain as the codec sends it: a namedtuple, an
    OrderedDict), None if it is no container."""
    kind = type(value)
    if kind is list or kind is tuple or kind is dict:
        return kind
    if kind in _PLAIN or isinstance(value, np.ndarray):
        return None
    if isinstance(value, list | tuple):
        return tuple if isinstance(value, tuple) else list
    return dict if isinstance(value, dict) else None


def _leaf(value: Any) -> Any:
    return value.copy(order="K") if isinstance(value, np.ndarray) else value  # its layout kept (Fortran order)


def detached(value: Any) -> Any:
    """``value`` with each numpy array copied (containers walked): what it is now, whatever the stage
    does to its buffers next (an array it returns may be a buffer it writes again, or a view of one)."""
    if type(value) in _PLAIN:  # a singleton stage detaches every result of a read but its last: mostly these
        return value
    kind = _rebuilt_as(value)
    if kind is None:
        return _leaf(value)
    # Each container being rebuilt: its kind, what is left of it, what is built of it, the key it goes under.
    stack: list[tuple[type, Any, list[Any], Any]] = [(kind, iter(value.items() if kind is dict else value), [], None)]
    plain = _PLAIN
    while True:
        kind, rest, built, _ = stack[-1]
        keyed = kind is dict
        for child in rest:
            key, child = child if keyed else (None, child)
            if type(child) in plain:  # most leaves: the common case without a call
                built.append((key, child) if keyed else child)
                continue
            inner = _rebuilt_as(child)
            if inner is not None and len(stack) < _MAX_DETACH_DEPTH:
                stack.append((inner, iter(child.items() if inner is dict else child), [], key))
                break
            child = child if inner is not None else _leaf(child)  # too deep: left as it is
            built.append((key, child) if keyed else child)
        else:
            kind, _, built, key = stack.pop()
            made = kind(built)
            if not stack:
                return made
            parent = stack[-1]
            parent[2].append((key, made) if parent[0] is dict else made)


def detach(outcomes: list[Any], start: int = 0) -> list[Any]:
    """:func:`detached` on each result of ``outcomes`` from ``start``, in place (another call follows
    them); None (an item given to another worker) is left."""
    for i in range(start, len(outcomes)):
        outcome = outcomes[i]
        if outcome is not None and outcome[0] and type(outcome[1]) not in _PLAIN:
            outcomes[i] = (True, detached(outcome[1]))
    return outcomes


# An item whose deadline passed while the items before it in its read ran: answered, never run.
EXPIRED: Outcome = (False, Failure(protocol.E_DEADLINE, "deadline passed before the stage ran", ""))


def passed(deadline_ms: int | None) -> bool:
    """Whether ``deadline_ms`` (an item's) has passed (the read checked it; calls since take time)."""
    return deadline_ms is not None and protocol.now_ms() >= deadline_ms


def run_single(predict: Callable[[Any], Any], inputs: Sequence[Any],
               tracebacks: Tracebacks | None = None, deadlines_ms: Sequence[int | None] = ()) -> list[Outcome]:
    """``predict`` on each item (``tracebacks``: a worker's memo of formatted stacks); an item whose
    deadline (``deadlines_ms``) passed as the ones before it ran is :data:`EXPIRED`."""
    outcomes: list[Outcome] = []
    last = len(inputs) - 1
    for i, x in enumerate(inputs):
        if i and deadlines_ms and passed(deadlines_ms[i]):
            outcomes.append(EXPIRED)
            continue
        try:
            y = predict(x)
            outcomes.append((True, y if i == last or type(y) in _PLAIN else detached(y)))
        except USER_ERRORS as exc:  # user code: any exception is that item's answer
            outcomes.append((False, failure(exc, tracebacks)))
    return outcomes


def _call_batch(predict: Callable[[list[Any]], Any], inputs: list[Any]) -> list[Any]:
    results = predict(inputs[:])  # its own list: a predict may consume or pad what it is given
    try:
        results = list(results)
    except TypeError as exc:
        raise BatchLengthError(f"batched predict must return a sequence, got {type(results).__name__}") from exc
    if len(results) != len(inputs):
        raise BatchLengthError(f"batched predict returned {len(results)} results for {len(inputs)} inputs",
                               len(results))
    return results


def run_batch(predict: Callable[[list[Any]], Any], inputs: list[Any],
              wrong_length: Callable[[int, int], None] | None = None,
              tracebacks: Tracebacks | None = None, deadlines_ms: Sequence[int | None] = (),
              payloads: Sequence[bytes] = ()) -> list[Outcome]:
    """``predict`` on the batch, each failing item isolated; ``wrong_length(expected, returned)``
    hears of each call that returned the wrong number of results (the caller logs and counts it).
    A bisection's call leaves out the items whose deadline (``deadlines_ms``) passed meanwhile: a
    batch that fails whole (a model down) costs 2n - 1 calls, which must not run for callers gone.
    ``payloads`` (each input's encoded bytes, when known) are decoded again for the halves: the failed
    call may have changed its items in place."""
    if not inputs:
        return []
    try:
        return [(True, y) for y in _call_batch(predict, inputs)]
    except USER_ERRORS as exc:  # user code: isolate who caused it
        if isinstance(exc, BatchLengthError) and wrong_length is not None:
            wrong_length(len(inputs), exc.returned)
        if len(inputs) == 1:
            return [(False, failure(exc, tracebacks))]
    if payloads:  # as they arrived, not as the failed call left them (decoded once already: they decode)
        inputs = [codec.decode(payload) for payload in payloads]
    mid = len(inputs) // 2
    first = detach(run_live_batch(predict, inputs[:mid], wrong_length, tracebacks, deadlines_ms[:mid],
                                  payloads[:mid]))
    return first + run_live_batch(predict, inputs[mid:], wrong_length, tracebacks, deadlines_ms[mid:], payloads[mid:])


def run_live_batch(predict: Callable[[list[Any]], Any], inputs: list[Any],
                   wrong_length: Callable[[int, int], None] | None, tracebacks: Tracebacks | None,
                   deadlines_ms: Sequence[int | None], payloads: Sequence[bytes] = ()) -> list[Outcome]:
    """:func:`run_batch` on the items of ``inputs`` still within their deadlines; the others :data:`EXPIRED`
    (a call that follows others of the same read, which took time)."""
    now_ms = protocol.now_ms()
    live = [i for i, deadline in enumerate(deadlines_ms) if deadline is None or deadline > now_ms] \
        if deadlines_ms else None
    if live is None or len(live) == len(inputs):
        return run_batch(predict, inputs, wrong_length, tracebacks, deadlines_ms, payloads)
    ran = iter(run_batch(predict, [inputs[i] for i in live], wrong_length, tracebacks, [deadlines_ms[i] for i in live],
                         [payloads[i] for i in live] if payloads else ()))
    kept = set(live)
    return [next(ran) if i in kept else EXPIRED for i in range(len(inputs))]
