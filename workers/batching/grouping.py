"""Length-aware batching: one predict call holds items of similar cost.

A model that pads a batch to its longest item (a transformer on text) pays for the padding: on
mixed-length text that is a large share of the forward pass. A stage that defines ``batch_key(x)``
(a sortable cost of one decoded item, such as its token count) gets each batch it reads sorted by
that cost and split into consecutive groups of at most ``group_size`` items, one ``predict`` call
each; results go back to their requests in the original order.

Why only within what was read: the worker still reads exactly as before (up to ``batch_size``
items, waiting at most ``batch_wait_s`` after the first), and every item it read runs in this
round, so grouping never makes an item wait for a later batch. Reading a larger window to sort
would hold items away from idle peer workers and delay their commits; sorting 64 texts and
running them as four groups of 16 recovers most of the padding already (docs/embeddings.md).

``group_spread`` (off by default): a group also ends where an item costs more than ``group_spread``
times the group's cheapest. Few items per read (8 texts in flight over two workers: reads of 4)
sort into one group whatever their lengths, and the short ones pay for the longest one's padding;
splitting such a read where lengths diverge costs an extra call and saves that padding (figures:
docs/embeddings.md). The cost of
an extra ``predict`` call is what bounds this: an engine whose calls are dear wants a wider spread.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from numbers import Real
from typing import Any

from workers.loop.runner import USER_ERRORS, Failure, detach

# run(predict, inputs, deadlines_ms, payloads): payloads are the inputs' encoded bytes, or () (runner.run_batch)
Run = Callable[[Callable[[list[Any]], Any], list[Any], Sequence[int | None], Sequence[bytes]], list[Any]]
OnKeyError = Callable[[BaseException], None]

log = logging.getLogger("conveyor.worker")
# (stage, exception type) pairs already said: a key raising on every item is one fault, said once per process.
_said: set[tuple[str, str]] = set()


def group_size_of(stage: Any, batch_size: int) -> int:
    """``stage.group_size`` if set, else a quarter of the batch (at least one item)."""
    size = getattr(stage, "group_size", None)
    if size is None:
        return max(1, batch_size // 4)
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"group_size must be an integer >= 1, got {size!r}")
    return size


def group_spread_of(stage: Any) -> float | None:
    """``stage.group_spread``: None (off), else a finite number >= 1 (infinity would cut nowhere: None says so)."""
    spread = getattr(stage, "group_spread", None)
    if spread is None:
        return None
    value = float(spread) if isinstance(spread, Real) and not isinstance(spread, bool) else float("nan")
    if not (math.isfinite(value) and value >= 1):  # NaN fails too
        raise ValueError(f"group_spread must be a finite number >= 1, or None for no cut, got {spread!r}")
    return value


def _cost(key: Callable[[Any], Any], x: Any, on_error: OnKeyError | None = None) -> tuple[bool, Any]:
    """(failed, cost): an item whose key raises sorts last and meets predict alone in its group's
    bisection (runner.run_batch), where it gets its own error; it never fails the others. The
    exception goes to ``on_error``: a key that raises on every item turns length-aware batching off,
    which must be said (it once was not)."""
    try:
        return (False, key(x))
    except USER_ERRORS as exc:  # user code, a BaseException too (workers.loop.runner)
        if on_error is not None:
            on_error(exc)
        return (True, 0)


def key_error_logger(stage: str) -> OnKeyError:
    """``plan_groups``'s ``on_error`` for ``stage``: a warning the first time each exception type is
    raised in this process (with the stage and the exception), then silence: serving goes on, the
    failing items sorted last, and a log line per item would flood the log."""
    def said(exc: BaseException) -> None:
        seen = (stage, type(exc).__name__)
        if seen not in _said:
            _said.add(seen)
            log.warning("batch_key raised stage=%s type=%s message=%s: its items sort last (cost 0), so "
                        "length-aware batching is off for them; said once per stage and exception type",
                        stage, type(exc).__name__, _text(exc)[:500])
    return said


def _text(exc: BaseException) -> str:
    """``str(exc)``, or what went wrong with it: an exception whose ``__str__`` raises (user code) must not
    end the worker where it is logged (workers.loop.runner.failure says such an item's error so)."""
    try:
        return str(exc)
    except USER_ERRORS as err:
        return f"<str() of this {type(exc).__name__} raised {type(err).__name__}>"


def _number(cost: tuple[bool, Any]) -> float | None:
    """A cost the spread can compare: a positive real number whose key did not fail."""
    failed, value = cost
    if failed or isinstance(value, bool) or not isinstance(value, Real):  # numpy's numbers are Real too
        return None
    try:
        number = float(value)
    except OverflowError:  # an int past float's range: sorted, but not compared
        return None
    return number if number > 0 else None  # NaN is not


def _runs(order: list[int], costs: list[tuple[bool, Any]], spread: float | None) -> list[list[int]]:
    """``order`` cut where an item costs more than ``spread`` times its run's first (cheapest) item."""
    if spread is None or not order:
        return [order]
    runs, run = [], [order[0]]
    floor = _number(costs[order[0]])
    for i in order[1:]:
        cost = _number(costs[i])
        if floor is not None and cost is not None and cost > spread * floor:
            runs.append(run)
            run, floor = [i], cost
        else:
            run.append(i)
            floor = cost if floor is None else floor  # after zero costs, the first positive one
    runs.append(run)
    return runs


def _even(order: list[int], group_size: int) -> list[list[int]]:
    """``order`` in consecutive groups of at most ``group_size``, sized as evenly as possible."""
    n_groups = -(-len(order) // group_size)
    groups, start = [], 0
    for g in range(n_groups):
        size = (len(order) - start) // (n_groups - g)
        groups.append(order[start:start + size])
        start += size
    return groups


def plan_groups(inputs: Sequence[Any], key: Callable[[Any], Any], group_size: int,
                spread: float | None = None, on_error: OnKeyError | None = None) -> list[list[int]]:
    """Indices of ``inputs`` sorted by cost, in consecutive groups of at most ``group_size``,
    sized as evenly as possible (64 items in groups of up to 24 -> 21, 21, 22); with ``spread``,
    first cut where a cost passes ``spread`` times the cheapest since the last cut. ``on_error``:
    told of each exception ``key`` raises (:func:`key_error_logger`)."""
    costs = [_cost(key, x, on_error) for x in inputs]
    try:
        order = sorted(range(len(inputs)), key=costs.__getitem__)
    except USER_ERRORS:  # user code: costs that do not compare (mixed types, arrays; a torch tensor's
        # RuntimeError, a user's __lt__): kept in arrival order, never the worker's crash at every batch
        return _even(list(range(len(inputs))), group_size)
    return [group for run in _runs(order, costs, spread) for group in _even(run, group_size)]


def run_grouped(stage: Any, inputs: list[Any], batch_size: int, run: Run,
                deadlines_ms: Sequence[int | None] = (), stage_name: str | None = None,
                payloads: Sequence[bytes] = ()) -> list[Any]:
    """``run(stage.predict, inputs, deadlines_ms, payloads)``, split by cost when the stage defines
    ``batch_key``; outcomes come back in the order of ``inputs``. ``stage_name`` (default: the class's)
    names the stage where ``batch_key`` raising is logged."""
    key = getattr(stage, "batch_key", None)
    if key is None or len(inputs) <= 1:
        return run(stage.predict, inputs, deadlines_ms, payloads)
    try:
        size, spread = group_size_of(stage, batch_size), group_spread_of(stage)
    except ValueError as exc:  # a configuration error: each requester learns it, the worker lives on
        return [(False, Failure("ValueError", str(exc), ""))] * len(inputs)
    outcomes: list[Any] = [None] * len(inputs)
    groups = plan_groups(inputs, key, size, spread, key_error_logger(stage_name or type(stage).__name__))
    for n, group in enumerate(groups, 1):
        deadlines = [deadlines_ms[i] for i in group] if deadlines_ms else ()
        encoded = [payloads[i] for i in group] if payloads else ()
        ran = run(stage.predict, [inputs[i] for i in group], deadlines, encoded)
        if n < len(groups):  # the next group's call may overwrite buffers these view (workers.loop.runner)
            detach(ran)
        for i, outcome in zip(group, ran, strict=True):
            outcomes[i] = outcome
    return outcomes
