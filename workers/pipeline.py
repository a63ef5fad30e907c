"""A pipeline: an ordered list of stage specs under a name, each resolved from its class and its
``add`` options and checked there (:mod:`workers.options`), so a mistake fails where it is written.

Workers read it to know their stream and the next one, the CLI to find a stage by name; gateways
never import it (they read the stages from ``P:spec``, :mod:`broker.spec`).
"""

from __future__ import annotations

import inspect
import logging
import math
import operator
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from broker.keys import DEFAULT_PREFIX, KeyNameError, Keys, partitions_problem
from broker.levels import MAX_LEVELS
from broker.spec import PipelineIO, StageInfo, TensorSpec, task_error
from workers.batching.grouping import group_size_of, group_spread_of
from workers.options import STAGE_KNOBS, PipelineError, check_options, check_stage_class
from workers.stage import Stage

BATCH_POLICIES = ("adaptive", "deadline")  # see workers/batching/collector.py
DEFAULT_STUCK_GRACE_S = 10.0
DEFAULT_HANDOFF_AFTER_S = 1.0
DEFAULT_TARGET_WAIT_S = 0.1
DEFAULT_SCALE_DOWN_AFTER_S = 60.0
LONG_BATCH_WAIT_S = 1.0  # a longer batch_wait_s is warned of: it is in seconds
# Far above any model's batch (GPU batches are in the thousands), far below what misbehaves: a continuous stage's
# LiveBatch allocates its slots up front (10**9 took gigabytes at start) and past 2**63 - 1 Redis refuses
# XREADGROUP's COUNT, failing every read; a worker takes up to this many entries in one reply.
MAX_BATCH_SIZE = 1_000_000
# A batch's longest wait, a day: past ~9.2e9 s a socket's timeout overflows the platform's time_t and Redis
# refuses so long a BLOCK, so a "forever" written as sys.maxsize crashed the worker at its first batch, then at
# every restart. No caller waits a day for a batch to fill.
MAX_BATCH_WAIT_S = 86_400.0

log = logging.getLogger("conveyor.pipeline")

__all__ = ["MAX_BATCH_SIZE", "STAGE_KNOBS", "Pipeline", "PipelineError", "StageSpec"]


