"""Length-aware batching: one predict call holds items of similar cost.

A model that pads a batch to its longest item (a transformer on text) pays for the padding: on
mixed-length text that is a third of the forward pass. A stage that defines ``batch_key(x)``
(a sortable cost of one decoded item, such as its token count) gets each batch it reads sorted by
that cost and split into consecutive groups of at most ``group_size`` items, one ``predict`` call
each; results go back to their requests in the original order.

Why only within what was read: the worker still reads exactly as before (up to ``batch_size``
items, waiting at most ``batch_wait_s`` after the first), and every item it read runs in this
round, so grouping never makes an item wait for a later batch. Reading a larger window to sort
would hold items away from idle peer workers and delay their commits; sorting 64 texts and
running them as four groups of 16 recovers most of the padding already (docs/embeddings.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from workers.loop.runner import Failure

Run = Callable[[Callable[[list[Any]], Any], list[Any]], list[Any]]


def group_size_of(stage: Any, batch_size: int) -> int:
    """``stage.group_size`` if set, else a quarter of the batch (at least one item)."""
    size = getattr(stage, "group_size", None)
    if size is None:
        return max(1, batch_size // 4)
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"group_size must be an integer >= 1, got {size!r}")
    return size


def _cost(key: Callable[[Any], Any], x: Any) -> tuple[bool, Any]:
    """(failed, cost): an item whose key raises sorts last and meets predict alone in its group's
    bisection (runner.run_batch), where it gets its own error; it never fails the others."""
    try:
        return (False, key(x))
    except Exception:  # user code
        return (True, 0)


def plan_groups(inputs: Sequence[Any], key: Callable[[Any], Any], group_size: int) -> list[list[int]]:
    """Indices of ``inputs`` sorted by cost, in consecutive groups of at most ``group_size``,
    sized as evenly as possible (64 items in groups of up to 24 -> 21, 21, 22)."""
    costs = [_cost(key, x) for x in inputs]
    try:
        order = sorted(range(len(inputs)), key=costs.__getitem__)
    except (TypeError, ValueError):  # costs that do not compare (mixed types, arrays): keep arrival order
        order = list(range(len(inputs)))
    n_groups = -(-len(order) // group_size)
    groups, start = [], 0
    for g in range(n_groups):
        size = (len(order) - start) // (n_groups - g)
        groups.append(order[start:start + size])
        start += size
    return groups


def run_grouped(stage: Any, inputs: list[Any], batch_size: int, run: Run) -> list[Any]:
    """``run(stage.predict, inputs)``, split by cost when the stage defines ``batch_key``;
    outcomes come back in the order of ``inputs``."""
    key = getattr(stage, "batch_key", None)
    if key is None or len(inputs) <= 1:
        return run(stage.predict, inputs)
    try:
        size = group_size_of(stage, batch_size)
    except ValueError as exc:  # a configuration error: each requester learns it, the worker lives on
        return [(False, Failure("ValueError", str(exc), ""))] * len(inputs)
    outcomes: list[Any] = [None] * len(inputs)
    for group in plan_groups(inputs, key, size):
        for i, outcome in zip(group, run(stage.predict, [inputs[i] for i in group]), strict=True):
            outcomes[i] = outcome
    return outcomes
