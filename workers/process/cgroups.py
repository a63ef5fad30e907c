"""How many cores' worth of CPU time this process may use: a container's CPU limit.

Why: the autoscaler never runs more workers than the cores it may claim, and counted them from the
CPU affinity alone. A Kubernetes pod with a CPU limit (and no exclusive cpuset, the default) sees every
core of its node: on a 64-core node, a pod limited to 2 CPUs could start 64 workers, each loading its
model, all throttled to 2 cores' time. The limit is the cgroup's quota (v2 ``cpu.max``, v1
``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``) of this process's cgroup and of each parent, the
smallest one; rounded up (1.5 CPUs: 2 workers).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

__all__ = ["cpu_limit_cores", "usable_cores"]

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")
_V1_DIRS = ("cpu", "cpu,cpuacct", "cpuacct,cpu")


def usable_cores(affinity: int, root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> int:
    """``affinity`` (the cores this process may run on), or fewer where a CPU limit says so (at least 1)."""
    limit = cpu_limit_cores(root, proc_cgroup)
    return affinity if limit is None else max(1, min(affinity, math.ceil(limit)))


def cpu_limit_cores(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> float | None:
    """The smallest CPU quota over this process's cgroup and its parents, in cores; None if none is set
    or none can be read (not Linux, no cgroup file system)."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    limits: list[float] = []
    for line in lines:
        hierarchy, controllers, path = [*line.split(":", 2), "", ""][:3]
        if hierarchy == "0" and not controllers:  # cgroup v2's one hierarchy
            limits += _walk(root, path, _v2_limit)
        elif "cpu" in controllers.split(","):
            for name in _V1_DIRS:
                if (root / name).is_dir():
                    limits += _walk(root / name, path, _v1_limit)
                    break
    return min(limits) if limits else None


def _walk(base: Path, path: str, read: Callable[[Path], float | None]) -> list[float]:
    """The limits read in ``base/path`` and each parent up to ``base`` (a container's cgroup namespace
    shows its own cgroup as the root)."""
    found = []
    directory = base / path.strip("/")
    while True:
        limit = read(directory)
        if limit is not None:
            found.append(limit)
        if directory == base or base not in directory.parents:
            return found
        directory = directory.parent


def _v2_limit(directory: Path) -> float | None:
    try:
        quota, period = (directory / "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return None
    return None if quota == "max" or float(period) <= 0 else float(quota) / float(period)


def _v1_limit(directory: Path) -> float | None:
    try:
        quota = float((directory / "cpu.cfs_quota_us").read_text())
        period = float((directory / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota <= 0 or period <= 0 else quota / period
