"""Run folders: <project>/<name>, numbered name2, name3, ... as YOLOv5 does, picked on rank 0, shared and locked."""

from __future__ import annotations

import logging
import os
import socket
import time
import weakref
from pathlib import Path

from utils.distributed import DistContext, broadcast_object, run_on_main
from utils.errors import ConfigError

try:  # POSIX only: where it is missing, run folders are not locked (lock_run_dir)
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

LOGGER = logging.getLogger(__name__)


FIGURE_SUFFIXES = (".png", ".jpg")  # the figures a run writes into its folder (plots, batches)


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
            except FileExistsError:
                if exist_ok or not path.is_dir():  # a file of that name: no numbering gets past it
                    raise ConfigError(f"run folder {path} exists and is not a folder") from None
                continue  # another run took this number between the look and the mkdir: the next one
            for folder in (path / sub for sub in subdirs):
                folder.mkdir(parents=True, exist_ok=True)
            return str(path)

    return Path(broadcast_object(run_on_main(make, ctx, "creating the run folder"), ctx))


LOCK_FILE = ".lock"  # in a run folder: held (flock) by the training process that writes the folder
RESTART_LOCK_WAIT_S = 120.0  # a restarted job's wait for its dead attempt's lock (an NFS lease is ~90 s)
_HELD: weakref.WeakSet[RunFolderLock] = weakref.WeakSet()  # this process's locks: dropped in forked children


class RunFolderLock:
    """Rank 0's exclusive hold on a run folder while a run writes it; `release()` (or the process's end) frees it.

    Two runs in one folder (a `--resume` started while the run still trains, two jobs with the same
    `--name --exist-ok`) would interleave results.csv rows and overwrite each other's last.pt. The
    hold is a `flock` on LOCK_FILE, which the kernel drops when the last descriptor of it closes:
    the holder's, since a forked child (a loader worker) closes its inherited copy at once
    (`_drop_in_child`); so no stale lock survives the holder, killed or not, and an elastic
    restart or a later --resume finds the folder free.
    """

    def __init__(self, fd: int) -> None:
        self._fd: int | None = fd
        _HELD.add(self)

    def release(self) -> None:
        """Free the folder (a second call does nothing). The file stays: removing it could race a new holder."""
        if self._fd is not None:
            os.ftruncate(self._fd, 0)
            os.close(self._fd)  # the last descriptor of the lock: the flock goes with it
            self._fd = None

    def _drop_in_child(self) -> None:
        """In a forked child: close the inherited descriptor without unlocking (the parent still holds it)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _drop_locks_in_child() -> None:
    for lock in list(_HELD):
        lock._drop_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_drop_locks_in_child)


def lock_run_dir(run_dir: Path, job: str = "", restarted: bool = False) -> RunFolderLock | None:
    """Take `run_dir`'s lock, or raise a one-line ConfigError naming the process that holds it.

    `job` (torchrun's run id) is written with the holder. A `restarted` attempt of the same job
    waits up to RESTART_LOCK_WAIT_S for its own dead attempt's lock (on a network file system the
    server keeps a lost node's lock until its lease ends), then trains unguarded with a warning
    rather than fail the restart. Returns None (one warning) where there is no flock at all
    (Windows; a mount without lock support). On mounts whose locks are local to a node (NFS with
    `local_lock=flock`, Lustre's `localflock`) it guards against runs on the same node only.
    """
    if fcntl is None:
        return None
    fd = os.open(run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        holder = _take_lock(fd, job if restarted else "")
    except OSError as error:
        os.close(fd)
        LOGGER.warning(f"run folder {run_dir}: no file lock here ({error}); nothing stops a second run writing it")
        return None
    if holder is not None:
        os.close(fd)
        if restarted and job and f"job {job}" in holder:
            LOGGER.warning(f"run folder {run_dir}: still locked by this job's last attempt ({holder}); going on")
            return None
        raise ConfigError(
            f"run folder {run_dir} is in use by {holder}: two runs writing one folder would mix their "
            "checkpoints and results.csv; wait for that run to end, or give this one another --name"
        )
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"process {os.getpid()} on {socket.gethostname()}{f', job {job}' if job else ''}\n".encode(), 0)
    return RunFolderLock(fd)


def _take_lock(fd: int, restarting_job: str) -> str | None:
    """flock `fd` without blocking: None once taken, else what the holder wrote (after waiting, for a restart)."""
    deadline = time.monotonic() + (RESTART_LOCK_WAIT_S if restarting_job else 0.0)
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return None
        except BlockingIOError:
            holder = os.pread(fd, 512, 0).decode("utf-8", "replace").strip() or "another process"
            if not (restarting_job and f"job {restarting_job}" in holder and time.monotonic() < deadline):
                return holder
            time.sleep(2.0)
