"""CPU pinning and thread limits, applied in the worker process before ``setup()``."""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence

import psutil

THREAD_ENV_VARS = (
    "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS",
)


class PinningError(ValueError):
    """A stage asks for a core this machine (or container) does not give us."""


def allowed_cpus() -> list[int]:
    """The cores this process may run on (a container's cpuset, taskset, ...)."""
    return sorted(psutil.Process().cpu_affinity() or [])


def assign_cpus(slot: int, explicit: Sequence[int] | None, allowed: Sequence[int], offset: int = 0) -> int:
    """The core of worker ``slot``: its entry in ``explicit`` (cycled), else a spread over ``allowed``.

    ``offset`` lets ``conveyor run`` spread the workers of all stages instead of piling each
    stage's first worker on core 0.
    """
    if explicit:
        cpu = int(explicit[slot % len(explicit)])
        if allowed and cpu not in allowed:
            raise PinningError(f"cpu {cpu} is not among the cores this process may use: {list(allowed)}")
        return cpu
    if not allowed:
        raise ValueError("no CPU is allowed for this process")
    return int(allowed[(offset + slot) % len(allowed)])


def pin(cpu: int) -> None:
    psutil.Process().cpu_affinity([cpu])


def thread_env(threads: int | None) -> dict[str, str]:
    """Environment for a worker process: thread pools size themselves at import, so these
    must be set before the child imports numpy or torch."""
    if threads is None:
        return {}
    return {name: str(threads) for name in THREAD_ENV_VARS}


def limit_torch_threads(threads: int | None) -> None:
    """torch ignores OMP_NUM_THREADS for its intra-op pool once imported elsewhere: set it too."""
    if threads is None or importlib.util.find_spec("torch") is None:
        return
    import torch

    torch.set_num_threads(threads)

