"""The one training loop for every task: fit() and train_one_epoch() with AMP, accumulation, EMA and DDP."""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from models.yolo import memory_format
from utils.config import TrainConfig, save_run_config
from utils.data.data_config import load_data_config
from utils.distributed import (
    DistContext,
    all_reduce_sum,
    average_bn_stats,
    broadcast_object,
    run_on_main,
    seed_everything,
    smart_ddp,
)
from utils.errors import ConfigError
from utils.eval.coco import check_coco_target, coco_evaluate
from utils.logs import ResultsCSV, tqdm_disabled
from utils.plots import batch_drawer, plot_run
from utils.runs import create_run_dir
from utils.tasks import Task
from utils.train import checkpoint as ckpt_io
from utils.train.ema import ModelEMA
from utils.train.optim import (
    accumulate_steps,
    apply_warmup,
    build_optimizer,
    build_scheduler,
    lr_lambda,
    scaled_weight_decay,
    warmup_iterations,
)
from utils.train.setup import (
    ModelBundle,
    build_datasets,
    build_model_bundle,
    log_startup,
    resolve_resume,
    run_anchor_check,
    verify_identical_weights,
)

LOGGER = logging.getLogger(__name__)


@dataclass
class TrainState:
    """Everything one epoch mutates; built once by fit()."""

    model: nn.Module  # unwrapped
    ddp: nn.Module  # DDP wrapper, or the model itself in one process
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    scaler: torch.amp.GradScaler
    ema: ModelEMA
    loss_fn: Any
    accumulate: int
    warmup_iters: int
    lr_fn: Any
    use_amp: bool
    last_opt_step: int = -1
    best_fitness: float = 0.0
    start_epoch: int = 0
    nonfinite_losses: int = 0  # this rank's NaN/inf losses since the last optimizer step


@dataclass
class FitResult:
    """What a finished run leaves: where, and the final metrics of best.pt."""

    run_dir: Path
    best: Path
    last: Path
    metrics: dict[str, float]
    epochs_run: int


def train_one_epoch(
    state: TrainState,
    loader: Any,
    epoch: int,
    cfg: TrainConfig,
    ctx: DistContext,
    on_batch: Callable[[int, dict[str, Any]], None] | None = None,
) -> np.ndarray:
    """Train one epoch; return the mean loss items over all ranks' batches.

    `on_batch(i, batch)`, when given, sees each batch as the loader yields it, before training
    on it (fit() draws the first ones); it must not run collectives.

    One optimiser step per `accumulate` micro-batches. Micro-batches that do not end an
    accumulation run under DDP's no_sync(), so gradients are all-reduced once per step, and the
    loss is multiplied by the world size so DDP's averaged gradient matches one process with the
    global batch; the loss normalises by match counts averaged over ranks, so this holds exactly
    even when ranks match different numbers of anchors. The step decision depends only on the
    iteration number, so ranks agree.
    """
    state.model.train()
    num_batches = len(loader)
    # Every rank runs the same number of steps, so the loss may all-reduce its match counts.
    reduce_counts = (lambda counts: all_reduce_sum(counts, ctx) / ctx.world_size) if ctx.is_distributed else None
    mean_loss = np.zeros(len(state.loss_fn.item_names))
    progress = tqdm(loader, total=num_batches, desc=f"epoch {epoch + 1}/{cfg.epochs}", disable=tqdm_disabled(ctx))
    for i, batch in enumerate(progress):
        if on_batch is not None:
            on_batch(i, batch)
        iteration = i + num_batches * epoch
        images = batch["images"].to(ctx.device, non_blocking=True).float() / 255
        accumulate = _accumulate_now(state, iteration, cfg)
        if iteration <= state.warmup_iters:
            apply_warmup(
                state.optimizer,
                iteration,
                state.warmup_iters,
                epoch,
                state.lr_fn,
                cfg.hyp.warmup_bias_lr,
                cfg.hyp.warmup_momentum,
                cfg.hyp.momentum,
            )
        is_step = iteration - state.last_opt_step >= accumulate
        sync_context = state.ddp.no_sync() if ctx.is_distributed and not is_step else contextlib.nullcontext()
        with sync_context:
            with torch.autocast(ctx.device.type, dtype=torch.float16, enabled=state.use_amp):
                preds = state.ddp(images)
                extra = {"masks": batch["masks"].to(ctx.device, non_blocking=True)} if "masks" in batch else {}
                loss, items = state.loss_fn(preds, batch["targets"].to(ctx.device), reduce_counts, **extra)
            state.scaler.scale(loss * ctx.world_size).backward()
        state.nonfinite_losses += not math.isfinite(float(loss.detach()))
        if is_step:
            # Before the weights change: a bad micro-batch on any rank has already reached every rank's
            # gradients through DDP's all-reduce, so every rank stops here together (one 2-number
            # all-reduce per optimizer step), not just the rank that saw it, with the others
            # waiting in the next step's all-reduce until the process-group timeout.
            _stop_if_nonfinite(state, ctx, f"the optimizer step at epoch {epoch + 1} batch {i + 1}")
            _optimizer_step(state)
            state.last_opt_step = iteration
        mean_loss = (mean_loss * i + items.cpu().numpy()) / (i + 1)
        if not tqdm_disabled(ctx):
            progress.set_postfix_str(" ".join(f"{v:.4f}" for v in mean_loss) + f" inst={len(batch['targets'])}")
    # Micro-batches after the epoch's last step: stop now, before BN averaging, validation and saving.
    _stop_if_nonfinite(state, ctx, f"the end of epoch {epoch + 1}")
    if ctx.is_distributed:  # results.csv reports every rank's batches (ranks run equally many)
        summed = all_reduce_sum(torch.tensor(mean_loss, dtype=torch.float64, device=ctx.device), ctx)
        mean_loss = summed.cpu().numpy() / ctx.world_size
    return mean_loss


