"""A container's CPU limit caps the cores the autoscaler counts (pure logic over fake cgroup trees)."""

from __future__ import annotations

from pathlib import Path

import pytest

from workers.process.cgroups import cpu_limit_cores, usable_cores

pytestmark = pytest.mark.unit


def _tree(tmp_path: Path, proc: str, files: dict[str, str]) -> tuple[Path, Path]:
    root = tmp_path / "cgroup"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    (tmp_path / "proc").write_text(proc)
    return root, tmp_path / "proc"


def test_a_v2_quota_of_two_cpus_on_a_64_core_node_allows_two_workers(tmp_path: Path) -> None:
    """A pod limited to 2 CPUs (no exclusive cpuset) saw its node's 64 cores: up to 64 workers, each
    loading its model, throttled to 2 cores' time."""
    root, proc = _tree(tmp_path, "0::/kubepods/pod1/c1\n", {"kubepods/pod1/c1/cpu.max": "200000 100000\n"})
    assert cpu_limit_cores(root, proc) == 2.0 and usable_cores(64, root, proc) == 2


def test_the_smallest_limit_of_the_cgroup_and_its_parents_wins_rounded_up(tmp_path: Path) -> None:
    root, proc = _tree(tmp_path, "0::/a/b\n", {"a/cpu.max": "150000 100000", "a/b/cpu.max": "max 100000"})
    assert cpu_limit_cores(root, proc) == 1.5 and usable_cores(8, root, proc) == 2


def test_no_limit_leaves_the_affinity(tmp_path: Path) -> None:
    root, proc = _tree(tmp_path, "0::/\n", {"cpu.max": "max 100000"})
    assert cpu_limit_cores(root, proc) is None and usable_cores(8, root, proc) == 8
    assert usable_cores(8, tmp_path / "none", tmp_path / "missing") == 8  # no cgroup file system


def test_a_v1_quota_counts_and_minus_one_means_none(tmp_path: Path) -> None:
    v1 = "cpu,cpuacct/docker"
    root, proc = _tree(tmp_path, "4:cpu,cpuacct:/docker/abc\n3:memory:/docker/abc\n",
                       {f"{v1}/abc/cpu.cfs_quota_us": "300000", f"{v1}/abc/cpu.cfs_period_us": "100000",
                        f"{v1}/cpu.cfs_quota_us": "-1", f"{v1}/cpu.cfs_period_us": "100000"})
    assert cpu_limit_cores(root, proc) == 3.0 and usable_cores(16, root, proc) == 3
    assert usable_cores(2, root, proc) == 2
