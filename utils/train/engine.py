"""The one training loop for every task: fit() and train_one_epoch() with AMP, accumulation, EMA and DDP."""

from __future__ import annotations

import dataclasses
import logging
import re
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

import numpy as np
import torch

from models.model_info import memory_format
from utils import checkpoint as ckpt_io
from utils.callbacks import Callbacks, load_callback_modules
from utils.config import stride_multiples
from utils.data.shm_cache import ShmImageCache
from utils.distributed import (
    DistContext,
    average_bn_stats,
    broadcast_object,
    run_on_main,
    seed_everything,
)
from utils.errors import ConfigError, Preempted
from utils.eval.coco import check_coco_target, coco_evaluate
from utils.eval.evaluate import EvalInterrupted, EvalOptions, EvalResult
from utils.families import build_model
from utils.logs import tqdm_disabled
from utils.plots import batch_drawer, plot_run, plot_start, val_batch_drawer
from utils.train.config import TrainConfig
from utils.train.mlflow_logger import MLflowLogger, mlflow_wanted
from utils.train.plan import plan_run, training_ended
from utils.train.records import TrainingTask
from utils.train.results import EpochSummary, ResultsCSV, loss_columns, lr_columns
from utils.train.saving import ResumePoint, open_run_dir, restore_state, resume_point, save_epoch, save_mid_epoch
from utils.train.setup import (
    build_datasets,
    build_model_bundle,
    log_startup,
    verify_identical_weights,
)
from utils.train.state import FitResult, TrainedEpoch, TrainRun, TrainState, build_train_state
from utils.train.step import train_one_epoch
from utils.train.tensorboard import TensorBoardLogger
from utils.train.wandb_logger import WandbLogger, wandb_wanted

LOGGER = logging.getLogger(__name__)


def fit(cfg: TrainConfig, training: TrainingTask, ctx: DistContext, callbacks: Callbacks | None = None) -> FitResult:
    """Train `training`'s task with options `cfg` on this rank; every rank of the job calls it.

    Rank 0 writes the run folder, checkpoints, results.csv and the plots, and tells `callbacks`
    (with those of `--callbacks` modules, TensorBoard, MLflow and W&B when enabled) of the run's events;
    decisions that end the loop are taken on rank 0 and broadcast, so every rank leaves at the
    same epoch.
    """
    run, state = _start_run(cfg, training, ctx, callbacks or Callbacks())
    error: BaseException | None = None
    try:
        result = _train_epochs(run, state)
        run.fire("on_train_end", result=result, metrics=result.metrics)
        return result
    except BaseException as raised:
        error = raised
        raise
    finally:
        _end_run(run, error)
        state.stop.release_workers()  # the loaders are closed: no worker is left to keep a stop signal from


def _end_run(run: TrainRun, error: BaseException | None) -> None:
    """Stop the loaders' workers (after a stop too: they would otherwise run on), tear down, free the folder.

    A run that ended without an error frees the node's --cache shm segment now; after an error the
    process's exit decides (kept when torchrun will restart the workers, see utils/data/shm_cache.py).
    """
    run.datasets.train_loader.close()
    run.datasets.val_loader.close()
    if error is None and isinstance(run.datasets.train.cache, ShmImageCache):
        run.datasets.train.cache.release()
    try:
        run.fire("teardown", error=error)
    finally:
        if run.folder_lock is not None:
            run.folder_lock.release()


