"""How many CPUs this process may use: its CPU affinity, and the CPU quota of its control
group, which the affinity does not show (a container given one CPU on a 64-core host sees 64
in its affinity). Read by a beat deciding whether its machine can spare a core for a claim
process (:func:`celery_driftsafe.claim.helper_process.spare_cores`)."""

from __future__ import annotations

import os


def usable_cores(cgroup_root: str = "/sys/fs/cgroup", own: str = "/proc/self/cgroup") -> float:
    """The CPUs this process may use: those of its CPU affinity, fewer when its control group
    (a container's, say) has a CPU quota, which the affinity does not show."""
    try:
        cores: float = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    quota = cgroup_cpu_quota(cgroup_root, own)
    return min(cores, quota) if quota is not None else cores


def cgroup_cpu_quota(cgroup_root: str, own: str) -> float | None:
    """The smallest CPU quota (quota over period, in CPUs) on the way from the root to this
    process's control group (cgroup v2's ``cpu.max``, v1's ``cpu.cfs_quota_us``), None when
    there is none or it cannot be read. In a container the group's path is often not under
    the root it sees; the root's own limit is then what applies, and is read."""
    try:
        with open(own) as lines:
            groups = [line.strip().split(":", 2) for line in lines if line.count(":") >= 2]
    except OSError:
        return None
    limits: list[float] = []
    for hierarchy, controllers, path in groups:
        if hierarchy == "0" and not controllers:  # v2: one tree
            base, reader = cgroup_root, _v2_limit
        elif "cpu" in controllers.split(","):
            base, reader = os.path.join(cgroup_root, controllers), _v1_limit
        else:
            continue
        parts = [part for part in path.split("/") if part]
        for depth in range(len(parts) + 1):
            limit = reader(os.path.join(base, *parts[:depth]))
            if limit is not None:
                limits.append(limit)
    return min(limits) if limits else None


def _v2_limit(group: str) -> float | None:
    try:
        with open(os.path.join(group, "cpu.max")) as limit:
            quota, period = limit.read().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        return None


def _v1_limit(group: str) -> float | None:
    try:
        with open(os.path.join(group, "cpu.cfs_quota_us")) as quota_file:
            quota = int(quota_file.read())
        with open(os.path.join(group, "cpu.cfs_period_us")) as period_file:
            period = int(period_file.read())
        return None if quota <= 0 or period <= 0 else quota / period
    except (OSError, ValueError):
        return None