@dataclass(frozen=True)
class StageSpec:
    """Everything a worker process needs to run one stage, resolved from class and `add`."""

    cls: type
    index: int
    name: str
    workers: int = 1  # the fewest worker processes (all of them, unless max_workers is larger)
    max_workers: int | None = None  # workers=(min, max): the most the supervisor scales to (workers.process.scaling)
    target_wait_s: float = DEFAULT_TARGET_WAIT_S  # scale up while an item's expected wait in the backlog is longer
    scale_down_after_s: float = DEFAULT_SCALE_DOWN_AFTER_S  # scale down one after this long with little to do
    cpus: tuple[int, ...] | None = None
    threads: int | None = None
    batch_size: int = 1
    batch_wait_s: float = 0.0
    batch_policy: str = "adaptive"
    max_run_s: float | None = None
    # A predict still running this long after every item of its batch passed its deadline is
    # stuck: reported with its stack and replaced (workers.process.supervisor). None: never.
    stuck_grace_s: float | None = DEFAULT_STUCK_GRACE_S
    # A setup() still running this long is stuck: reported with its stack and its worker replaced, as a worker
    # that died before it was ready (workers.process.supervisor). None (the default): never, only warned of.
    setup_timeout_s: float | None = None
    # Entries read but not started behind a call running this long (and 4x the longest call of late) are
    # given to the stage's other workers (workers.loop.handoff). None: never.
    handoff_after_s: float | None = DEFAULT_HANDOFF_AFTER_S
    max_backlog: int | None = None
    max_deliveries: int = 5
    claim_idle_s: float = 30.0
    share_bursts: bool = True
    deterministic: bool = False  # a streaming stage's re-run yields the same chunks (workers.loop.streaming)
    continuous: bool = False  # a streaming batched stage: new items join a running batch between steps
    kwargs: Mapping[str, Any] = field(default_factory=dict)

    @property
    def streams(self) -> bool:
        """Its ``predict`` is a generator: its answers are streamed, chunk by chunk."""
        return inspect.isgeneratorfunction(getattr(self.cls, "predict", None))

    @property
    def batched(self) -> bool:
        return self.batch_size > 1

    @property
    def autoscaled(self) -> bool:
        return self.max_workers is not None and self.max_workers > self.workers

    def validate(self) -> None:
        """Every setting's type and range, with the stage and the setting named."""
        if not isinstance(self.name, str) or not self.name:
            raise PipelineError(f"stage names must be non-empty strings, got {self.name!r}")
        name = self.name
        # max_backlog 0 would refuse every request (Overloaded, 503): unset (None) is "no bound".
        for knob, minimum, optional in (("workers", 1, False), ("batch_size", 1, False), ("max_deliveries", 1, False),
                                        ("threads", 1, True), ("max_backlog", 1, True)):
            value = getattr(self, knob)
            if not (optional and value is None):
                _check_int(name, knob, value, minimum)
        if self.batch_size > MAX_BATCH_SIZE:
            raise PipelineError(f"stage {name}: batch_size must be at most {MAX_BATCH_SIZE} (a worker reads and holds "
                                f"that many entries at once), got {self.batch_size!r}")
        if self.max_workers is not None:
            _check_int(name, "workers' maximum", self.max_workers, self.workers)
        for knob, allow_zero, optional in (("batch_wait_s", True, False), ("claim_idle_s", False, False),
                                           ("target_wait_s", False, False), ("scale_down_after_s", False, False),
                                           ("max_run_s", False, True), ("stuck_grace_s", True, True),
                                           ("setup_timeout_s", False, True), ("handoff_after_s", False, True)):
            value = getattr(self, knob)
            if not (optional and value is None):
                _check_number(name, knob, value, allow_zero=allow_zero)
        if self.batch_wait_s > MAX_BATCH_WAIT_S:
            raise PipelineError(f"stage {name}: batch_wait_s must be at most {MAX_BATCH_WAIT_S:g} (a day, in seconds; "
                                f"the deadline policy fills a batch within it), got {self.batch_wait_s!r}")
        self._check_choices()

    def _check_choices(self) -> None:
        """The settings that are one of a few values or a list."""
        name = self.name
        if self.batch_policy not in BATCH_POLICIES:
            raise PipelineError(f"stage {name}: batch_policy must be one of "
                                f"{', '.join(map(repr, BATCH_POLICIES))}, got {self.batch_policy!r}")
        if self.cpus is not None and len(self.cpus) == 0:
            raise PipelineError(f"stage {name}: cpus must not be empty (omit it for the default spread)")
        for cpu in self.cpus or ():
            _check_int(name, "cpus entries", cpu, 0)
        for knob in ("share_bursts", "deterministic", "continuous"):
            if not isinstance(getattr(self, knob), bool):
                raise PipelineError(f"stage {name}: {knob} must be True or False, got {getattr(self, knob)!r}")
        for method in ("predict", "setup"):
            code = getattr(self.cls, method, None)
            if inspect.iscoroutinefunction(code) or inspect.isasyncgenfunction(code):
                raise PipelineError(f"stage {name}: {method} is 'async def'; a stage's code is plain synchronous "
                                    "Python, run in its worker's own process (write it with 'def')")
        if self.continuous and not (self.streams and self.batched):
            raise PipelineError(f"stage {name}: continuous=True needs a streaming batched predict (it yields, and "
                                f"batch_size > 1), got {'a returning' if not self.streams else 'an unbatched'} one")


def _keys(name: str, prefix: str) -> Keys:
    """The pipeline's keys; a name or prefix no key can hold is the pipeline's configuration error."""
    try:
        return Keys(name, prefix)
    except KeyNameError as exc:
        raise PipelineError(str(exc)) from None


