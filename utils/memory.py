"""How much memory this process may still allocate: the least of MemAvailable, the cgroup limit and RLIMIT_AS.

A container or a SLURM job usually limits memory with a cgroup, which /proc/meminfo does not
show: a node with 500 GB free may run a job allowed 32 GB, and a cache sized from MemAvailable
then gets the job OOM-killed. Every source that can be read is read, and the smallest headroom
wins; a source that is missing or unreadable is skipped, never an error.
"""

from __future__ import annotations

import logging
import os
import resource
from dataclasses import dataclass
from pathlib import Path

from utils.cgroups import cgroup_dirs, read_int

LOGGER = logging.getLogger(__name__)


@dataclass(frozen=True)
class MemoryHeadroom:
    """Bytes still allocatable by each source (None where the source is absent or unlimited)."""

    meminfo: int | None
    cgroup: int | None
    rlimit_as: int | None

    @property
    def available(self) -> int:
        """The smallest headroom of the sources present (0 when none is readable)."""
        values = [value for value in (self.meminfo, self.cgroup, self.rlimit_as) if value is not None]
        return max(0, min(values)) if values else 0

    @property
    def limited_by(self) -> str:
        """Which source sets `available`: 'MemAvailable', 'cgroup' or 'RLIMIT_AS'."""
        named = {"MemAvailable": self.meminfo, "cgroup": self.cgroup, "RLIMIT_AS": self.rlimit_as}
        present = {name: value for name, value in named.items() if value is not None}
        return min(present, key=present.__getitem__) if present else "none"


def _stat_value(path: Path, key: str) -> int:
    """One `key value` line of a memory.stat file (0 when missing)."""
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def meminfo_available(proc: Path = Path("/proc")) -> int | None:
    """MemAvailable from /proc/meminfo in bytes (None when the file or the line is missing)."""
    try:
        for line in (proc / "meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def cgroup_headroom(proc: Path = Path("/proc"), sys_fs: Path = Path("/sys/fs")) -> int | None:
    """Bytes left under the tightest memory cgroup limit (limit minus usage, reclaimable page cache excluded).

    cgroup v2: memory.max / memory.current / memory.stat inactive_file; v1: memory.limit_in_bytes /
    memory.usage_in_bytes / memory.stat total_inactive_file. None when no limit is set anywhere.
    """
    headrooms: list[int] = []
    for folder, version in cgroup_dirs("memory", proc, sys_fs):
        if version == "v2":
            limit, usage = read_int(folder / "memory.max"), read_int(folder / "memory.current")
            reclaimable = _stat_value(folder / "memory.stat", "inactive_file")
        else:
            limit, usage = read_int(folder / "memory.limit_in_bytes"), read_int(folder / "memory.usage_in_bytes")
            reclaimable = _stat_value(folder / "memory.stat", "total_inactive_file")
        if limit is not None:
            headrooms.append(limit - max(0, (usage or 0) - reclaimable))
    return min(headrooms) if headrooms else None


def rlimit_as_headroom(proc: Path = Path("/proc")) -> int | None:
    """Address space left under RLIMIT_AS (soft limit minus this process's VmSize); None when unlimited."""
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    used = 0
    try:
        for line in (proc / "self" / "status").read_text().splitlines():
            if line.startswith("VmSize:"):
                used = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return soft - used


def memory_headroom(proc: Path = Path("/proc"), sys_fs: Path = Path("/sys/fs")) -> MemoryHeadroom:
    """Read every source; see MemoryHeadroom.available for the figure to size caches with."""
    meminfo = meminfo_available(proc)
    if meminfo is None:
        meminfo = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return MemoryHeadroom(meminfo, cgroup_headroom(proc, sys_fs), rlimit_as_headroom(proc))
