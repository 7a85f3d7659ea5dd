"""The records of one training run: TrainRun (fixed for the run), TrainState (what epochs mutate), how it is built."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from utils.callbacks import Callbacks
from utils.config import AUTO
from utils.data.data_config import DataConfig
from utils.distributed import DistContext, smart_ddp
from utils.runs import RunFolderLock
from utils.tasks import Task
from utils.train.config import TrainConfig, autocast_dtype
from utils.train.cuda_graph import graphed_forward
from utils.train.ema import ModelEMA
from utils.train.faults import StopSignals
from utils.train.multi_scale import multi_scale_resizer
from utils.train.optim import (
    Warmup,
    accumulate_steps,
    build_optimizer,
    build_scheduler,
    lr_lambda,
    scaled_weight_decay,
    warmup_iterations,
)
from utils.train.records import TrainingTask
from utils.train.results import EarlyStopper
from utils.train.setup import Datasets, ModelBundle
from utils.train.startup import StartupClock

LOGGER = logging.getLogger(__name__)


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
    unsaved_state: set[str] = field(default_factory=set)  # callback state keys warned about as not saved (once each)
    trains: bool = True  # False: a torchrun restart after the last epoch's save only finishes the run

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
    train_loss: Callable[..., Any]  # the step's loss call: loss_fn, or it compiled (state.compiled_loss)
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
    stopper: EarlyStopper = field(default_factory=lambda: EarlyStopper(0))  # --patience (rank 0 decides)


@dataclass(frozen=True)
class TrainedEpoch:
    """What `train_one_epoch` measured, over all ranks."""

    mean_loss: np.ndarray  # the task's loss items, mean over all ranks' batches
    images: int  # images trained on this epoch (this session's batches), all ranks together
    seconds: float  # wall time of the training loop, mean over ranks
    data_wait_seconds: float  # of which the loop stood waiting for its next batch (`WaitTimer`), mean over ranks
    batches: int  # the epoch's batches, resumed ones too: where a checkpoint of its end says it stands
    rank_mean_loss: np.ndarray  # this rank's own mean loss items, as a mid-epoch checkpoint keeps them

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
    epochs_run: int  # epochs this call trained (after a resume, those it had left)
    epochs_done: int = 0  # epochs the run has trained in all, before a resume too

    def describe_epochs(self) -> str:
        """'3 epochs', or after a resume '3 epochs (1 after the resume)'."""
        resumed = f" ({self.epochs_run} after the resume)" if self.epochs_done != self.epochs_run else ""
        return f"{self.epochs_done} epochs{resumed}"


def build_train_state(
    bundle: ModelBundle, cfg: TrainConfig, training: TrainingTask, ctx: DistContext, batches: int
) -> TrainState:
    """Wrap the model for DDP, then create optimizer, LR schedule, scaler, EMA and loss identically on every rank.

    `cfg` must name a concrete optimizer and hyp (fit() resolves `auto` first: resolve_run_recipe).
    """
    assert cfg.hyp is not None and cfg.optimizer != AUTO, "build_train_state: resolve the recipe first"
    model = bundle.model
    nominal = int(cfg.hyp.nbs)
    accumulate = accumulate_steps(cfg.batch_size, nominal)
    # Accumulation (also during warmup's ramp) uses no_sync(), which static_graph does not support.
    ddp = compiled_forward(smart_ddp(model, ctx, sync_bn=cfg.sync_bn, static_graph=cfg.batch_size >= nominal), cfg)
    amp_dtype = autocast_dtype(cfg.amp, ctx.device)
    ddp = graphed_forward(ddp, cfg.cuda_graph, amp_dtype)  # one process only (validate)
    weight_decay = scaled_weight_decay(cfg.hyp.weight_decay, cfg.batch_size, accumulate, nominal)
    optimizer = build_optimizer(model, cfg.optimizer, cfg.hyp.lr0, cfg.hyp.momentum, weight_decay)
    lr_fn = lr_lambda(cfg.epochs, cfg.hyp.lrf, cfg.cos_lr)
    scheduler = build_scheduler(optimizer, lr_fn)
    # bf16 has fp32's exponent range: no loss scaling needed. fp16 needs the GradScaler.
    scaler = torch.amp.GradScaler(ctx.device.type, enabled=amp_dtype == torch.float16)
    ema = ModelEMA(model)
    loss_fn = training.build_loss(model, cfg)
    warmup = Warmup.from_hyp(cfg.hyp, warmup_iterations(cfg.hyp.warmup_epochs, batches))
    loss_inputs = training.task.loss_inputs
    return TrainState(
        model,
        ddp,
        optimizer,
        scheduler,
        scaler,
        ema,
        loss_fn,
        loss_inputs,
        accumulate,
        warmup,
        lr_fn,
        amp_dtype,
        train_loss=compiled_loss(loss_fn, cfg),
        keep_grads=cfg.cuda_graph,
        # Sides in multiples of the largest stride, so every level's grid stays whole.
        resize_input=multi_scale_resizer(cfg.imgsz, int(model.stride.max()), cfg.seed) if cfg.multi_scale else None,
        stopper=EarlyStopper(cfg.patience),
    )


def compiled_forward(forward: nn.Module, cfg: TrainConfig) -> nn.Module:
    """`forward` (the DDP module, or the model in one process) under torch.compile with --compile's mode.

    The training forward is one graph for every family (no data-dependent Python); the loss is compiled
    apart, and only when it is one graph too (`compiled_loss`). Compiling the DDP module lets dynamo
    split the graph at DDP's gradient buckets, so the all-reduce still overlaps backward. The bare model
    stays what the EMA, validation and checkpoints use, so saved weights carry no `_orig_mod.` prefix
    and resume either way.
    """
    if not cfg.compile_mode:
        return forward
    LOGGER.info(f"torch.compile (mode {cfg.compile_mode}) of the training forward: the first steps compile")
    return torch.compile(forward, mode=cfg.compile_mode)


def compiled_loss(loss_fn: Any, cfg: TrainConfig) -> Any:
    """The training step's loss call: `loss_fn`, under torch.compile with --compile's mode when it is one graph.

    A loss is one graph (`loss_fn.one_graph`) with --static-loss-shapes and no mask term: the default
    candidate search's `nonzero` has data-dependent shapes, which break the graph and recompile as label
    counts change. The label count is a dynamic size after its second value, so the loss compiles twice.
    Evaluation and the engine's bookkeeping (item names, start_epoch) use `loss_fn` itself.
    """
    if not cfg.compile_mode or not getattr(loss_fn, "one_graph", False):
        return loss_fn
    LOGGER.info(f"torch.compile (mode {cfg.compile_mode}) of the training loss (--static-loss-shapes)")
    return torch.compile(loss_fn, mode=cfg.compile_mode)