def _stop_if_nonfinite(state: TrainState, ctx: DistContext, where: str) -> None:
    """Raise FloatingPointError on every rank when any rank had a NaN/inf loss since the last step.

    Every rank must call it at the same point (each optimizer step, and the end of each epoch).
    The pending step is not taken, so the weights, the EMA and the checkpoints saved so far (at
    the end of earlier epochs) stay finite.
    """
    counts = [state.nonfinite_losses, int(state.nonfinite_losses > 0)]
    if ctx.is_distributed:
        counts = all_reduce_sum(torch.tensor(counts, device=ctx.device), ctx).tolist()
    bad_batches, bad_ranks = counts
    if bad_batches:
        ranks = f" on {bad_ranks} of {ctx.world_size} ranks" if ctx.is_distributed else ""
        raise FloatingPointError(
            f"loss is NaN or inf in {bad_batches} batch(es){ranks} before {where}; stopped without applying "
            "them (checkpoints saved so far are from earlier epochs); lower lr0 or check the labels"
        )


def _accumulate_now(state: TrainState, iteration: int, cfg: TrainConfig) -> int:
    """Accumulation steps at `iteration`: ramps from 1 to the nominal value during warmup."""
    if iteration > state.warmup_iters:
        return state.accumulate
    global_batch = cfg.batch_size
    return max(1, int(np.interp(iteration, [0, state.warmup_iters], [1, cfg.hyp.nbs / global_batch]).round()))


def _optimizer_step(state: TrainState) -> None:
    state.scaler.unscale_(state.optimizer)
    torch.nn.utils.clip_grad_norm_(state.model.parameters(), max_norm=10.0, foreach=True)
    state.scaler.step(state.optimizer)
    state.scaler.update()
    state.optimizer.zero_grad(set_to_none=True)
    state.ema.update(state.model)


