"""Run folders: <project>/<name>, numbered name2, name3, ... as YOLOv5 does, picked on rank 0, shared and locked."""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path
from typing import IO

from utils.distributed import DistContext, broadcast_object, run_on_main
from utils.errors import ConfigError

try:  # POSIX only: where it is missing, run folders are not locked (lock_run_dir)
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

LOGGER = logging.getLogger(__name__)


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
        while True:
            path = next_run_dir(project, name, exist_ok)
            try:
                path.mkdir(parents=True, exist_ok=exist_ok)
            except FileExistsError:  # another run took this number between the look and the mkdir: the next one
                continue
            for folder in (path / sub for sub in subdirs):
                folder.mkdir(parents=True, exist_ok=True)
            return str(path)

    return Path(broadcast_object(run_on_main(make, ctx, "creating the run folder"), ctx))


LOCK_FILE = ".lock"  # in a run folder: held (flock) by the training process that writes the folder


class RunFolderLock:
    """Rank 0's exclusive hold on a run folder while a run writes it; `release()` (or the process's end) frees it.

    Two runs in one folder (a `--resume` started while the run still trains, two jobs with the same
    `--name --exist-ok`) would interleave results.csv rows and overwrite each other's last.pt. The
    hold is a `flock` on LOCK_FILE, which the kernel drops when the holder exits, killed or not: no
    stale lock survives a crash, so an elastic restart or a later --resume finds the folder free.
    """

    def __init__(self, handle: IO[str]) -> None:
        self._handle: IO[str] | None = handle

    def release(self) -> None:
        """Free the folder (a second call does nothing). The file stays: removing it could race a new holder."""
        if self._handle is not None:
            self._handle.truncate(0)
            self._handle.close()  # closing the descriptor drops the flock
            self._handle = None


def lock_run_dir(run_dir: Path) -> RunFolderLock | None:
    """Take `run_dir`'s lock, or raise a one-line ConfigError naming the process that holds it.

    Returns None (and the run goes on unguarded) where the platform or the file system has no
    flock (Windows; a network mount without lock support), after one warning saying so.
    """
    if fcntl is None:
        return None
    handle = (run_dir / LOCK_FILE).open("a+", encoding="utf-8")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise ConfigError(
            f"run folder {run_dir} is in use by {holder}: two runs writing one folder would mix their "
            "checkpoints and results.csv; wait for that run to end, or give this one another --name"
        ) from None
    except OSError as error:
        handle.close()
        LOGGER.warning(f"run folder {run_dir}: no file lock here ({error}); nothing stops a second run writing it")
        return None
    handle.truncate(0)
    handle.write(f"process {os.getpid()} on {socket.gethostname()}\n")
    handle.flush()
    return RunFolderLock(handle)
