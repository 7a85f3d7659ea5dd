"""One tune trial: a training run in a fresh process, followed through its results.csv, pruned or stopped on request.

The trial is the plain train.py (or torchrun train.py) command a person could run again, with the
trial's hyp file and `--callbacks utils.tune.report`. Its output goes to a log file beside its run
folder. While it runs, each new results.csv row's score is reported (`report` says whether to prune);
a pruned or interrupted trial gets SIGTERM (the run saves last.pt and stops), then SIGKILL after a
grace period. Afterwards the outcome is classified from trial.json, the exit status and the log.
"""

from __future__ import annotations

import csv
import ctypes
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from utils.tune.report import read_trial_result
from utils.tune.space import SearchSpace

COMPLETE, PRUNED, FAILED, INTERRUPTED = "complete", "pruned", "failed", "interrupted"
STOP_GRACE_S = 60.0  # a stopped trial's time to save last.pt and exit before SIGKILL
PR_SET_PDEATHSIG = 1  # prctl(2)


@dataclass(frozen=True)
class TrialCommand:
    """How to start a trial: the command, its environment additions, its run folder, log and CPU cores."""

    argv: list[str]
    run_dir: Path
    log: Path
    env: dict[str, str] = field(default_factory=dict)
    cpus: tuple[int, ...] = ()  # cores the trial may use (empty: all); the tuner splits them between slots
    die_with_parent: bool = False  # SIGTERM the trial when the thread that started it dies (a killed tuner, Ray)


@dataclass(frozen=True)
class TrialRecipe:
    """What every trial of a study runs, whatever starts it (a tuner thread here or a Ray worker elsewhere).

    Picklable: Ray sends it to its workers, which need the project at the same path and the study
    folder on a disk they share.
    """

    script: Path  # train.py or segment/train.py
    train_argv: tuple[str, ...]  # the train flags the user gave
    optimizer: str  # the base plan's resolved optimizer (--optimizer auto resolved once, for every trial)
    callbacks: tuple[str, ...]  # the user's --callbacks, then the tuner's report
    trials_dir: Path
    space: SearchSpace
    nproc_per_trial: int = 1
    env: dict[str, str] = field(default_factory=dict)  # added to every trial's environment

    def command(self, number: int, params: dict[str, float], device: str, env: dict[str, str] | None = None,
                cpus: tuple[int, ...] = (), die_with_parent: bool = False) -> TrialCommand:  # fmt: skip
        """Trial `number`'s train.py command (under torchrun for several ranks), with its hyp file written first."""
        name = f"trial_{number:04d}"
        hyp_file = self.trials_dir / "hyps" / f"{name}.yaml"
        hyp_file.parent.mkdir(parents=True, exist_ok=True)
        hyp_file.write_text(yaml.safe_dump(self.space.hyp_for(params).to_dict(), sort_keys=False), encoding="utf-8")
        launcher = [sys.executable, str(self.script)]
        if self.nproc_per_trial > 1:
            launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                        f"--nproc-per-node={self.nproc_per_trial}", str(self.script)]  # fmt: skip
        argv = [*launcher, *self.train_argv, "--hyp", str(hyp_file), "--optimizer", self.optimizer,
                "--project", str(self.trials_dir), "--name", name, "--exist-ok", "--device", device,
                "--callbacks", *self.callbacks]  # fmt: skip
        return TrialCommand(argv, self.trials_dir / name, self.trials_dir / f"{name}.log", {**self.env, **(env or {})},
                            cpus, die_with_parent)  # fmt: skip


@dataclass(frozen=True)
class TrialOutcome:
    """How a trial ended: state (complete, pruned, failed, interrupted), fitness, epochs run, why, best.pt."""

    state: str
    fitness: float | None
    epochs: int
    reason: str = ""
    best: str = ""


@dataclass
class TrialWatch:
    """What the tuner does while a trial runs: `report(epoch, score)` -> prune?, `heartbeat()`, and `stop`."""

    report: Callable[[int, float], bool]
    heartbeat: Callable[[], None]
    stop: threading.Event
    score_column: str  # the results.csv column reported per epoch, e.g. metrics/mAP50-95
    fitness_key: str  # the final metrics' key that is the trial's fitness, e.g. mAP50-95
    poll_s: float = 1.0
    heartbeat_s: float = 30.0


def recorded_run_dir(run_dir: Path) -> str:
    """The run folder a trial's record names: '' when the trial ended before making it (a refused flag, a stop)."""
    return str(run_dir) if run_dir.is_dir() else ""


def run_trial(command: TrialCommand, watch: TrialWatch) -> TrialOutcome:
    """Run the trial to its end and return its outcome; every child process is gone when this returns."""
    command.log.parent.mkdir(parents=True, exist_ok=True)
    with command.log.open("ab") as log:
        process = subprocess.Popen(
            command.argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **command.env},
            start_new_session=True,  # its own process group: Ctrl-C reaches the tuner, which stops it
            preexec_fn=_term_with_parent() if command.die_with_parent else None,
        )  # fmt: skip
        try:
            if command.cpus:
                _pin(process.pid, command.cpus)
            pruned_at, interrupted, scores = _follow(process, command.run_dir, watch)
        finally:  # `_follow` failed (the study's storage, say): the trainer must not train on beside the next trial
            if process.poll() is None:
                _stop(process)
    if pruned_at is not None:
        return TrialOutcome(PRUNED, scores[-1] if scores else None, pruned_at, f"pruned after epoch {pruned_at}")
    if interrupted:
        return TrialOutcome(INTERRUPTED, None, len(scores), "interrupted: the study was stopped")
    return _classify(process.returncode, command, watch.fitness_key, len(scores))