def build_train_state(bundle: ModelBundle, cfg: TrainConfig, task: Task, ctx: DistContext, batches: int) -> TrainState:
    """Wrap the model for DDP, then create optimizer, LR schedule, scaler, EMA and loss identically on every rank."""
    model = bundle.model
    nominal = int(cfg.hyp.nbs)
    accumulate = accumulate_steps(cfg.batch_size, nominal)
    # Accumulation (also during warmup's ramp) uses no_sync(), which static_graph does not support.
    ddp = smart_ddp(model, ctx, sync_bn=cfg.sync_bn, static_graph=cfg.batch_size >= nominal)
    weight_decay = scaled_weight_decay(cfg.hyp.weight_decay, cfg.batch_size, accumulate, nominal)
    optimizer = build_optimizer(model, cfg.optimizer, cfg.hyp.lr0, cfg.hyp.momentum, weight_decay)
    lr_fn = lr_lambda(cfg.epochs, cfg.hyp.lrf, cfg.cos_lr)
    scheduler = build_scheduler(optimizer, lr_fn)
    use_amp = ctx.device.type == "cuda"
    scaler = torch.amp.GradScaler(ctx.device.type, enabled=use_amp)
    ema = ModelEMA(model)
    loss_fn = task.build_loss(model, cfg)
    warmup = warmup_iterations(cfg.hyp.warmup_epochs, batches)
    return TrainState(model, ddp, optimizer, scheduler, scaler, ema, loss_fn, accumulate, warmup, lr_fn, use_amp)


def restore_state(state: TrainState, checkpoint: dict[str, Any], cfg: TrainConfig, batches: int) -> None:
    """Load model, optimizer, scaler, EMA, epoch and best fitness from a checkpoint into `state` (every rank).

    The LR schedule is rebuilt at the resumed epoch, so it continues where it stopped.
    """
    state.start_epoch = ckpt_io.restore_training_state(
        checkpoint, state.model, state.optimizer, state.scaler, state.ema
    )
    if state.start_epoch >= cfg.epochs:
        raise ConfigError(f"--resume: the run already finished all {cfg.epochs} epochs; nothing to resume")
    state.scheduler = build_scheduler(state.optimizer, state.lr_fn, state.start_epoch)
    state.best_fitness = float(checkpoint.get("best_fitness", 0.0))
    state.last_opt_step = state.start_epoch * batches - 1


def checkpoint_state(state: TrainState, bundle: ModelBundle, cfg: TrainConfig, epoch: int, task: Task) -> dict:
    """Return the checkpoint for the end of `epoch`: plain data and state dicts only."""
    run = ckpt_io.RunInfo(task.name, bundle.spec.to_dict(), bundle.names, cfg.to_dict(), cfg.hyp.to_dict())
    return ckpt_io.build_checkpoint(
        run=run,
        model=state.model,
        ema=state.ema,
        optimizer=state.optimizer,
        scaler=state.scaler,
        epoch=epoch,
        best_fitness=state.best_fitness,
    )


class EarlyStopper:
    """Stop when fitness has not improved for `patience` epochs. Consulted on rank 0 only."""

    def __init__(self, patience: int) -> None:
        self.patience = patience if patience > 0 else math.inf
        self.best_fitness = -math.inf
        self.best_epoch = 0

    def should_stop(self, epoch: int, fitness: float) -> bool:
        """Record `fitness` for `epoch`; True when the run should end now."""
        if fitness >= self.best_fitness:
            self.best_fitness, self.best_epoch = fitness, epoch
        stop = epoch - self.best_epoch >= self.patience
        if stop:
            LOGGER.info(f"Early stop: no improvement for {self.patience} epochs, best epoch {self.best_epoch + 1}")
        return stop


