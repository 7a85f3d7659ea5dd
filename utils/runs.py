"""Run folders: <project>/<name>, numbered name2, name3, ... as YOLOv5 does, picked on rank 0 and shared."""

from __future__ import annotations

from pathlib import Path

from utils.distributed import DistContext, broadcast_object, run_on_main


def next_run_dir(project: Path, name: str, exist_ok: bool) -> Path:
    """Return `project/name`, or when that exists (and not `exist_ok`) the first free `name2`, `name3`, ...

    Pure: creates nothing. The numbering starts at 2 as in YOLOv5 (exp, exp2, exp3).
    """
    path = Path(project) / name
    suffix = 2
    while path.exists() and not exist_ok:
        path = Path(project) / f"{name}{suffix}"
        suffix += 1
    return path


def create_run_dir(project: Path, name: str, exist_ok: bool, ctx: DistContext, subdirs: tuple[str, ...] = ()) -> Path:
    """Pick the run folder on rank 0, create it with `subdirs`, and return the same path on every rank.

    Every rank must call it. Only rank 0 looks at the file system (other nodes may not share it);
    a failure there (no permission, disk full) is raised on every rank at once (run_on_main).
    """

    def make() -> str:
        path = next_run_dir(project, name, exist_ok)
        for folder in (path, *(path / sub for sub in subdirs)):
            folder.mkdir(parents=True, exist_ok=True)
        return str(path)

    return Path(broadcast_object(run_on_main(make, ctx, "creating the run folder"), ctx))