def _check_grouping(stage: str, cls: type, options: Mapping[str, Any]) -> None:
    """``group_size`` and ``group_spread`` (length-aware batching), from ``add``'s options or the class, by
    the rules the worker applies (workers.batching.grouping): checked here, they failed every item of each
    batch instead. A stage whose ``setup`` sets them is still checked there."""
    _check_batch_key(stage, cls, options)
    given = SimpleNamespace(**{knob: options.get(knob, getattr(cls, knob, None))
                               for knob in ("group_size", "group_spread")})
    try:
        group_size_of(given, 1)
        group_spread_of(given)
    except ValueError as exc:
        raise PipelineError(f"stage {stage}: {exc}") from None


def _check_batch_key(stage: str, cls: type, options: Mapping[str, Any]) -> None:
    """``batch_key`` is None or called with one decoded item. A string (``batch_key = "cost"``) or a method
    without the item's parameter was accepted, raised on every item at run time, and length-aware batching
    was silently off: refused here, where it is written."""
    if "batch_key" in options:  # Pipeline.add(cls, batch_key=f): set on the instance, called as f(x)
        key, static = options["batch_key"], None
    else:
        key, static = getattr(cls, "batch_key", None), inspect.getattr_static(cls, "batch_key", None)
    if key is None:
        return
    if not callable(key):
        raise PipelineError(f"stage {stage}: batch_key must be a method batch_key(self, x) returning one item's "
                            f"cost (or None for no length-aware batching), got {key!r} ({type(key).__name__})")
    args = 2 if inspect.isfunction(static) else 1  # a plain function in the class body is bound: (self, x)
    try:
        inspect.signature(key).bind(*[None] * args)
    except TypeError as exc:
        raise PipelineError(f"stage {stage}: batch_key must take one decoded item, as batch_key(self, x): "
                            f"{exc}") from None
    except ValueError:  # no signature to read (some builtins): it is called as it is
        return


def _check_int(stage: str, knob: str, value: Any, minimum: int) -> None:
    try:
        ok = not isinstance(value, bool) and operator.index(value) >= minimum
    except TypeError:
        ok = False
    if not ok:
        raise PipelineError(f"stage {stage}: {knob} must be an integer >= {minimum}, got {value!r}")


def _check_number(stage: str, knob: str, value: Any, allow_zero: bool) -> None:
    ok = (not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
          and (value >= 0 if allow_zero else value > 0))
    if not ok:
        bound = ">= 0" if allow_zero else "> 0"
        raise PipelineError(f"stage {stage}: {knob} must be a finite number {bound}, got {value!r}")


def _worker_range(stage: str, value: Sequence[Any]) -> tuple[Any, Any]:
    """``workers=(min, max)``: its two bounds (checked with the other settings)."""
    if len(value) != 2:
        raise PipelineError(f"stage {stage}: workers must be a number or a range (min, max), got {value!r}")
    low, high = value
    _check_int(stage, "workers' minimum", low, 1)
    _check_int(stage, "workers' maximum", high, low)
    return low, high


