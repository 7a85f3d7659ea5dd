"""A study's figures: tune_fitness.png (fitness per trial, best so far), tune_params.png (each key vs fitness)."""

from __future__ import annotations

import math
import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; no display on a training server
import matplotlib.pyplot as plt  # noqa: E402
import optuna  # noqa: E402
from matplotlib.ticker import LogLocator, MaxNLocator  # noqa: E402

from utils.tune.space import SearchSpace  # noqa: E402


def _scored(trials: list[optuna.trial.FrozenTrial]) -> list[tuple[optuna.trial.FrozenTrial, float, bool]]:
    """(trial, score, pruned?): complete trials' fitness, pruned trials' last per-epoch score."""
    found = []
    for trial in trials:
        if trial.state == optuna.trial.TrialState.COMPLETE and trial.value is not None:
            found.append((trial, trial.value, False))
        elif trial.state == optuna.trial.TrialState.PRUNED and trial.intermediate_values:
            found.append((trial, trial.intermediate_values[max(trial.intermediate_values)], True))
    return [item for item in found if math.isfinite(item[1])]


def plot_study(trials: list[optuna.trial.FrozenTrial], space: SearchSpace, study_dir: Path, fitness_key: str) -> None:
    """Draw both figures (nothing while no trial has a score); files are replaced atomically."""
    scored = _scored(trials)
    if not scored:
        return
    _save(_fitness_figure(scored, fitness_key), study_dir / "tune_fitness.png")
    _save(_params_figure(scored, space, fitness_key), study_dir / "tune_params.png")


def _fitness_figure(scored: list, fitness_key: str) -> plt.Figure:
    figure, axes = plt.subplots(figsize=(7, 4), tight_layout=True)
    done = sorted((t.number, score) for t, score, pruned in scored if not pruned)
    pruned = [(t.number, score) for t, score, was_pruned in scored if was_pruned]
    if done:
        axes.scatter(*zip(*done, strict=True), color="tab:blue", label="complete: final " + fitness_key)
        best, best_so_far = -math.inf, []
        for number, score in done:
            best = max(best, score)
            best_so_far.append((number, best))
        axes.step(*zip(*best_so_far, strict=True), where="post", color="tab:green", label="best so far")
    if pruned:
        axes.scatter(*zip(*pruned, strict=True), marker="x", color="tab:red", label="pruned: last epoch's score")
    axes.set_xlabel("trial")
    axes.set_ylabel(fitness_key)
    axes.legend(loc="lower right", fontsize=8)
    return figure


def _params_figure(scored: list, space: SearchSpace, fitness_key: str) -> plt.Figure:
    columns = min(5, len(space.dimensions))
    rows = math.ceil(len(space.dimensions) / columns)
    # Fixed spacing: tight_layout measured every tick label of the grid and took longer than the drawing.
    figure, grid = plt.subplots(rows, columns, figsize=(3 * columns, 2.4 * rows), squeeze=False)
    figure.subplots_adjust(left=0.05, right=0.98, bottom=0.06, top=1 - 0.5 / (2.4 * rows), wspace=0.3, hspace=0.55)
    best = max(scored, key=lambda item: (not item[2], item[1]))[0]
    for axes, dim in zip(grid.flat, space.dimensions, strict=False):
        points = [(t.params[dim.key], score, t.number) for t, score, _ in scored if dim.key in t.params]
        if points:
            x, y, order = zip(*points, strict=True)
            axes.scatter(x, y, c=order, cmap="viridis", s=12)
        if dim.key in best.params:
            axes.axvline(best.params[dim.key], color="tab:red", linewidth=1)
        axes.set_xlim(dim.low, dim.high)  # the whole searched range, before the scale (one point has no extent)
        axes.set_xscale("log" if dim.scale == "log" else "linear")
        axes.set_title(dim.key, fontsize=9)
        axes.tick_params(labelsize=7)
        axes.minorticks_off()  # log axes' minor ticks cost more to lay out than everything else on the figure
        axes.xaxis.set_major_locator(LogLocator(numticks=3) if dim.scale == "log" else MaxNLocator(3))
    for axes in list(grid.flat)[len(space.dimensions) :]:
        axes.axis("off")
    figure.suptitle(f"{fitness_key} against each searched key (colour: trial order; red: best trial)", fontsize=10)
    return figure


def _save(figure: plt.Figure, path: Path) -> None:
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp.png")
    figure.savefig(tmp, dpi=100)
    plt.close(figure)
    os.replace(tmp, path)
