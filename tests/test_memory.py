"""Memory headroom: least of MemAvailable, cgroup v1/v2 limit and RLIMIT_AS, from fake /proc and /sys trees."""

from __future__ import annotations

import resource
from pathlib import Path

import pytest

from utils import memory
from utils.memory import cgroup_headroom, memory_headroom, rlimit_as_headroom

GB = 1 << 30


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.fixture
def proc(tmp_path: Path) -> Path:
    root = tmp_path / "proc"
    write(root / "meminfo", f"MemTotal: {64 * GB // 1024} kB\nMemAvailable: {40 * GB // 1024} kB\n")
    write(root / "self" / "status", f"Name: python\nVmSize: {2 * GB // 1024} kB\n")
    return root


def test_cgroup_v2_limit_minus_usage_without_reclaimable_cache(proc: Path, tmp_path: Path) -> None:
    sys_fs = tmp_path / "sys"
    write(proc / "self" / "cgroup", "0::/job/step\n")
    write(sys_fs / "cgroup" / "cgroup.controllers", "cpu memory\n")
    write(sys_fs / "cgroup" / "job" / "step" / "memory.max", "max\n")
    write(sys_fs / "cgroup" / "job" / "memory.max", f"{8 * GB}\n")  # the job's limit sits on the parent
    write(sys_fs / "cgroup" / "job" / "memory.current", f"{3 * GB}\n")
    write(sys_fs / "cgroup" / "job" / "memory.stat", f"anon {2 * GB}\ninactive_file {1 * GB}\n")
    assert cgroup_headroom(proc, sys_fs) == 6 * GB
    headroom = memory_headroom(proc, sys_fs)
    assert headroom.meminfo == 40 * GB and headroom.available == 6 * GB and headroom.limited_by == "cgroup"


def test_cgroup_v1_unlimited_is_ignored_and_a_namespaced_path_falls_back_to_the_mount(
    proc: Path, tmp_path: Path
) -> None:
    sys_fs = tmp_path / "sys"
    write(proc / "self" / "cgroup", "4:memory:/not/visible/here\n1:cpu:/\n")
    mount = sys_fs / "cgroup" / "memory"
    write(mount / "memory.limit_in_bytes", "9223372036854771712\n")
    assert cgroup_headroom(proc, sys_fs) is None
    write(mount / "memory.limit_in_bytes", f"{16 * GB}\n")
    write(mount / "memory.usage_in_bytes", f"{10 * GB}\n")
    write(mount / "memory.stat", f"total_inactive_file {4 * GB}\n")
    assert cgroup_headroom(proc, sys_fs) == 10 * GB


def test_rlimit_as_counts_the_address_space_already_used(proc: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory.resource, "getrlimit", lambda _: (12 * GB, resource.RLIM_INFINITY))
    assert rlimit_as_headroom(proc) == 10 * GB
    headroom = memory_headroom(proc, proc / "no-sys")
    assert (headroom.cgroup, headroom.available, headroom.limited_by) == (None, 10 * GB, "RLIMIT_AS")
    monkeypatch.setattr(memory.resource, "getrlimit", lambda _: (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    assert rlimit_as_headroom(proc) is None


def test_missing_sources_are_skipped(tmp_path: Path) -> None:
    headroom = memory_headroom(tmp_path / "no-proc", tmp_path / "no-sys")
    assert headroom.cgroup is None and headroom.meminfo > 0  # sysconf fallback
    assert headroom.available == min(v for v in (headroom.meminfo, headroom.rlimit_as) if v is not None)


def test_this_machine_reads_a_plausible_figure() -> None:
    headroom = memory_headroom()
    assert 0 < headroom.available <= headroom.meminfo
