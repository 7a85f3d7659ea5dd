"""A study's results for people: trials.csv, best_hyp.yaml, the two plots and the one-line summary.

Rewritten from the storage after every trial, so they include the trials of every machine sharing the
study, and always describe the study as it stands (a killed tuner leaves them current).
"""

from __future__ import annotations

import csv
import math
import os
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path

import optuna
import yaml

from utils.tune.space import SearchSpace
from utils.tune.study import NOT_COUNTED, STATES, state_name


@dataclass(frozen=True)
class StudySummary:
    """The study's counts, its best trial (None before one completes) and the files written."""

    counts: dict[str, int]
    best_number: int | None
    best_fitness: float | None
    baseline_fitness: float | None
    best_weights: str
    study_dir: Path

    def line(self, fitness_key: str) -> str:
        """'tune: 20 trials (14 complete, 5 pruned, 1 failed); best trial 7: mAP50-95 0.412 (base recipe 0.380) ...'"""
        parts = ", ".join(f"{count} {state}" for state, count in self.counts.items() if count)
        total = sum(self.counts.values())
        if self.best_number is None:
            return f"tune: {total} trials ({parts}); none completed yet; results in {self.study_dir}"
        base = f" (base recipe {self.baseline_fitness:.4f})" if self.baseline_fitness is not None else ""
        return (
            f"tune: {total} trials ({parts}); best trial {self.best_number}: {fitness_key} {self.best_fitness:.4f}"
            f"{base}; hyp {self.study_dir / 'best_hyp.yaml'}; weights {self.best_weights or 'on another machine'}"
        )


def write_results(
    study: optuna.Study, space: SearchSpace, study_dir: Path, fitness_key: str, plots: bool = True
) -> StudySummary:
    """Write trials.csv and best_hyp.yaml (and the figures when `plots`) into `study_dir`; return the summary."""
    trials = study.get_trials(deepcopy=False)
    # Queued values (an interrupted trial's, the base recipe) are not trials yet: not rows, as not counted below.
    _write_trials_csv([t for t in trials if t.state != optuna.trial.TrialState.WAITING], space,
                      study_dir / "trials.csv", fitness_key)  # fmt: skip
    complete = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE and t.value is not None]
    best = max(complete, key=lambda t: t.value) if complete else None
    baseline = next((t.value for t in complete if t.user_attrs.get("baseline")), None)
    if best is not None:
        optimizer = str((study.user_attrs.get("settings") or {}).get("optimizer", ""))
        _write_best_hyp(best, space, study_dir / "best_hyp.yaml", fitness_key, optimizer)
    if plots:
        from utils.tune.plots import plot_study  # matplotlib only when there is something to draw

        plot_study(trials, space, study_dir, fitness_key)
    counts = {name: 0 for name in (*STATES.values(), *NOT_COUNTED) if name != "waiting"}
    for trial in trials:  # queued values (an interrupted trial's, the base recipe) are not trials yet
        if trial.state != optuna.trial.TrialState.WAITING:
            counts[state_name(trial)] += 1
    return StudySummary(
        counts={k: v for k, v in counts.items() if v},
        best_number=None if best is None else best.number,
        best_fitness=None if best is None else best.value,
        baseline_fitness=baseline,
        best_weights=_weights_where(best) if best is not None else "",
        study_dir=study_dir,
    )


def _weights_where(trial: optuna.trial.FrozenTrial) -> str:
    """The trial's best.pt, and the host that holds it when that is not this machine (a study shared by several)."""
    weights = str(trial.user_attrs.get("best", ""))
    if not weights or Path(weights).is_file():
        return weights
    host = str(trial.user_attrs.get("worker", "")).split(":")[0]
    return f"{weights} (missing)" if host == socket.gethostname() else f"{weights} on {host or 'another machine'}"


def trial_row(trial: optuna.trial.FrozenTrial, space: SearchSpace, fitness_key: str) -> dict[str, object]:
    """One trials.csv row: number, state, fitness, epochs, seconds, where it ran, why it ended, every searched key."""
    seconds = ""
    if trial.datetime_start is not None and trial.datetime_complete is not None:
        seconds = round((trial.datetime_complete - trial.datetime_start).total_seconds(), 1)
    value = _short(trial.value) if trial.value is not None and math.isfinite(trial.value) else ""
    row: dict[str, object] = {
        "trial": trial.number,
        "state": state_name(trial),
        fitness_key: value,
        "epochs": trial.user_attrs.get("epochs", ""),
        "seconds": seconds,
        "baseline": int(bool(trial.user_attrs.get("baseline"))),
        "worker": trial.user_attrs.get("worker", ""),
        "reason": trial.user_attrs.get("reason", ""),
        "run_dir": trial.user_attrs.get("run_dir", ""),
    }
    row.update({key: _short(trial.params.get(key, "")) for key in space.keys})
    return row


def _short(value: object) -> object:
    """A float to 6 significant digits (what a person compares; the trial's hyp file holds the exact value)."""
    return float(f"{value:.6g}") if isinstance(value, float) else value


def _write_trials_csv(trials: list, space: SearchSpace, path: Path, fitness_key: str) -> None:
    rows = [trial_row(trial, space, fitness_key) for trial in trials]
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with tmp.open("w", newline="", encoding="utf-8") as file:
        header = list(trial_row(optuna.trial.create_trial(state=optuna.trial.TrialState.FAIL), space, fitness_key))
        writer = csv.DictWriter(file, fieldnames=header)
        writer.writeheader()
        writer.writerows(rows)
    os.replace(tmp, path)


def _write_best_hyp(
    best: optuna.trial.FrozenTrial, space: SearchSpace, path: Path, fitness_key: str, optimizer: str
) -> None:
    """best_hyp.yaml: the base hyp with the best trial's values, loadable with --hyp (a comment says whence).

    The command in the comment names the study's optimizer: a hyp file alone picks one by its lr0
    (SGD from 0.003 up), and a tuned lr0 may land on the other side of that line.
    """
    hyp = space.hyp_for({key: best.params[key] for key in space.keys if key in best.params}).to_dict()
    flag = f" --optimizer {optimizer}" if optimizer else ""
    header = (
        f"# Best of study '{best.user_attrs.get('study', '')}': trial {best.number}, {fitness_key} {best.value:.4f}.\n"
        f"# Train with it: python train.py --hyp {path}{flag} (the study's data and model; its epochs or more).\n"
    )
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(header + yaml.safe_dump(hyp, sort_keys=False), encoding="utf-8")
    os.replace(tmp, path)


def prune_weights(study: optuna.Study, trials_dir: Path) -> None:
    """Delete this machine's trials' weights folders except the best complete trial's (disk stays bounded)."""
    trials = study.get_trials(deepcopy=False)
    complete = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE and t.value is not None]
    keep = str(max(complete, key=lambda t: t.value).user_attrs.get("run_dir", "")) if complete else ""
    for trial in trials:
        run_dir = trial.user_attrs.get("run_dir", "")
        if trial.state == optuna.trial.TrialState.RUNNING or not run_dir or run_dir == keep:
            continue
        weights = Path(run_dir) / "weights"
        if weights.is_dir() and Path(run_dir).parent == trials_dir:
            shutil.rmtree(weights, ignore_errors=True)
