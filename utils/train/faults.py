"""Stopping and restarting without losing work: preemption signals, and finding a restarted job's run folder.

SLURM and Kubernetes announce the end of a job with SIGTERM (SLURM also with SIGUSR1 when
`--signal=USR1@N` asks for a warning), and a user stops a run with Ctrl-C (SIGINT). `StopSignals`
turns each into a request that the training loop agrees on across ranks at the next optimizer
step; rank 0 then writes a mid-epoch checkpoint and every rank raises `Preempted`, which the entry
point turns into exit status REQUEUE_EXIT_CODE. torchrun restarts its workers after a failure
(`--max-restarts`) with the same command line; `mark_run` / `find_restarted_run` let the restarted
attempt continue in the run folder the first attempt created instead of starting `exp2` from scratch.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from pathlib import Path
from types import FrameType, TracebackType

from utils.data.shm_segment import process_start_time
from utils.data.workers import set_stops_handled
from utils.errors import REQUEUE_EXIT_CODE, STOP_SIGNALS

LOGGER = logging.getLogger(__name__)

RUN_ID_FILE = ".torchelastic_run_id"  # in the run folder: the torchrun job that created it
DEFAULT_RUN_ID = "none"  # torchrun's --rdzv-id when none is given: shared by every such job
STOP_GRACE_S = 60.0  # after SIGTERM / SIGUSR1 the process ends within this many seconds, saved or not


def _exit_after_grace(name: str) -> None:
    """Watchdog body: the stop after `name` did not finish in time; leave without running more Python."""
    LOGGER.error(f"still running {STOP_GRACE_S:.0f} s after {name} (a peer rank gone?); exiting now")
    os._exit(REQUEUE_EXIT_CODE)


class StopSignals:
    """While entered, SIGTERM, SIGUSR1 and SIGINT set `received` (the signal's name) instead of ending the process.

    Handlers can only be installed from the main thread; elsewhere (a test running fit in a
    thread) entering does nothing and `received` stays None. While they are installed the loader
    workers outlast these signals (`set_stops_handled`). The previous handlers come back on exit,
    except after an error under torchrun (see __exit__). `request()` sets the flag directly (what
    a handler does), for tests and callers. Ctrl-C is a person at a terminal, not a launcher with
    a deadline: it starts no watchdog, and a second Ctrl-C interrupts at once (KeyboardInterrupt).
    """

    def __init__(self) -> None:
        self.received: str | None = None
        self._previous: dict[int, object] = {}
        self._watchdog: threading.Timer | None = None
        self._workers_told: bool | None = None  # the workers' flag before __enter__ set it (None: not set)

    def request(self, name: str) -> None:
        """Ask the loop to stop at its next optimizer step (or validation batch), as signal `name` would.

        For SIGTERM and SIGUSR1 a watchdog then ends the process after STOP_GRACE_S, saved or not: a
        rank whose peer died can sit in a collective that never returns, and a launcher that sent
        the signal may be waiting for exactly this process to go. Ctrl-C starts none (see the class).
        """
        if self.received is None and name == "SIGINT":
            LOGGER.warning(
                "Ctrl-C: saving a checkpoint at the next optimizer step or validation batch, then exiting (Ctrl-C "
                "again: now)"
            )
        elif self.received is None:
            LOGGER.warning(
                f"{name} received: saving a checkpoint at the next optimizer step or validation batch, then exiting"
            )
            self._watchdog = threading.Timer(STOP_GRACE_S, _exit_after_grace, args=(name,))
            self._watchdog.daemon = True
            self._watchdog.start()
        self.received = name

    @property
    def reason(self) -> str:
        """What an agreed stop says it was stopped by: this rank's signal, or another rank's (the agreement carries
        no name)."""
        return self.received or "a stop signal on another rank"

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        if signum == signal.SIGINT:  # the next Ctrl-C interrupts: the previous handler (KeyboardInterrupt) again
            signal.signal(signum, self._previous.get(signum, signal.default_int_handler))  # type: ignore[arg-type]
        self.request(signal.Signals(signum).name)

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for name in STOP_SIGNALS:
                number = getattr(signal, name, None)
                # A signal the process was started with ignored stays so: a shell script's background job ignores
                # SIGINT, so that Ctrl-C stops the script in the foreground and not it.
                if number is not None and signal.getsignal(number) is not signal.SIG_IGN:
                    self._previous[number] = signal.signal(number, self._handle)
            self._workers_told = set_stops_handled(True)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        if self.received is None:  # no stop came: the workers may act on signals as usual again
            self.release_workers()
        # Else a worker may not have run its handler yet (busy in C code): it must still ignore that signal, so
        # the flag stays set until the loaders are closed (release_workers).
        if self._watchdog is not None:  # the stop went through
            self._watchdog.cancel()
        if kind is None and self.received is not None:  # the loop ended without another optimizer step to stop at
            LOGGER.warning(f"{self.received} came after the run's last optimizer step: its epochs are saved; finishing")
        if kind is not None and os.environ.get("TORCHELASTIC_RUN_ID") and self._previous:
            # Left by an error under torchrun, whose agent now sends SIGTERM to every rank of the group (this
            # error is often a peer's death seen in a collective). The default action would end this rank
            # mid-unwind: no traceback, no exit handlers (--cache shm keeps its segment for the restart in
            # one). The first signal from here on only lets the exit finish; a second one acts as before.
            for number in self._previous:
                signal.signal(number, self._finish_exit)
            return
        self._restore()

    def release_workers(self) -> None:
        """Give the workers' flag back the value it had before __enter__ (call once the run's loaders are closed).

        From then on a signal ends the workers as usual (an exit handler stopping them with SIGTERM, a
        launcher's), and an enclosing loop's setting comes back. A second call does nothing.
        """
        if self._workers_told is not None:
            set_stops_handled(self._workers_told)
            self._workers_told = None

    def _restore(self) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def _finish_exit(self, signum: int, _frame: FrameType | None) -> None:
        LOGGER.warning(f"{signal.Signals(signum).name} received while exiting after an error: finishing the exit")
        self._restore()


def _agent() -> str:
    """This worker's torchrun agent, the parent process, as "pid:start time": one job on this node for good."""
    parent = os.getppid()
    return f"{parent}:{process_start_time(parent)}"


def mark_run(run_dir: Path, run_id: str) -> None:
    """Record in `run_dir` which torchrun job created it (rank 0; nothing outside torchrun): its rendezvous id and
    its agent on this node."""
    if run_id:
        (run_dir / RUN_ID_FILE).write_text(f"{run_id}\n{_agent()}\n", encoding="utf-8")


def _is_named(folder: Path, name: str) -> bool:
    """Whether `folder` is `name` or one of its numbered siblings (name2, name3, ... as next_run_dir makes them)."""
    rest = folder.name[len(name) :] if folder.name.startswith(name) else None
    return rest is not None and (rest == "" or rest.isdigit())


def find_restarted_run(project: Path, run_id: str, name: str) -> Path | None:
    """Return the newest run folder `name` (or name2, ...) under `project` created by torchrun job `run_id`, or None.

    torchrun's rendezvous id is "none" for every job that does not set --rdzv-id (and for static
    rendezvous): such a folder must also have been made under this worker's own agent, or a restart
    whose first attempt died before making its folder would continue another job's run. A job with
    "none" whose rank 0 moved to another node therefore starts a new run; --rdzv-id avoids that.
    """
    if not run_id or not project.is_dir():
        return None
    wanted = [run_id] if run_id != DEFAULT_RUN_ID else [run_id, _agent()]
    marked = []
    for folder in project.iterdir():
        marker = folder / RUN_ID_FILE
        try:
            if _is_named(folder, name) and marker.is_file():
                if marker.read_text(encoding="utf-8").split()[: len(wanted)] == wanted:
                    marked.append(folder)
        except OSError:
            continue
    return max(marked, key=lambda folder: (folder / RUN_ID_FILE).stat().st_mtime) if marked else None