def fit(cfg: TrainConfig, task: Task, ctx: DistContext) -> FitResult:
    """Train `task` with options `cfg` on this rank; every rank of the job calls it.

    Rank 0 writes the run folder, checkpoints and results.csv; decisions that end the loop are
    taken on rank 0 and broadcast, so every rank leaves at the same epoch.
    """
    cfg, resume_ckpt = resolve_resume(cfg, ctx)
    seed_everything(cfg.seed + ctx.rank, cfg.deterministic)
    run_dir = create_run_dir(cfg.project, cfg.name, cfg.exist_ok or resume_ckpt is not None, ctx, subdirs=("weights",))
    save_run_config(cfg, run_dir, ctx)
    data = load_data_config(cfg.data, ctx)
    # A bad annotations file fails now, not after training; the parsed file is not kept (it can be large).
    check_coco_target(data, "val", ctx, cfg.single_cls)
    bundle = build_model_bundle(cfg, task, data, ctx, resume_ckpt)
    datasets = build_datasets(cfg, task, data, bundle, ctx)
    if resume_ckpt is None and not cfg.weights:
        run_anchor_check(bundle, datasets.train, cfg, ctx)
    state = build_train_state(bundle, cfg, task, ctx, len(datasets.train_loader))
    verify_identical_weights(state.model, ctx)
    if resume_ckpt is not None:
        restore_state(state, resume_ckpt, cfg, len(datasets.train_loader))
        del resume_ckpt
    log_startup(cfg, bundle, datasets, state.accumulate, ctx)
    weights_dir = run_dir / "weights"
    last, best = weights_dir / "last.pt", weights_dir / "best.pt"
    results = ResultsCSV(run_dir / "results.csv", ctx)
    stopper = EarlyStopper(cfg.patience)
    epoch = state.start_epoch
    for epoch in range(state.start_epoch, cfg.epochs):
        start = time.time()
        datasets.train_loader.set_epoch(epoch)
        if epoch == datasets.train.options.close_mosaic_epoch and datasets.train.use_mosaic:
            closed = cfg.epochs - epoch
            LOGGER.info(f"Closing mosaic: the last {closed} epoch(s) train on single letterboxed images")
        draw = batch_drawer(run_dir, bundle.names) if ctx.is_main and not cfg.noplots and epoch == 0 else None
        train_loss = train_one_epoch(state, datasets.train_loader, epoch, cfg, ctx, on_batch=draw)
        lrs = [group["lr"] for group in state.optimizer.param_groups]
        state.scheduler.step()
        # Per-rank BN (CPU, or no --sync-bn): every rank averages statistics before eval and save.
        average_bn_stats(state.model, ctx)
        average_bn_stats(state.ema.ema, ctx)
        is_final = epoch + 1 == cfg.epochs
        metrics, val_loss = _validate(state, task, datasets, bundle, cfg, ctx, run=not cfg.noval or is_final)
        fitness = metrics.get("fitness", 0.0)
        state.best_fitness = max(state.best_fitness, fitness)
        results.append(_results_row(epoch, train_loss, val_loss, metrics, lrs, task, time.time() - start))
        if not cfg.nosave or is_final:
            _save(state, bundle, cfg, task, epoch, fitness, ctx, weights_dir)
        stop = broadcast_object(stopper.should_stop(epoch, fitness) if ctx.is_main else False, ctx)
        if stop:
            break
    # best.pt is the deliverable: fp16 EMA weights, no optimizer (several times smaller). last.pt keeps
    # its full state, so an early-stopped run can still be resumed. Validated after stripping, so
    # val.py on best.pt evaluates the same weights.
    run_on_main(lambda: best.exists() and ckpt_io.strip_optimizer(best, ctx), ctx, "stripping best.pt")
    final, best, result = _final_validation((best, last), task, datasets, bundle, ctx, (cfg, data, run_dir))
    if ctx.is_main and not cfg.noplots:  # after the last collective: nothing waits on rank 0 here
        plot_run(results, result, bundle.names, run_dir)
    return FitResult(run_dir, best, last, final, epoch + 1 - state.start_epoch)


def _validate(state, task, datasets, bundle, cfg, ctx, run: bool) -> tuple[dict[str, float], np.ndarray | None]:
    if not run:
        return {}, None
    from utils.eval.evaluate import EvalOptions

    options = EvalOptions(num_classes=len(bundle.names), description="val")
    result = task.evaluate(state.ema.ema, datasets.val_loader, options, ctx, state.loss_fn)
    LOGGER.info(f"val: {_scores_line(result.as_dict())}")
    return result.as_dict(), result.loss_items