def _cpus(stage: str, value: Any) -> tuple[Any, ...]:
    """A list of core numbers as a tuple; a string or a non-iterable is a configuration error."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise PipelineError(f"stage {stage}: cpus must be a list of core numbers, got {value!r}")
    cpus = tuple(value)
    for cpu in cpus:
        _check_int(stage, "cpus entries", cpu, 0)
    return tuple(operator.index(c) for c in cpus)


def _check_io(inputs: tuple[TensorSpec, ...], outputs: tuple[TensorSpec, ...],
              batched: bool) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...], bool]:
    """The tensors declared for the Open Inference Protocol, checked: all or nothing, unique names, a
    batch dimension first when ``batched``."""
    inputs = tuple(TensorSpec(t.name, t.datatype, tuple(t.shape)) if isinstance(t, TensorSpec) else t for t in inputs)
    outputs = tuple(TensorSpec(t.name, t.datatype, tuple(t.shape)) if isinstance(t, TensorSpec) else t for t in outputs)
    if bool(inputs) != bool(outputs):
        raise PipelineError("declare both inputs and outputs, or neither (undeclared: one tensor each way)")
    for side in (inputs, outputs):
        if not all(isinstance(t, TensorSpec) for t in side):
            raise PipelineError("inputs and outputs are workers.Tensor(name, datatype, shape) values")
        for tensor in side:
            try:
                tensor.check()
            except ValueError as exc:
                raise PipelineError(str(exc)) from None
            if batched and (not tensor.shape or tensor.shape[0] != -1):
                raise PipelineError(f"tensor {tensor.name!r}: with batched=True its first dimension is the batch: "
                                    f"-1, got shape {list(tensor.shape)}")
        if len({t.name for t in side}) != len(side):
            raise PipelineError("two tensors on one side share a name")
    if not isinstance(batched, bool):
        raise PipelineError(f"batched must be True or False, got {batched!r}")
    return inputs, outputs, batched


def _check_levels(levels: Any, fair_after: Any) -> None:
    for name, value, top in (("priority_levels", levels, MAX_LEVELS), ("fair_after", fair_after, 1 << 20)):
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= top:
            raise PipelineError(f"{name} must be an integer from 1 to {top}, got {value!r}")


def _set_on(cls: type, knob: str) -> bool:
    """Whether the stage class sets ``knob`` (``Stage``'s own None means "the default"; a subclass
    may set ``stuck_grace_s = None``, which turns stuck detection off, or ``handoff_after_s = None``)."""
    if knob in ("stuck_grace_s", "handoff_after_s"):
        return any(knob in vars(klass) for klass in cls.__mro__ if klass is not Stage)
    return getattr(cls, knob, None) is not None


class Pipeline:
    """An ordered list of stages; ``add`` returns the pipeline so calls chain."""

    def __init__(self, name: str, *, prefix: str = DEFAULT_PREFIX, partitions: int = 1,
                 inputs: Sequence[TensorSpec] = (), outputs: Sequence[TensorSpec] = (), batched: bool = False,
                 task: str = "", priority_levels: int = 1, fair_after: int = 8) -> None:
        """``partitions``: how many hash slots the pipeline spreads over on a Redis Cluster (each
        partition a full copy of the key layout; see :mod:`broker.keys`). Pipeline-wide, not per
        stage, because a stage forwards into the next stage's stream in the same atomic script.

        ``inputs``, ``outputs``, ``batched``: how the Open Inference Protocol serves the pipeline
        (``POST /v2/models/NAME/infer``; docs/inference-protocol.md): its tensors' names, datatypes
        and shapes, and whether their first dimension is a batch of independent items (a request of
        shape ``[N, ...]`` becomes N items, gathered into one answer of shape ``[N, ...]``).

        ``task``: what the pipeline declares itself, for the protocols that need one: "embeddings"
        (the OpenAI-compatible ``POST /v1/embeddings``; its tensors' contract in
        :func:`broker.spec.task_error`).

        ``priority_levels``: Triton's meaning, 1 the highest level and N the lowest, the default
        (priority 0); every stage serves higher levels first (docs/operations.md, Priorities). ``fair_after``:
        after this many batches in a row from levels above the lowest, a worker takes its next one from
        the lowest level that has entries, so that the default level is not starved."""
        _check_levels(priority_levels, fair_after)
        problem = partitions_problem(partitions)
        if problem is not None:  # before any key is made: there would be one set per partition
            raise PipelineError(f"pipeline {name}: partitions {problem}")
        self.priority_levels, self.fair_after = priority_levels, fair_after
        self.inputs, self.outputs, self.batched = _check_io(tuple(inputs), tuple(outputs), batched)
        error = task_error(PipelineIO(self.inputs, self.outputs, self.batched, task))
        if error is not None:
            raise PipelineError(error)
        self.task = task
        self.keys = _keys(name, prefix)
        self.name = name
        self.prefix = prefix
        self.stages: list[StageSpec] = []
        self.partition_keys = self.keys.partitions(partitions)
        self.partitions = partitions

    def use_prefix(self, prefix: str) -> None:
        """Move the pipeline's keys under another prefix (tenants sharing one Redis)."""
        self.keys = _keys(self.name, prefix)
        self.prefix = prefix
        self.partition_keys = self.keys.partitions(self.partitions)

    def add(self, cls: type, **options: Any) -> Pipeline:
        """Append a stage. Its settings (``STAGE_KNOBS``) override the class attributes; the other
        options go to ``cls(...)`` and must be arguments it takes (:mod:`workers.options`)."""
        cls = check_stage_class(cls)
        check_options(cls, options)
        knobs = {k: options.pop(k) for k in list(options) if k in STAGE_KNOBS}
        resolved = {knob: getattr(cls, knob) for knob in STAGE_KNOBS if _set_on(cls, knob)} | knobs
        resolved.setdefault("name", cls.__name__)
        if resolved.get("cpus") is not None:
            resolved["cpus"] = _cpus(str(resolved["name"]), resolved["cpus"])
        if isinstance(resolved.get("workers"), (tuple, list)):
            resolved["workers"], resolved["max_workers"] = _worker_range(str(resolved["name"]), resolved["workers"])
        spec = StageSpec(cls=cls, index=len(self.stages), kwargs=dict(options), **resolved)
        spec.validate()
        _check_grouping(spec.name, cls, options)
        if any(s.name == spec.name for s in self.stages):
            raise PipelineError(f"pipeline {self.name}: two stages are named {spec.name!r}")
        streaming = next((s for s in self.stages if s.streams), None)
        if streaming is not None:
            raise PipelineError(f"pipeline {self.name}: stage {streaming.name} streams (its predict yields), so it "
                                f"must be the last stage; {spec.name} cannot follow it (only the last stage streams "
                                "to the caller: make the earlier stage return its whole answer)")
        self._warn(spec)
        self.stages.append(spec)
        return self

    def _warn(self, spec: StageSpec) -> None:
        """Settings that are valid but likely not what was meant, said with what they do."""
        if spec.batched and spec.batch_wait_s > LONG_BATCH_WAIT_S:
            policy = ("the deadline policy waits that long whenever fewer than batch_size items are queued"
                      if spec.batch_policy == "deadline" else "the adaptive policy waits less when waiting cannot pay")
            log.warning("pipeline %s, stage %s: batch_wait_s=%g: each item may wait up to %g s for its batch (%s); "
                        "batch_wait_s is in seconds (50 ms is 0.05)", self.name, spec.name, spec.batch_wait_s,
                        spec.batch_wait_s, policy)
        if spec.index > 0 and spec.max_backlog is not None:
            first = self.stages[0].name
            log.warning("pipeline %s, stage %s: max_backlog=%d is not enforced: only the first stage's max_backlog "
                        "bounds a pipeline (new requests are refused while its stream holds that many) and a later "
                        "stage's backlog is not bounded; set max_backlog on stage %s", self.name, spec.name,
                        spec.max_backlog, first)

    def stage(self, name: str) -> StageSpec:
        for spec in self.stages:
            if spec.name == name:
                return spec
        known = ", ".join(s.name for s in self.stages) or "none"
        raise PipelineError(f"pipeline {self.name} has no stage {name!r} (stages: {known})")

    def next_of(self, spec: StageSpec) -> StageSpec | None:
        i = spec.index + 1
        return self.stages[i] if i < len(self.stages) else None

    def describe(self, max_payload_bytes: int | None = None) -> list[StageInfo]:
        """What workers publish under the spec key, so gateways and `status` know the stages
        (``max_payload_bytes``: the workers' limit, which gateways apply before Redis)."""
        last = len(self.stages) - 1
        return [StageInfo(s.index, s.name, s.batch_size, s.batch_wait_s, s.max_backlog, self.partitions,
                          max_payload_bytes, self.inputs if s.index == 0 else (),
                          self.outputs if s.index == last else (), self.batched and s.index == 0,
                          self.task if s.index == 0 else "", batch_entries=True,
                          priority_levels=self.priority_levels, streams=s.streams)
                for s in self.stages]

    def __repr__(self) -> str:
        return f"Pipeline({self.name!r}, stages={[s.name for s in self.stages]})"

