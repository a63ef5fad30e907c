"""The user-facing Stage API: plain synchronous Python, one instance per worker process."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar, overload


class _End:
    """The type of :data:`END`: one value, compared by identity."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "END"


# In a streaming batched stage's step, the item at this place has finished (its stream ends).
END = _End()


class LiveBatch(Sequence[Any]):
    """A continuous batch (a streaming stage with ``continuous = True``): ``batch_size`` slots, each an
    input or None (free). Between steps conveyor frees the slots of items that ended or whose callers
    left, and fills free slots with new items; :meth:`joined` says which slots were filled since it was
    last called. Each step yields one value per slot (a chunk, None, or END); a free slot's is ignored.
    True while a slot is occupied: ``while batch:`` ends the generator once nothing is left."""

    def __init__(self, size: int) -> None:
        self._slots: list[Any] = [None] * size
        self._occupied = [False] * size
        self._joined: list[int] = []

    def __len__(self) -> int:
        return len(self._slots)

    @overload
    def __getitem__(self, index: int) -> Any: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[Any]: ...
    def __getitem__(self, index: int | slice) -> Any:
        return self._slots[index]

    def __bool__(self) -> bool:
        return any(self._occupied)

    def joined(self) -> list[int]:
        """The slots filled since the last call, in order."""
        joined, self._joined = self._joined, []
        return joined

    def occupied(self, slot: int) -> bool:
        return self._occupied[slot]

    def fill(self, slot: int, x: Any) -> None:
        """conveyor's: a new item in a free slot."""
        self._slots[slot], self._occupied[slot] = x, True
        self._joined.append(slot)

    def free(self, slot: int) -> None:
        """conveyor's: the slot's item ended or left."""
        self._slots[slot], self._occupied[slot] = None, False
        if slot in self._joined:
            self._joined.remove(slot)


class Stage:
    """Subclass it and write ``predict``.

    Class attributes are the stage's defaults; ``Pipeline.add(...)`` overrides them (one a typo or
    two from a setting's name, ``batch_sise``, is refused there).
    With ``batch_size`` absent or 1, ``predict(x)`` takes one input and returns one output.
    With ``batch_size > 1``, ``predict(xs)`` takes a list and returns a list, tuple or array of
    the same length, one result per input, in order (a dict, str, set or generator is each item's
    ``BatchResultError``); conveyor waits at most ``batch_wait_s`` after a batch's first item.
    A ``predict`` that is a generator (it ``yield``s) **streams** its answer (the last stage only):
    unbatched, each yielded value is one chunk of the item's answer; batched, each yielded step is a
    sequence aligned with the batch, per item a chunk, ``None`` (nothing this step) or :data:`END`
    (that item is done). A caller who leaves closes the generator (``GeneratorExit``) before its next
    step (unbatched; batched: once every item of the batch has ended or left). ``deterministic =
    True`` says a re-run yields the same chunks: a stream cut by a worker's death then continues
    where it was; otherwise it ends with a ``StreamInterrupted`` error. ``continuous = True`` (a
    streaming batched stage): ``predict`` takes a :class:`LiveBatch`, into which new items join between
    steps, as generative servers batch (continuous batching).
    ``batch_policy`` "adaptive" (default) dispatches as soon as waiting can no longer pay;
    "deadline" always waits for ``batch_size`` items or ``batch_wait_s`` (gather N callers).
    Other keyword arguments of ``add`` arrive in ``__init__`` as plain data: parameters your
    ``__init__`` names, or (with this base class's ``__init__``) attributes your class declares,
    set on the instance; anything else is refused by ``add``, with the nearest name.
    """

    name: ClassVar[str | None] = None
    # Worker processes: a number, or a range (min, max) the supervisor scales within from the stage's
    # backlog (workers/process/scaling.py): up while the expected wait passes target_wait_s, down one
    # after scale_down_after_s with little to do.
    workers: ClassVar[int | tuple[int, int] | None] = None
    target_wait_s: ClassVar[float | None] = None
    scale_down_after_s: ClassVar[float | None] = None
    cpus: ClassVar[list[int] | None] = None
    threads: ClassVar[int | None] = None
    batch_size: ClassVar[int | None] = None
    batch_wait_s: ClassVar[float | None] = None
    batch_policy: ClassVar[str | None] = None  # "adaptive" (default) or "deadline"
    max_run_s: ClassVar[float | None] = None
    # A predict still running this long past every deadline of its batch is reported with its stack
    # and its worker replaced (default 10 s; Pipeline.add(cls, stuck_grace_s=None) turns it off).
    stuck_grace_s: ClassVar[float | None] = None
    # A setup() still running this long (a deadlock, a stalled file system) is reported with its stack and its
    # worker replaced, counted as a failed start (default None: never; a slow load is warned of every minute).
    setup_timeout_s: ClassVar[float | None] = None
    # Entries read behind a predict call that has run this long (and 4x the longest call of late) go to
    # the stage's other workers (default 1 s; Pipeline.add(cls, handoff_after_s=None) turns it off).
    handoff_after_s: ClassVar[float | None] = None
    deterministic: ClassVar[bool | None] = None  # a streaming stage's re-run yields the same chunks
    # A streaming batched stage whose predict takes a LiveBatch: new items join between steps.
    continuous: ClassVar[bool | None] = None
    max_backlog: ClassVar[int | None] = None
    max_deliveries: ClassVar[int | None] = None
    claim_idle_s: ClassVar[float | None] = None
    # A burst read whole while peer workers idle gives them an even share (workers/batching/sharing.py).
    share_bursts: ClassVar[bool | None] = None
    # Length-aware batching (workers/batching/grouping.py): define ``batch_key(self, x)`` returning a
    # sortable cost of one decoded item (e.g. its token count); each batch read is then sorted by
    # it and run as groups of at most ``group_size`` similar items (default batch_size // 4).
    # ``Pipeline.add(cls, batch_key=None)`` turns it off for one pipeline. ``group_spread`` (a number
    # >= 1) also ends a group where an item costs more than that many times the group's cheapest.
    batch_key: Callable[[Any], Any] | None = None
    group_size: int | None = None
    group_spread: float | None = None

    def __init__(self, **kwargs: Any) -> None:
        for key, value in kwargs.items():
            setattr(self, key, value)

    def setup(self) -> None:
        """Load the model. Runs once in the worker process, after pinning and thread limits,
        before the worker reads anything."""

    def predict(self, x: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__}.predict is not implemented")