def _start_run(
    cfg: TrainConfig, training: TrainingTask, ctx: DistContext, callbacks: Callbacks
) -> tuple[TrainRun, TrainState]:
    """Everything before the first epoch: options resolved, model, recipe, run folder, data, state, callbacks."""
    task = training.task
    plan = plan_run(cfg, training, ctx)
    cfg, resume_ckpt, data, family = plan.cfg, plan.resume, plan.data, plan.family
    ended, hint = training_ended(resume_ckpt, cfg) if resume_ckpt is not None else ("", "")
    if ended and not plan.restarted:  # before anything is built or written
        raise ConfigError(f"--resume: {Path(cfg.resume).parent.parent} {ended}; nothing to resume ({hint})")
    if ended:  # the first attempt died after its last epoch's save: in the final validation, say
        LOGGER.warning(
            f"torchrun restart: {Path(cfg.resume).parent.parent} {ended}; finishing the run: best.pt, its final "
            "validation and the plots"
        )
    seed_everything(cfg.seed + ctx.rank, cfg.deterministic)
    if ctx.device.type == "cuda" and not cfg.deterministic and not cfg.rect and not cfg.multi_scale:
        torch.backends.cudnn.benchmark = True  # fixed input shapes: cuDNN times its kernels once and keeps the best
    bundle = build_model_bundle(plan, ctx)
    # --imgsz was rounded to 32 when parsed; a P6 model's sides must be multiples of 64 (YOLOv5 rounds up too).
    cfg = dataclasses.replace(cfg, imgsz=stride_multiples((cfg.imgsz,), "--imgsz", int(bundle.model.stride.max()))[0])
    # Before the run folder too: a --callbacks module that does not import fails the run before it writes anything.
    modules = load_callback_modules(cfg.callbacks)
    # A bad annotations file fails now, not after training; the parsed file is not kept (it can be large).
    check_coco_target(data, "val", ctx, cfg.single_cls)
    # Before the run folder too: bad labels (class ids past `names`, a train set without labels) leave no folder.
    datasets = build_datasets(cfg, task, data, bundle, ctx)
    run_dir, folder_lock = open_run_dir(cfg, resume_ckpt is not None, ctx)
    try:
        # The workers start now and build the first batches while the rest of the set-up runs (not after it).
        # A fresh run skips the geometry: its digest hashes every image path.
        start_batch = 0
        if not ended:
            point = resume_point(resume_ckpt, datasets.train_loader.geometry) if resume_ckpt else ResumePoint()
            start_batch = datasets.train_loader.start(point.epoch, point.batch, point.seen)
        callbacks = _run_callbacks(cfg, run_dir, ctx, modules, callbacks)
    except BaseException:
        datasets.train_loader.close()
        if folder_lock is not None:
            folder_lock.release()
        raise
    run = TrainRun(cfg, task, ctx, data, bundle, datasets, run_dir, callbacks, folder_lock, trains=not ended)
    try:  # from here on the callbacks are open (a TensorBoard writer): a failure is their teardown too
        if plan.from_scratch:  # e.g. AutoAnchor for YOLOv5; before DDP and the EMA copy it
            family.prepare_run(bundle.model, datasets.train, cfg.hyp, cfg.imgsz, ctx, not cfg.noautoanchor)
        # Warmup and the step count run over whole epochs: not len(), which a mid-epoch start shortens.
        batches_per_epoch = datasets.train_loader.batches_per_epoch
        state = build_train_state(bundle, cfg, training, ctx, batches_per_epoch)
        verify_identical_weights(state.model, ctx)
        if resume_ckpt is not None:
            restore_state(state, resume_ckpt, cfg, batches_per_epoch, ctx, start_batch)
            callbacks.state.update(resume_ckpt.get("callback_state") or {})
            del resume_ckpt, plan  # the checkpoint's tensors are in the model and optimizer now
        log_startup(cfg, bundle, datasets, state.accumulate, ctx)
        if ctx.is_main and not tqdm_disabled(ctx):  # the progress bar's numbers have no room for their names
            names = " ".join(state.loss_fn.item_names)
            LOGGER.info(f"progress bars show the epoch's mean {names} so far and inst, the labels of the last batch")
        run.fire("on_pretrain_routine_end", epoch=state.start_epoch)
    except BaseException as error:
        _end_run(run, error)
        raise
    return run, state


def _train_epochs(run: TrainRun, state: TrainState) -> FitResult:
    """The epochs from `state.start_epoch`, results.csv, checkpoints and early stopping, then best.pt's final val."""
    cfg, ctx, task = run.cfg, run.ctx, run.task
    plots = ctx.is_main and not cfg.noplots
    if plots and state.start_epoch == 0:  # each rank's dataset holds every label (only images are sharded)
        for path in plot_start(run.datasets.train.labels, run.bundle.names, run.run_dir):
            run.figure_written(path)
    results = ResultsCSV(run.run_dir / "results.csv", ctx)
    # Rows of epochs after the checkpoint (written before a crash) would be repeated: drop them.
    run_on_main(lambda: results.keep_epochs(state.start_epoch), ctx, "trimming results.csv")
    epoch = state.start_epoch - 1  # the last epoch trained
    with state.stop:
        for epoch in range(state.start_epoch, cfg.epochs if run.trains else 0):
            summary = _run_epoch(run, state, epoch)
            row = summary.as_row(task, state.loss_fn.item_names)
            run_on_main(lambda row=row: results.append(row), ctx, "writing results.csv")
            run.fire("on_fit_epoch_end", epoch=epoch + 1, row=dict(row))
            stop_here = state.stopper.should_stop(epoch, summary.fitness) if ctx.is_main else False
            stopping = broadcast_object(stop_here, ctx)
            if not cfg.nosave or epoch + 1 == cfg.epochs or stopping:  # an early stop's epoch is the final one
                save_epoch(run, state, epoch, summary.fitness)
                run.fire("on_model_save", epoch=epoch + 1, path=run.last)
            if stopping:
                break
    # best.pt is the deliverable: fp16 EMA weights, no optimizer (several times smaller). last.pt keeps
    # its full state, so an early-stopped run can still be resumed. Validated after stripping, so
    # val.py on best.pt evaluates the same weights.
    best = run.best
    run_on_main(lambda: best.exists() and ckpt_io.strip_optimizer(best, ctx), ctx, "stripping best.pt")
    validated, result = _final_validation(run)
    if plots:  # after the last collective: nothing waits on rank 0 here
        for path in plot_run(results, result, run.bundle.names, run.run_dir):
            run.figure_written(path)
    metrics = {key: float(value) for key, value in result.as_dict().items()}
    return FitResult(run.run_dir, validated, run.last, metrics, epoch + 1 - state.start_epoch, epoch + 1)


