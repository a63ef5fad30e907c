"""A pipeline is plain data: an ordered list of stage specs under a name.

It lives in ``broker`` because both sides need it: workers to know their stream and the
next one, the CLI to find a stage by name. It holds stage *classes* without importing
``workers``, so the gateway can use the key schema without ever importing user code.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from broker.keys import DEFAULT_PREFIX, Keys

# Knobs a Stage class may set as class attributes and `Pipeline.add` may override.
STAGE_KNOBS = (
    "name", "workers", "cpus", "threads", "batch_size", "batch_wait_s",
    "max_run_s", "max_backlog", "max_deliveries", "claim_idle_s",
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
    max_run_s: float | None = None
    max_backlog: int | None = None
    max_deliveries: int = 5
    claim_idle_s: float = 30.0
    kwargs: Mapping[str, Any] = field(default_factory=dict)

    @property
    def batched(self) -> bool:
        return self.batch_size > 1

    def validate(self) -> None:
        if self.workers < 1:
            raise PipelineError(f"stage {self.name}: workers must be >= 1, got {self.workers}")
        if self.batch_size < 1:
            raise PipelineError(f"stage {self.name}: batch_size must be >= 1, got {self.batch_size}")
        if not (self.batch_wait_s >= 0 and math.isfinite(self.batch_wait_s)):
            raise PipelineError(f"stage {self.name}: batch_wait_s must be a finite number >= 0")
        if self.threads is not None and self.threads < 1:
            raise PipelineError(f"stage {self.name}: threads must be >= 1")
        if self.cpus is not None and len(self.cpus) == 0:
            raise PipelineError(f"stage {self.name}: cpus must not be empty (omit it for the default spread)")
        if self.max_deliveries < 1:
            raise PipelineError(f"stage {self.name}: max_deliveries must be >= 1")
        if self.claim_idle_s <= 0:
            raise PipelineError(f"stage {self.name}: claim_idle_s must be > 0")


class Pipeline:
    """An ordered list of stages; ``add`` returns the pipeline so calls chain."""

    def __init__(self, name: str, *, prefix: str = DEFAULT_PREFIX) -> None:
        self.keys = Keys(name, prefix)  # validates the name
        self.name = name
        self.prefix = prefix
        self.stages: list[StageSpec] = []

    def use_prefix(self, prefix: str) -> None:
        """Move the pipeline's keys under another prefix (tenants sharing one Redis)."""
        self.keys = Keys(self.name, prefix)
        self.prefix = prefix

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
            resolved["cpus"] = tuple(int(c) for c in resolved["cpus"])
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

    def describe(self) -> list[dict[str, Any]]:
        """What workers publish under the spec key, so gateways and `status` know the stages."""
        return [
            {"index": s.index, "name": s.name, "batch_size": s.batch_size,
             "batch_wait_s": s.batch_wait_s, "max_backlog": s.max_backlog}
            for s in self.stages
        ]

    def __repr__(self) -> str:
        return f"Pipeline({self.name!r}, stages={[s.name for s in self.stages]})"


def names(stages: Sequence[StageSpec]) -> list[str]:
    return [s.name for s in stages]
