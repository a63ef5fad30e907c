"""A pipeline is plain data: an ordered list of stage specs under a name.

It lives in ``broker`` because both sides need it: workers to know their stream and the
next one, the CLI to find a stage by name. It holds stage *classes* without importing
``workers``, so the gateway can use the key schema without ever importing user code.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from broker.keys import DEFAULT_PREFIX, Keys
from broker.spec import StageInfo

BATCH_POLICIES = ("adaptive", "deadline")  # see workers/batching/collector.py

# Knobs a Stage class may set as class attributes and `Pipeline.add` may override.
STAGE_KNOBS = (
    "name", "workers", "cpus", "threads", "batch_size", "batch_wait_s", "batch_policy",
    "max_run_s", "max_backlog", "max_deliveries", "claim_idle_s", "share_bursts",
)


class PipelineError(ValueError):
    """A pipeline or stage is configured in a way conveyor cannot run."""


@dataclass(frozen=True)
class StageSpec:
    """Everything a worker process needs to run one stage, resolved from class and `add`."""

    cls: type
    index: int
    name: str
    workers: int = 1
    cpus: tuple[int, ...] | None = None
    threads: int | None = None
    batch_size: int = 1
    batch_wait_s: float = 0.0
    batch_policy: str = "adaptive"
    max_run_s: float | None = None
    max_backlog: int | None = None
    max_deliveries: int = 5
    claim_idle_s: float = 30.0
    share_bursts: bool = True
    kwargs: Mapping[str, Any] = field(default_factory=dict)

    @property
    def batched(self) -> bool:
        return self.batch_size > 1

    def validate(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise PipelineError(f"stage names must be non-empty strings, got {self.name!r}")
        _check_int(self.name, "workers", self.workers, 1)
        _check_int(self.name, "batch_size", self.batch_size, 1)
        _check_number(self.name, "batch_wait_s", self.batch_wait_s, allow_zero=True)
        if self.batch_policy not in BATCH_POLICIES:
            raise PipelineError(f"stage {self.name}: batch_policy must be one of "
                                f"{', '.join(map(repr, BATCH_POLICIES))}, got {self.batch_policy!r}")
        if self.threads is not None:
            _check_int(self.name, "threads", self.threads, 1)
        if self.cpus is not None:
            if len(self.cpus) == 0:
                raise PipelineError(f"stage {self.name}: cpus must not be empty (omit it for the default spread)")
            for cpu in self.cpus:
                _check_int(self.name, "cpus entries", cpu, 0)
        _check_int(self.name, "max_deliveries", self.max_deliveries, 1)
        _check_number(self.name, "claim_idle_s", self.claim_idle_s, allow_zero=False)
        if self.max_run_s is not None:
            _check_number(self.name, "max_run_s", self.max_run_s, allow_zero=True)
        if self.max_backlog is not None:
            _check_int(self.name, "max_backlog", self.max_backlog, 0)
        if not isinstance(self.share_bursts, bool):
            raise PipelineError(f"stage {self.name}: share_bursts must be True or False, got {self.share_bursts!r}")


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


def _cpus(stage: str, value: Any) -> tuple[Any, ...]:
    """A list of core numbers as a tuple; a string or a non-iterable is a configuration error."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise PipelineError(f"stage {stage}: cpus must be a list of core numbers, got {value!r}")
    cpus = tuple(value)
    for cpu in cpus:
        _check_int(stage, "cpus entries", cpu, 0)
    return tuple(operator.index(c) for c in cpus)


class Pipeline:
    """An ordered list of stages; ``add`` returns the pipeline so calls chain."""

    def __init__(self, name: str, *, prefix: str = DEFAULT_PREFIX, partitions: int = 1) -> None:
        """``partitions``: how many hash slots the pipeline spreads over on a Redis Cluster (each
        partition a full copy of the key layout; see :mod:`broker.keys`). Pipeline-wide, not per
        stage, because a stage forwards into the next stage's stream in the same atomic script."""
        self.keys = Keys(name, prefix)  # validates the name
        self.name = name
        self.prefix = prefix
        self.stages: list[StageSpec] = []
        self.partition_keys = self.keys.partitions(partitions)  # validates the count
        self.partitions = partitions

    def use_prefix(self, prefix: str) -> None:
        """Move the pipeline's keys under another prefix (tenants sharing one Redis)."""
        self.keys = Keys(self.name, prefix)
        self.prefix = prefix
        self.partition_keys = self.keys.partitions(self.partitions)

    def add(self, cls: type, **options: Any) -> Pipeline:
        """Append a stage. Known knobs override the class attributes; the rest go to ``cls(...)``."""
        knobs = {k: options.pop(k) for k in list(options) if k in STAGE_KNOBS}
        resolved: dict[str, Any] = {}
        for knob in STAGE_KNOBS:
            if knob in knobs:
                resolved[knob] = knobs[knob]
            elif getattr(cls, knob, None) is not None:
                resolved[knob] = getattr(cls, knob)
        resolved.setdefault("name", cls.__name__)
        if resolved.get("cpus") is not None:
            resolved["cpus"] = _cpus(str(resolved["name"]), resolved["cpus"])
        spec = StageSpec(cls=cls, index=len(self.stages), kwargs=dict(options), **resolved)
        spec.validate()
        if any(s.name == spec.name for s in self.stages):
            raise PipelineError(f"pipeline {self.name}: two stages are named {spec.name!r}")
        self.stages.append(spec)
        return self

    def stage(self, name: str) -> StageSpec:
        for spec in self.stages:
            if spec.name == name:
                return spec
        known = ", ".join(s.name for s in self.stages) or "none"
        raise PipelineError(f"pipeline {self.name} has no stage {name!r} (stages: {known})")

    def next_of(self, spec: StageSpec) -> StageSpec | None:
        i = spec.index + 1
        return self.stages[i] if i < len(self.stages) else None

    def describe(self) -> list[StageInfo]:
        """What workers publish under the spec key, so gateways and `status` know the stages."""
        return [StageInfo(s.index, s.name, s.batch_size, s.batch_wait_s, s.max_backlog, self.partitions)
                for s in self.stages]

    def __repr__(self) -> str:
        return f"Pipeline({self.name!r}, stages={[s.name for s in self.stages]})"