def _run_callbacks(
    cfg: TrainConfig, run_dir: Path, ctx: DistContext, modules: Callbacks, given: Callbacks
) -> Callbacks:
    """The run's callbacks in calling order: TensorBoard, MLflow, W&B, --callbacks modules', `given` (train.run's)."""
    # A copy: one Callbacks object given to train.run again must not hand this run's state (MLflow's run id,
    # W&B's) to the next, unrelated run; a resumed run gets its own back from the checkpoint.
    callbacks = Callbacks(state=dict(given.state), enabled=ctx.is_main)
    if ctx.is_main:
        callbacks.add_object(TensorBoardLogger(run_dir, ctx))
        if mlflow_wanted(cfg.mlflow):
            callbacks.add_object(MLflowLogger(explicit=cfg.mlflow))
        if wandb_wanted(cfg.wandb):
            callbacks.add_object(WandbLogger(explicit=cfg.wandb))
    callbacks.merge(modules)
    callbacks.merge(given)
    return callbacks


def _run_epoch(run: TrainRun, state: TrainState, epoch: int) -> EpochSummary:
    """Train one epoch, average BN statistics over ranks, validate (unless --noval), and summarise it.

    The first epoch's first batches are drawn (train_batch*.jpg, each an on_figure event).
    """
    cfg, ctx, datasets = run.cfg, run.ctx, run.datasets
    start = time.time()
    datasets.train_loader.set_epoch(epoch, state.start_batch if epoch == state.start_epoch else 0)
    if epoch == datasets.train.options.close_mosaic_epoch and datasets.train.use_mosaic:
        LOGGER.info(f"Closing mosaic: the last {cfg.epochs - epoch} epoch(s) train on single letterboxed images")
    draws = ctx.is_main and not cfg.noplots and epoch == 0 and state.start_batch == 0
    draw = batch_drawer(run.run_dir, run.bundle.names, on_saved=run.figure_written) if draws else None

    def save_now(batches_done: int, mean_loss: np.ndarray) -> Path:
        path = save_mid_epoch(run, state, epoch, batches_done, mean_loss)
        # Every write of last.pt is an on_model_save: a follower copying it off the node needs the preemption save most.
        run.fire("on_model_save", epoch=epoch + 1, path=path, batch=batches_done)
        return path

    run.fire("on_train_epoch_start", epoch=epoch + 1)
    state.loss_fn.start_epoch(epoch, cfg.epochs)  # e.g. an end-to-end model's branch weights (resume-safe)
    trained = train_one_epoch(state, datasets.train_loader, epoch, cfg, ctx, draw, save_now)
    LOGGER.info(f"train: {trained.describe(ctx.world_size)}")
    lrs = [group["lr"] for group in state.optimizer.param_groups]
    train_row = {**loss_columns("train", state.loss_fn.item_names, trained.mean_loss), **lr_columns(lrs)}
    run.fire("on_train_epoch_end", epoch=epoch + 1, row=train_row)
    # Per-rank BN (CPU, or no --sync-bn): every rank averages statistics before eval and save.
    average_bn_stats(state.model, ctx)
    average_bn_stats(state.ema.ema, ctx)
    metrics, val_loss = {}, None
    if not cfg.noval or epoch + 1 == cfg.epochs:
        options = EvalOptions(
            num_classes=len(run.bundle.names),
            multi_label=cfg.multi_label,
            description="val",
            interrupt=lambda: state.stop.received is not None,
        )
        try:
            result = run.task.evaluate(state.ema.ema, datasets.val_loader, options, ctx, state.loss_fn)
        except EvalInterrupted as interrupted:
            _stop_unvalidated(state, epoch, trained, save_now, interrupted, ctx)
        LOGGER.info(f"val: {_scores_line(result.as_dict())}")
        metrics, val_loss = result.as_dict(), result.loss_items
        run.fire("on_val_end", epoch=epoch + 1, metrics=dict(metrics))
    # After validation: a stop there saves the epoch's end, whose learning rates are its last step's.
    with warnings.catch_warnings():  # a resumed epoch with no batch left has no optimizer step before this
        warnings.filterwarnings("ignore", message=re.escape("Detected call of `lr_scheduler.step()` before"))
        state.scheduler.step()
    state.best_fitness = max(state.best_fitness, metrics.get("fitness", 0.0))
    return EpochSummary(epoch, trained.mean_loss, val_loss, metrics, lrs, time.time() - start)


