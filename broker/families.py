"""The key families of the schema (:mod:`broker.keys`), as the ACL rules and the operations'
declarations name them: every key of one kind in one partition is one family (``P:stream:<i>``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from broker.keys import Keys

__all__ = ["FAMILIES", "Family"]


def _stem(name: str, tail: str) -> str:
    """``name`` less its variable ``tail`` (the stage index or id it was built with)."""
    if not name.endswith(tail):
        raise AssertionError(f"key {name!r} does not end with {tail!r}: broker/keys.py changed its layout")
    return name[:len(name) - len(tail)]


@dataclass(frozen=True)
class Family:
    """The keys of one kind in one partition: ``key(keys)`` is the name (its variable part, a stage
    index, an id or a host, left out when ``variable``: then ``*`` matches it). Keys that workers
    write in partition 0 only (loading, stuck, pins) are still covered in every partition: status
    reads each partition's."""

    name: str  # as the docs write it: "P:stream:<i>"
    key: Callable[[Keys], str] = field(compare=False, repr=False)
    variable: bool = True
    within: str | None = None  # the family that holds every key of this one
    prefix_level: bool = False  # one per prefix, outside every pipeline's hash tag (``<prefix>:...``)


FIRST_STREAM = Family("P:stream:0", lambda k: k.stream(0), variable=False, within="P:stream:<i>")
STREAMS = Family("P:stream:<i>", lambda k: _stem(k.stream(0), "0"))
# The first stage's streams of the priority levels above the default (``P:stream:0`` itself is the default's).
FIRST_LEVELS = Family("P:stream:0:p<L>", lambda k: _stem(k.at_level(1).stream(0), "1"), within="P:stream:<i>")
DEAD = Family("P:dead:<i>", lambda k: _stem(k.dead(0), "0"))
STATS = Family("P:stats:<i>", lambda k: _stem(k.stats(0), "0"))
HEARTBEATS = Family("P:hb:<i>", lambda k: _stem(k.heartbeats(0), "0"))
LOADING = Family("P:loading:<i>", lambda k: _stem(k.loading(0), "0"))
STUCK = Family("P:stuck:<i>", lambda k: _stem(k.stuck(0), "0"))
COUNTS = Family("P:counts:<i>", lambda k: _stem(k.counts(0), "0"))
SCALE = Family("P:scale:<i>", lambda k: _stem(k.scale(0), "0"))
RESULTS = Family("P:result:<id>", lambda k: k.result(""))
CANCELS = Family("P:cancel:<id>", lambda k: k.cancel(""))
CANCEL_FLAG = Family("P:cancels", lambda k: k.cancels, variable=False)
REPLIES = Family("P:reply:<name>", lambda k: k.reply(""))
SPEC = Family("P:spec", lambda k: k.spec, variable=False)
MAX_BACKLOG = Family("P:max_backlog", lambda k: k.max_backlog, variable=False)
PINS = Family("P:pins:<host>", lambda k: k.pins(""))
# The reply list of a gateway process serving several pipelines on one Redis (gateway/client/hub.py).
SHARED_REPLIES = Family("<prefix>:reply:<name>", lambda k: k.shared_reply(""), prefix_level=True)
# The names of the pipelines registered under a prefix (workers add theirs; `conveyor gateway --all` reads it).
REGISTRY = Family("<prefix>:pipelines", lambda k: k.registry, variable=False, prefix_level=True)
# Most specific first: a key is told apart by the first family whose name it has (explain_refusal).
FAMILIES = (FIRST_STREAM, FIRST_LEVELS, STREAMS, DEAD, STATS, HEARTBEATS, LOADING, STUCK, COUNTS, SCALE, RESULTS,
            CANCELS, CANCEL_FLAG, REPLIES, SPEC, MAX_BACKLOG, PINS, SHARED_REPLIES, REGISTRY)
