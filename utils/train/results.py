"""Per-epoch records: the EpochSummary, results.csv (one row per epoch, rank 0) and early stopping on fitness."""

from __future__ import annotations

import csv
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from utils.distributed import DistContext

if TYPE_CHECKING:
    from utils.tasks import Task

LOGGER = logging.getLogger(__name__)


class ResultsCSV:
    """Append one row per epoch to results.csv on rank 0; other ranks do nothing.

    The header is written with the first row; a resumed run appends to the existing file.
    """

    def __init__(self, path: Path, ctx: DistContext) -> None:
        self.path = path
        self.is_writer = ctx.is_main

    def append(self, row: dict[str, float | int | str]) -> None:
        """Write `row` (column -> value); columns are fixed by the first row written."""
        if not self.is_writer:
            return
        is_new = not self.path.exists() or self.path.stat().st_size == 0
        with self.path.open("a", newline="", encoding="utf-8") as file:
            writer = csv.writer(file)
            if is_new:
                writer.writerow(list(row))
            writer.writerow([f"{v:.6g}" if isinstance(v, float) else v for v in row.values()])

    def keep_epochs(self, num_epochs: int) -> None:
        """Drop the rows of epochs after the first `num_epochs` (rank 0; a resume's restored epoch count).

        A run killed between writing an epoch's row and its checkpoint repeats that epoch when it
        resumes; without this, results.csv would hold the epoch twice. Rewritten atomically.
        """
        if not self.is_writer or not self.path.exists():
            return
        with self.path.open(newline="", encoding="utf-8") as file:
            rows = list(csv.reader(file))
        if not rows:
            return
        kept = [rows[0]] + [row for row in rows[1:] if row and int(row[0]) <= num_epochs]
        if len(kept) == len(rows):
            return
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        with tmp.open("w", newline="", encoding="utf-8") as file:
            csv.writer(file).writerows(kept if len(kept) > 1 else [])
        os.replace(tmp, self.path)

    def read(self) -> list[dict[str, str]]:
        """Return the rows written so far (for plots and tests)."""
        if not self.path.exists():
            return []
        with self.path.open(newline="", encoding="utf-8") as file:
            return list(csv.DictReader(file))


@dataclass(frozen=True)
class EpochSummary:
    """One epoch's figures, as results.csv records them."""

    epoch: int  # 0-based
    train_loss: np.ndarray  # mean of the loss items over all ranks' batches
    val_loss: np.ndarray | None  # None when the epoch was not validated (--noval)
    metrics: dict[str, float]  # EvalResult.as_dict(); empty when not validated
    lrs: list[float]  # per param group, as used during the epoch
    seconds: float

    @property
    def fitness(self) -> float:
        """The number best.pt and early stopping compare (0 when not validated)."""
        return self.metrics.get("fitness", 0.0)

    def as_row(self, task: Task, loss_names: tuple[str, ...]) -> dict[str, Any]:
        """Return the results.csv row: epoch (1-based), train/val losses, metrics, learning rates, time.

        `loss_names` are the run's loss items (its loss's `item_names`, which depend on the model family).
        """
        names = loss_names
        row: dict[str, Any] = {"epoch": self.epoch + 1, **loss_columns("train", names, self.train_loss)}
        for key in (*task.metric_names, "fitness"):
            row[f"metrics/{key}"] = float(self.metrics.get(key, float("nan")))
        values = self.val_loss if self.val_loss is not None else [float("nan")] * len(names)
        row.update(loss_columns("val", names, values))
        row.update(lr_columns(self.lrs))
        row["time_s"] = round(self.seconds, 2)
        return row


def loss_columns(split: str, loss_names: tuple[str, ...], values: Any) -> dict[str, float]:
    """results.csv's `<split>/<name>_loss` columns (split: train or val) of loss items `values`."""
    return {f"{split}/{name}_loss": float(v) for name, v in zip(loss_names, values, strict=True)}


def lr_columns(lrs: list[float]) -> dict[str, float]:
    """results.csv's `lr/pg<i>` columns: each parameter group's learning rate."""
    return {f"lr/pg{i}": float(lr) for i, lr in enumerate(lrs)}


class EarlyStopper:
    """Stop when fitness has not improved for `patience` epochs. Consulted on rank 0 only.

    Its record (`state_dict`) is saved in every checkpoint, so a resumed run stops at the epoch the
    uninterrupted one would have.
    """

    def __init__(self, patience: int) -> None:
        self.patience = patience if patience > 0 else math.inf
        self.best_fitness = -math.inf
        self.best_epoch = 0

    def should_stop(self, epoch: int, fitness: float) -> bool:
        """Record `fitness` for `epoch`; True when the run should end now."""
        if fitness >= self.best_fitness:
            self.best_fitness, self.best_epoch = fitness, epoch
        stop = self.stopped_after(epoch)
        if stop:
            LOGGER.info(f"Early stop: no improvement for {self.patience} epochs, best epoch {self.best_epoch + 1}")
        return stop

    def stopped_after(self, epoch: int) -> bool:
        """Whether the record says stop after `epoch` (0-based): `patience` epochs since the best."""
        return epoch - self.best_epoch >= self.patience

    def state_dict(self) -> dict[str, float | int]:
        """The record as checkpoint data (-inf before any epoch)."""
        return {"best_fitness": float(self.best_fitness), "best_epoch": int(self.best_epoch)}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Continue from a checkpoint's record; the patience stays this run's (--resume --patience may change it)."""
        self.best_fitness, self.best_epoch = float(saved["best_fitness"]), int(saved["best_epoch"])
