"""Tests for utils/cpus.py: the CPU count a container's cgroup quota allows, v1 and v2 layouts."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from utils.cpus import cap_torch_threads, cgroup_cpu_quota, usable_cpus
from utils.data.workers import resolve_num_workers
from utils.distributed import DistContext


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _v2(tmp_path: Path, limits: dict[str, str], own: str = "/kubepods/pod1/ctr") -> tuple[Path, Path]:
    """Fake /proc and /sys/fs: a cgroup v2 tree with `cpu.max` files at the given paths; returns (proc, sys_fs)."""
    proc, sys_fs = tmp_path / "proc", tmp_path / "sys"
    _write(sys_fs / "cgroup" / "cgroup.controllers", "cpu memory\n")
    (sys_fs / "cgroup" / own.strip("/")).mkdir(parents=True, exist_ok=True)
    for path, text in limits.items():
        _write(sys_fs / "cgroup" / path.strip("/") / "cpu.max", text)
    _write(proc / "self" / "cgroup", f"0::{own}\n")
    return proc, sys_fs


def test_v2_quota_is_the_tightest_of_the_cgroup_and_its_ancestors(tmp_path: Path) -> None:
    proc, sys_fs = _v2(tmp_path, {"/kubepods/pod1": "350000 100000\n", "/kubepods/pod1/ctr": "max 100000\n"})
    assert cgroup_cpu_quota(proc, sys_fs) == pytest.approx(3.5)
    limits = {"/": "max 100000", "/kubepods": "800000 100000", "/kubepods/pod1/ctr": "2 1"}
    assert cgroup_cpu_quota(*_v2(tmp_path / "b", limits)) == pytest.approx(2.0)


def test_v2_without_any_limit_or_readable_file_is_no_quota(tmp_path: Path) -> None:
    proc, sys_fs = _v2(tmp_path, {"/kubepods/pod1/ctr": "max 100000\n", "/kubepods": "garbage"})
    assert cgroup_cpu_quota(proc, sys_fs) is None
    assert cgroup_cpu_quota(tmp_path / "missing", sys_fs) is None


def test_v2_namespaced_mount_reads_the_mount_root(tmp_path: Path) -> None:
    # Inside a container with its own cgroup namespace the mount's root is the container's cgroup,
    # while /proc/self/cgroup may still name a host path that does not exist under the mount.
    proc, sys_fs = _v2(tmp_path, {"/": "150000 100000\n"}, own="/")
    (proc / "self" / "cgroup").write_text("0::/system.slice/docker-abc.scope\n")
    assert cgroup_cpu_quota(proc, sys_fs) == pytest.approx(1.5)


def test_v1_quota_from_the_cpu_hierarchy(tmp_path: Path) -> None:
    proc, sys_fs = tmp_path / "proc", tmp_path / "sys"
    mount = sys_fs / "cgroup" / "cpu,cpuacct"  # no "cpu" link: found by its co-mounted name
    _write(mount / "docker" / "abc" / "cpu.cfs_quota_us", "400000\n")
    _write(mount / "docker" / "abc" / "cpu.cfs_period_us", "100000\n")
    _write(mount / "cpu.cfs_quota_us", "-1\n")
    _write(mount / "cpu.cfs_period_us", "100000\n")
    _write(proc / "self" / "cgroup", "12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n0::/\n")
    assert cgroup_cpu_quota(proc, sys_fs) == pytest.approx(4.0)
    (mount / "docker" / "abc" / "cpu.cfs_quota_us").write_text("-1\n")
    assert cgroup_cpu_quota(proc, sys_fs) is None


def test_usable_cpus_is_the_affinity_capped_by_the_quota_rounded_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    assert usable_cpus(*_v2(tmp_path, {"/kubepods/pod1/ctr": "250000 100000"})) == 3  # 2.5 CPUs of time: three may run
    assert usable_cpus(*_v2(tmp_path / "b", {"/kubepods/pod1/ctr": "50000 100000"})) == 1
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    proc, sys_fs = _v2(tmp_path / "c", {"/kubepods/pod1/ctr": "800000 100000"})
    assert usable_cpus(proc, sys_fs) == 2  # a quota above the affinity changes nothing
    assert usable_cpus(tmp_path / "missing", sys_fs) == 2


def test_loader_workers_follow_the_quota_not_the_host_cores(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import utils.cpus

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    proc, sys_fs = _v2(tmp_path, {"/kubepods/pod1": "400000 100000"})
    monkeypatch.setattr(utils.cpus, "PROC", proc)
    monkeypatch.setattr(utils.cpus, "SYS_FS", sys_fs)
    assert resolve_num_workers(8, DistContext(), per_rank_batch=16) == 4
    assert resolve_num_workers(8, DistContext(local_world_size=2, world_size=2, rank=1), per_rank_batch=16) == 2


def test_cap_torch_threads_lowers_only_and_leaves_omp_num_threads_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    before = torch.get_num_threads()
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        torch.set_num_threads(3)
        cap_torch_threads(8)
        assert torch.get_num_threads() == 3  # never raised
        cap_torch_threads(2)
        assert torch.get_num_threads() == 2
        torch.set_num_threads(3)
        monkeypatch.setenv("OMP_NUM_THREADS", "3")
        cap_torch_threads(1)
        assert torch.get_num_threads() == 3  # the user's (or torchrun's) setting wins
    finally:
        torch.set_num_threads(before)