def _scores_line(metrics: dict[str, float]) -> str:
    """Return 'P .. R .. mAP50 .. mAP50-95 ..' for boxes, and the same for masks when present."""
    groups = [("", "")] + ([(" | mask ", "mask_")] if "mask_mAP50" in metrics else [])
    return "".join(
        f"{title}P {metrics[prefix + 'precision']:.3f} R {metrics[prefix + 'recall']:.3f} "
        f"mAP50 {metrics[prefix + 'mAP50']:.3f} mAP50-95 {metrics[prefix + 'mAP50-95']:.3f}"
        for title, prefix in groups
    )


def _results_row(epoch, train_loss, val_loss, metrics, lrs, task, seconds) -> dict[str, Any]:
    row: dict[str, Any] = {"epoch": epoch + 1}
    row.update({f"train/{name}_loss": float(v) for name, v in zip(task.loss_names, train_loss, strict=False)})
    for key in (*task.metric_names, "fitness"):
        row[f"metrics/{key}"] = float(metrics.get(key, float("nan")))
    values = val_loss if val_loss is not None else [float("nan")] * len(task.loss_names)
    row.update({f"val/{name}_loss": float(v) for name, v in zip(task.loss_names, values, strict=False)})
    row.update({f"lr/pg{i}": float(lr) for i, lr in enumerate(lrs)})
    row["time_s"] = round(seconds, 2)
    return row


def _save(state, bundle, cfg, task, epoch, fitness, ctx, weights_dir: Path) -> None:
    """Write last.pt, best.pt when fitness is the best so far, and periodic copies; rank 0 only."""
    if not ctx.is_main:
        return
    checkpoint = checkpoint_state(state, bundle, cfg, epoch, task)
    ckpt_io.save_checkpoint(checkpoint, weights_dir / "last.pt", ctx)
    if fitness >= state.best_fitness:
        ckpt_io.save_checkpoint(checkpoint, weights_dir / "best.pt", ctx)
    if cfg.save_period > 0 and (epoch + 1) % cfg.save_period == 0:
        ckpt_io.save_checkpoint(checkpoint, weights_dir / f"epoch{epoch + 1}.pt", ctx)


def _final_validation(weights_paths, task, datasets, bundle, ctx, run) -> tuple[dict[str, float], Path, Any]:
    """Validate the EMA weights of best.pt (last.pt when --nosave never wrote a best) once more.

    `weights_paths` = (best, last); `run` = (cfg, data, run_dir). Returns the metrics, the checkpoint
    they belong to and the EvalResult (curves; a confusion matrix too unless --noplots). When the dataset YAML names
    COCO annotations for the val split, predictions.json and coco_eval.json are written to the
    run folder and the mAPs come from pycocotools. Every rank takes part. Only rank 0 is sure to
    see the file (other nodes may not share the filesystem), so rank 0 reads the weights and
    broadcasts them.
    """
    from utils.eval.evaluate import EvalOptions

    best, last = weights_paths
    cfg, data, run_dir = run
    path = Path(broadcast_object(str(best if best.exists() else last) if ctx.is_main else None, ctx))
    read = run_on_main(lambda: ckpt_io.inference_weights(ckpt_io.load_checkpoint(path)), ctx, f"reading {path}")
    weights = broadcast_object(read, ctx)
    model = task.build_model(bundle.spec).to(ctx.device)
    model.load_state_dict(weights)
    # Fused and laid out as val.py does (same batch size there gives the same numbers).
    model = model.fuse().to(memory_format=memory_format(cfg.channels_last))
    use_coco = data.annotations.get("val") is not None
    options = EvalOptions(
        num_classes=len(bundle.names), description="final val", collect_predictions=use_coco, confusion=not cfg.noplots
    )
    result = task.evaluate(model, datasets.val_loader, options, ctx)
    if use_coco:
        result = coco_evaluate(result, data, "val", run_dir, ctx, single_cls=cfg.single_cls)
    metrics = {key: float(value) for key, value in result.as_dict().items()}
    LOGGER.info(f"Final ({path}, {result.metric_source} mAP): {_scores_line(metrics)}")
    return metrics, path, result
