"""How many CPUs this process may really use: its affinity, capped by a cgroup CPU quota (containers)."""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

import torch

from utils.cgroups import cgroup_dirs, read_int

LOGGER = logging.getLogger(__name__)

PROC = Path("/proc")
SYS_FS = Path("/sys/fs")


def usable_cpus(proc: Path | None = None, sys_fs: Path | None = None) -> int:
    """Return the CPUs this process may run on (affinity: taskset, SLURM), capped by its cgroup CPU quota.

    A container started with a CPU limit (`docker --cpus 4`, a Kubernetes limit) still sees every
    core of the host in its affinity mask; the limit is a quota of CPU time, and work spread over
    more processes than the quota allows is throttled rather than sped up. A fractional quota
    counts as the next whole CPU. At least 1. `proc` and `sys_fs` default to PROC and SYS_FS.
    """
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = cgroup_cpu_quota(proc, sys_fs)
    return max(1, min(cpus, math.ceil(quota))) if quota is not None else max(1, cpus)


def cgroup_cpu_quota(proc: Path | None = None, sys_fs: Path | None = None) -> float | None:
    """Return the CPUs' worth of time this process's cgroups may use (quota / period), None when unlimited.

    cgroup v2 `cpu.max` ("max 100000" or "400000 100000") and v1 `cpu.cfs_quota_us` (-1 when
    unlimited) over `cpu.cfs_period_us`; the tightest of the process's cgroup and its ancestors
    counts (`utils.cgroups.cgroup_dirs`). Unreadable or malformed files count as no limit: this
    only ever lowers a CPU count. `proc` and `sys_fs` default to PROC and SYS_FS, read when called
    (tests point them elsewhere).
    """
    quotas = []
    for folder, version in cgroup_dirs("cpu", proc or PROC, sys_fs or SYS_FS):
        if version == "v2":
            quota, period = _cpu_max(folder / "cpu.max")
        else:
            quota, period = read_int(folder / "cpu.cfs_quota_us"), read_int(folder / "cpu.cfs_period_us")
        if quota and period:
            quotas.append(quota / period)
    return min(quotas) if quotas else None


def _cpu_max(path: Path) -> tuple[int | None, int | None]:
    """(quota, period) in microseconds from a cgroup v2 `cpu.max`; quota None for "max", both None when unreadable."""
    try:
        quota, period = path.read_text().split()[:2]
        return (None if quota == "max" else int(quota)), int(period)
    except (OSError, ValueError):
        return None, None


def cap_torch_threads(cpus: int) -> None:
    """Lower torch's intra-op threads to `cpus` when it would use more, unless OMP_NUM_THREADS sets them.

    torch sizes its pool from the host's cores, not from a container's CPU quota; more threads
    than the quota only add throttling. torchrun sets OMP_NUM_THREADS=1 for several processes per
    node, and a user's own setting always wins.
    """
    if "OMP_NUM_THREADS" in os.environ or torch.get_num_threads() <= cpus:
        return
    LOGGER.info(f"torch threads {torch.get_num_threads()} -> {cpus}: this rank's share of the CPUs it may use")
    torch.set_num_threads(cpus)
