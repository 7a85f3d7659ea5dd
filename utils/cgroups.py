"""The cgroup folders (v1 or v2) that can limit this process for one controller, and their integer files."""

from __future__ import annotations

from pathlib import Path

UNLIMITED = 1 << 60  # cgroup v1 reports "no limit" as a number near 2**63


def cgroup_dirs(controller: str, proc: Path, sys_fs: Path) -> list[tuple[Path, str]]:
    """This process's `controller` cgroup folders with their version ('v1'/'v2'), innermost first, then ancestors.

    A limit may sit on any ancestor (a SLURM job above its step, a pod above its container), so
    callers take the tightest over all of them. The path in `proc`/self/cgroup may not exist inside
    a container's cgroup namespace mount; the mount root (the container's own cgroup) is always
    listed as well. cgroup v1 mounts a controller at `sys_fs`/cgroup/<controller> (or at the folder
    named after its co-mounted controllers, "cpu,cpuacct"); v2 is `sys_fs`/cgroup, or
    `sys_fs`/cgroup/unified beside v1 (hybrid). Empty when /proc/self/cgroup cannot be read.
    """
    try:
        lines = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return []
    unified = next(
        (d for d in (sys_fs / "cgroup", sys_fs / "cgroup" / "unified") if (d / "cgroup.controllers").exists()), None
    )
    found: list[tuple[Path, str]] = []
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "" and unified is not None:  # v2, alone or beside v1 (hybrid)
            base, version = unified, "v2"
        elif controller in controllers.split(","):
            named = sys_fs / "cgroup" / controller
            base, version = (named if named.is_dir() else sys_fs / "cgroup" / controllers), "v1"
        else:
            continue
        folder = base / path.lstrip("/")
        while folder != base and base in folder.parents:
            found.append((folder, version))
            folder = folder.parent
        found.append((base, version))
    return found


def read_int(path: Path) -> int | None:
    """An integer file; None when absent, unreadable or no limit (cgroup 'max', -1, v1's near-2**63 value)."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if not text or text == "max":
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return None if value >= UNLIMITED or value < 0 else value