def _follow(process: subprocess.Popen, run_dir: Path, watch: TrialWatch) -> tuple[int | None, bool, list[float]]:
    """Poll until the process exits: report new epochs' scores, beat the heart, stop on prune or request."""
    scores: list[float] = []
    last_beat = time.monotonic()
    pruned_at = None
    while process.poll() is None:
        if watch.stop.wait(watch.poll_s):
            _stop(process)  # it saves at its next optimizer step: it may finish an epoch (and its row) first
            scores += [score for _, score in _new_scores(run_dir / "results.csv", watch.score_column, len(scores))]
            return None, True, scores
        if process.poll() is not None:
            break  # it ended during the wait: its last rows are reported below, and a finished trial is not pruned
        for epoch, score in _new_scores(run_dir / "results.csv", watch.score_column, len(scores)):
            scores.append(score)
            if math.isfinite(score) and watch.report(epoch, score):
                pruned_at = epoch
                break
        if pruned_at is not None and process.poll() is None:
            _stop(process)
            return pruned_at, False, scores
        pruned_at = None  # (it ended while its rows were read: classified by its exit and trial.json below)
        if time.monotonic() - last_beat >= watch.heartbeat_s:
            watch.heartbeat()
            last_beat = time.monotonic()
    for epoch, score in _new_scores(run_dir / "results.csv", watch.score_column, len(scores)):
        scores.append(score)  # rows written after the last poll: reported too (later trials are compared with them)
        if math.isfinite(score):
            watch.report(epoch, score)
    return None, False, scores


def _new_scores(path: Path, column: str, seen: int) -> list[tuple[int, float]]:
    """(epoch, score) of results.csv rows after the first `seen`; a row being written is left for later."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        return []
    lines = text.splitlines(keepends=True)
    complete = [line for line in lines if line.endswith("\n")]
    rows = list(csv.DictReader(complete))
    found = []
    for row in rows[seen:]:
        try:
            found.append((int(row["epoch"]), float(row.get(column) or "nan")))
        except (KeyError, ValueError):
            break
    return found


def _stop(process: subprocess.Popen) -> None:
    """SIGTERM the trial's process group (train.py saves last.pt and exits), SIGKILL it after STOP_GRACE_S."""
    _signal_group(process, signal.SIGTERM)
    try:
        process.wait(STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        _signal_group(process, signal.SIGKILL)
        process.wait()


def _signal_group(process: subprocess.Popen, sig: signal.Signals) -> None:
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:
        pass


def _term_with_parent() -> Callable[[], None] | None:
    """What the child runs before exec so that Linux sends it SIGTERM when the thread that started it dies (a Ray
    worker stopped by its scheduler): the run saves last.pt and stops instead of training on as an orphan.

    prctl is looked up here, in the parent: the child of a threaded process should only call it. None off Linux.
    """
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()

    def arm() -> None:
        prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM))
        if os.getppid() != parent:  # the parent died before the signal was armed: it will never come
            os.kill(os.getpid(), signal.SIGTERM)

    return arm


def _pin(pid: int, cpus: tuple[int, ...]) -> None:
    """Limit the trial to `cpus` (its workers inherit them); a process that already exited is left alone."""
    try:
        os.sched_setaffinity(pid, cpus)
    except (OSError, AttributeError):
        pass


def _classify(returncode: int, command: TrialCommand, fitness_key: str, epochs: int) -> TrialOutcome:
    """A finished trial's outcome: complete with a finite fitness, else failed with the reason found."""
    result = read_trial_result(command.run_dir) or {}
    if returncode == 0 and "metrics" in result:
        fitness = float(result["metrics"].get(fitness_key, float("nan")))
        epochs = int(result.get("epochs", epochs))
        if not math.isfinite(fitness):
            return TrialOutcome(FAILED, None, epochs, f"final {fitness_key} is {fitness}")
        return TrialOutcome(COMPLETE, fitness, epochs, best=str(result.get("best", "")))
    return TrialOutcome(FAILED, None, epochs, _failure_reason(returncode, result.get("error"), command.log))


def _failure_reason(returncode: int, error: str | None, log: Path) -> str:
    """One line: what the run reported, else the log's last error line, else the exit status; OOM is named."""
    reason = error or _last_error_line(log)
    if returncode < 0:
        reason = f"killed by {signal.Signals(-returncode).name}" + (f" ({reason})" if reason else "")
    elif not reason:
        reason = f"exit status {returncode}"
    if "out of memory" in reason.lower() and not reason.startswith("out of memory"):
        reason = f"out of memory: {reason}"
    return reason[:500]


def _last_error_line(log: Path) -> str:
    """The last line of the log that reads like an error (a traceback's last line, `error: ...`)."""
    try:
        lines = log.read_text(encoding="utf-8", errors="replace").splitlines()[-200:]
    except OSError:
        return ""
    for line in reversed(lines):
        text = line.strip()
        if text.startswith("error:") or "Error" in text.split(":")[0] or "out of memory" in text.lower():
            return text
    return ""
