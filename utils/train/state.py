"""The records of one training run: TrainRun (fixed for the run), TrainState (what epochs mutate), their results."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from utils.callbacks import Callbacks
from utils.data.data_config import DataConfig
from utils.distributed import DistContext
from utils.runs import RunFolderLock
from utils.tasks import Task
from utils.train.config import TrainConfig
from utils.train.ema import ModelEMA
from utils.train.faults import StopSignals
from utils.train.optim import Warmup
from utils.train.setup import Datasets, ModelBundle
from utils.train.startup import StartupClock


@dataclass(frozen=True)
class TrainRun:
    """What stays fixed for one fit(): the options, the task, this process, the data, model and loaders, the folder."""

    cfg: TrainConfig
    task: Task
    ctx: DistContext
    data: DataConfig
    bundle: ModelBundle
    datasets: Datasets
    run_dir: Path
    callbacks: Callbacks
    folder_lock: RunFolderLock | None = None  # rank 0's hold on run_dir (utils/runs.py); engine._end_run frees it

    @property
    def last(self) -> Path:
        """weights/last.pt: written every epoch with the full state, for --resume."""
        return self.run_dir / "weights" / "last.pt"

    @property
    def best(self) -> Path:
        """weights/best.pt: the best fitness so far; stripped to fp16 EMA weights at the end."""
        return self.run_dir / "weights" / "best.pt"

    def fire(self, event: str, **fields: Any) -> None:
        """Tell the run's callbacks of `event` (rank 0; utils/callbacks.py), with the run's folder and options."""
        if self.callbacks.listening(event):  # the options dict only when someone reads it
            self.callbacks.fire(
                event, run_dir=self.run_dir, options=self.cfg.to_dict(), epochs=self.cfg.epochs, **fields
            )

    def figure_written(self, path: Path) -> None:
        """A figure file was written (the drawers' `on_saved`): the on_figure event."""
        self.fire("on_figure", path=path)


@dataclass
class TrainState:
    """Everything one epoch mutates; built once by fit()."""

    model: nn.Module  # unwrapped
    ddp: Callable[..., Any]  # DDP wrapper, or the model itself in one process (GraphedForward with --cuda-graph)
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    scaler: torch.amp.GradScaler
    ema: ModelEMA
    loss_fn: Any  # the task's loss: (preds, *, reduce_counts, **task.loss_inputs(batch)) -> (loss, items)
    loss_inputs: Callable[[dict[str, Any], torch.device], dict[str, torch.Tensor]]  # Task.loss_inputs
    accumulate: int
    warmup: Warmup
    lr_fn: Callable[[int], float]
    amp_dtype: torch.dtype | None  # autocast dtype (fp16 with a GradScaler, bf16 without), None: fp32
    train_loss: Callable[..., Any]  # the step's loss call: loss_fn, or it compiled (engine.compiled_loss)
    keep_grads: bool = False  # zero gradients in place instead of dropping them (--cuda-graph: GraphedForward)
    # --multi-scale: (images, iteration) -> the images at that iteration's size (utils/train/multi_scale.py)
    resize_input: Callable[[torch.Tensor, int], torch.Tensor] | None = None
    last_opt_step: int = -1
    best_fitness: float = 0.0
    start_epoch: int = 0
    start_batch: int = 0  # batches of start_epoch done before a mid-epoch resume
    resumed_mean_loss: np.ndarray | None = None  # this rank's running mean loss at start_batch
    # This rank's NaN/inf losses since the last optimizer step: a device tensor (or 0), read once per step.
    nonfinite_losses: torch.Tensor | int = 0
    steps_since_save: int = 0  # optimizer steps since the last mid-epoch checkpoint
    stop: StopSignals = field(default_factory=StopSignals)  # SIGTERM, SIGUSR1 or Ctrl-C received (fit() installs it)
    startup: StartupClock = field(default_factory=StartupClock)  # logs when the first optimizer step came


@dataclass(frozen=True)
class TrainedEpoch:
    """What `train_one_epoch` measured, over all ranks."""

    mean_loss: np.ndarray  # the task's loss items, mean over all ranks' batches
    images: int  # images trained on this epoch (this session's batches), all ranks together
    seconds: float  # wall time of the training loop, mean over ranks
    data_wait_seconds: float  # of which the loop stood waiting for its next batch (`WaitTimer`), mean over ranks

    def describe(self, world_size: int) -> str:
        """'1,984 images in 31.2 s (63.6 images/s on 1 rank), 2.1% of it waiting for data': the epoch's log line."""
        rate = self.images / self.seconds if self.seconds > 0 else 0.0
        share = self.data_wait_seconds / self.seconds if self.seconds > 0 else 0.0
        ranks = f"{world_size} rank{'s' if world_size > 1 else ''}"
        return (
            f"{self.images:,} images in {self.seconds:.1f} s ({rate:.1f} images/s on {ranks}), "
            f"{share:.1%} of it waiting for data"
        )


@dataclass
class FitResult:
    """What a finished run leaves: where, and the final metrics of best.pt."""

    run_dir: Path
    best: Path
    last: Path
    metrics: dict[str, float]
    epochs_run: int
