"""The CPUs a process may use (``celery_driftsafe.claim.usable_cpus``): its affinity, cut by its
control
group's CPU quota, read from a cgroup tree laid out as the kernel does (v2 and v1), here in a
temporary directory."""

from __future__ import annotations

import os
from pathlib import Path

from celery_driftsafe.claim.helper_process import spare_cores
from celery_driftsafe.claim.usable_cpus import cgroup_cpu_quota, usable_cores


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_the_smallest_quota_on_the_way_to_the_group_applies(tmp_path: Path) -> None:
    own = tmp_path / "self-cgroup"
    _write(own, "0::/kubepods/pod1/beat\n")
    root = tmp_path / "cgroup"
    _write(root / "cpu.max", "max 100000\n")
    _write(root / "kubepods" / "cpu.max", "400000 100000\n")
    _write(root / "kubepods" / "pod1" / "cpu.max", "150000 100000\n")
    _write(root / "kubepods" / "pod1" / "beat" / "cpu.max", "max 100000\n")
    assert cgroup_cpu_quota(str(root), str(own)) == 1.5
    assert usable_cores(str(root), str(own)) == min(1.5, len(os.sched_getaffinity(0)))


def test_a_container_sees_its_own_limit_at_its_root(tmp_path: Path) -> None:
    """Inside a container the group's path names the host's tree, which is not there: the
    limit at the root the container sees is the one that applies."""
    own = tmp_path / "self-cgroup"
    _write(own, "0::/system.slice/docker-abc.scope\n")
    root = tmp_path / "cgroup"
    _write(root / "cpu.max", "100000 100000\n")
    assert cgroup_cpu_quota(str(root), str(own)) == 1.0
    assert spare_cores(1, usable_cores(str(root), str(own))) == (
        "1 beat(s) and their helpers would outnumber the 1 cores this beat may use"
    )


def test_cgroup_v1_quota_and_unlimited_groups(tmp_path: Path) -> None:
    own = tmp_path / "self-cgroup"
    _write(own, "11:memory:/beat\n4:cpu,cpuacct:/beat\n0::/\n")
    root = tmp_path / "cgroup"
    _write(root / "cpu,cpuacct" / "cpu.cfs_quota_us", "-1\n")
    _write(root / "cpu,cpuacct" / "cpu.cfs_period_us", "100000\n")
    _write(root / "cpu,cpuacct" / "beat" / "cpu.cfs_quota_us", "250000\n")
    _write(root / "cpu,cpuacct" / "beat" / "cpu.cfs_period_us", "100000\n")
    assert cgroup_cpu_quota(str(root), str(own)) == 2.5
    _write(root / "cpu,cpuacct" / "beat" / "cpu.cfs_quota_us", "-1\n")
    assert cgroup_cpu_quota(str(root), str(own)) is None


def test_no_quota_or_nothing_readable_leaves_the_affinity(tmp_path: Path) -> None:
    affinity = len(os.sched_getaffinity(0))
    assert cgroup_cpu_quota(str(tmp_path), str(tmp_path / "missing")) is None
    assert usable_cores(str(tmp_path), str(tmp_path / "missing")) == affinity
    own = tmp_path / "self-cgroup"
    _write(own, "0::/\n")
    _write(tmp_path / "cpu.max", "garbage\n")
    assert cgroup_cpu_quota(str(tmp_path), str(own)) is None
    _write(tmp_path / "cpu.max", "max 100000\n")
    assert usable_cores(str(tmp_path), str(own)) == affinity