def _stop_unvalidated(
    state: TrainState,
    epoch: int,
    trained: TrainedEpoch,
    save_now: Callable[[int, np.ndarray], Path],
    interrupted: EvalInterrupted,
    ctx: DistContext,
) -> NoReturn:
    """A stop signal came during `epoch`'s validation: save the trained epoch unvalidated and raise Preempted.

    A long validation would otherwise run on into the launcher's kill (and the 60 s watchdog's), losing the
    epoch. last.pt is then the position after the epoch's last batch, so the resumed run validates and saves
    that epoch before the next one, as after a stop at its last optimizer step.
    """
    if ctx.is_main:
        LOGGER.warning(
            f"{state.stop.reason}: validation of epoch {epoch + 1} stopped ({interrupted}); a resume validates it"
        )
    saved = save_now(trained.batches, trained.rank_mean_loss)
    raise Preempted(state.stop.reason, saved, is_main=ctx.is_main)


def _scores_line(metrics: dict[str, float]) -> str:
    """Return 'P .. R .. mAP50 .. mAP50-95 ..' for boxes, and the same for masks when present."""
    groups = [("", "")] + ([(" | mask ", "mask_")] if "mask_mAP50" in metrics else [])
    return "".join(
        f"{title}P {metrics[prefix + 'precision']:.3f} R {metrics[prefix + 'recall']:.3f} "
        f"mAP50 {metrics[prefix + 'mAP50']:.3f} mAP50-95 {metrics[prefix + 'mAP50-95']:.3f}"
        for title, prefix in groups
    )


def _final_validation(run: TrainRun) -> tuple[Path, EvalResult]:
    """Validate the EMA weights of best.pt (last.pt when --nosave never wrote a best) once more.

    Returns the checkpoint validated and its EvalResult (curves; a confusion matrix too unless
    --noplots, when rank 0 also draws val_batch*_labels.jpg / _pred.jpg, each an on_figure event).
    When the dataset YAML names COCO annotations for the val split, predictions.json
    and coco_eval.json are written to the run folder and the mAPs come from pycocotools. Every
    rank takes part. Only rank 0 is sure to see the file (other nodes may not share the
    filesystem), so rank 0 reads the weights and broadcasts them.
    """
    cfg, ctx, bundle = run.cfg, run.ctx, run.bundle
    path = Path(broadcast_object(str(run.best if run.best.exists() else run.last) if ctx.is_main else None, ctx))
    read = run_on_main(lambda: ckpt_io.inference_weights(ckpt_io.load_checkpoint(path)), ctx, f"reading {path}")
    weights = broadcast_object(read, ctx)
    model = build_model(bundle.spec).to(ctx.device)
    model.load_state_dict(weights)
    # Fused and laid out as val.py does (same batch size there gives the same numbers).
    model = model.fuse().to(memory_format=memory_format(cfg.channels_last))
    use_coco = run.data.annotations.get("val") is not None
    draws = ctx.is_main and not cfg.noplots  # rank 0's first batches: enough to look at
    options = EvalOptions(
        num_classes=len(bundle.names),
        multi_label=cfg.multi_label,
        description="final val",
        collect_predictions=use_coco,
        confusion=not cfg.noplots,
        on_batch=val_batch_drawer(run.run_dir, bundle.names, run.figure_written) if draws else None,
    )
    result = run.task.evaluate(model, run.datasets.val_loader, options, ctx)
    if use_coco:
        result = coco_evaluate(result, run.data, "val", run.run_dir, ctx, single_cls=cfg.single_cls)
    source = result.metric_source
    if result.mask_metrics is not None and result.mask_metric_source != source:
        source = f"{source} box, {result.mask_metric_source} mask"
    LOGGER.info(f"Final ({path}, {source} mAP): {_scores_line(result.as_dict())}")
    run.fire("on_val_end", metrics=result.as_dict(), path=path, final=True)
    return path, result
