"""Checkpoints of a running fit(): epoch-end and mid-epoch saves (rank 0 writes, every rank learns of a failure)
and restoring them, including the exact mid-epoch position."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from utils import checkpoint as ckpt_io
from utils.data.loader import LoaderGeometry
from utils.distributed import DistContext, all_gather_objects, run_on_main
from utils.eval.coco import EVAL_FILE, PREDICTIONS_FILE
from utils.runs import FIGURE_SUFFIXES, RunFolderLock, create_run_dir, lock_run_dir
from utils.train.config import TrainConfig, save_run_config
from utils.train.faults import mark_run
from utils.train.optim import build_scheduler

if TYPE_CHECKING:
    from utils.train.state import TrainRun, TrainState

LOGGER = logging.getLogger(__name__)
TENSORBOARD_PREFIX = "events.out.tfevents"  # TensorBoard's event files
COCO_FILES = (PREDICTIONS_FILE, EVAL_FILE)


def restore_state(
    state: TrainState, checkpoint: dict[str, Any], cfg: TrainConfig, batches: int, ctx: DistContext, start_batch: int
) -> None:
    """Load model, optimizer, scaler, EMA, epoch and best fitness from a checkpoint into `state` (every rank).

    The LR schedule is rebuilt at the resumed epoch, so it continues where it stopped (with --epochs
    given anew, at the new schedule's rate; a checkpoint at an epoch's last batch keeps that step's rates,
    as it has no step left to set them before its results row). A mid-epoch
    checkpoint also gives the batch to continue at and, per rank, the running mean loss and the
    buffers (BatchNorm statistics differ per rank without SyncBatchNorm), so the resumed run
    continues exactly where the interrupted one stopped. `start_batch` is the batch the loader
    started at (`TrainLoader.start`: after a resume on another geometry, where the remainder plan's
    batches begin). Saved by other ranks than these, the running mean goes on from the saved ranks'
    average and the BatchNorm buffers are rank 0's (in the model's state).
    """
    # The optimizer's saved groups bring back their options too. Weight decay is scaled to this run's batch and
    # accumulation (build_train_state), which --batch-size with --resume may have changed: this run's value stays.
    decay = [group["weight_decay"] for group in state.optimizer.param_groups]
    state.start_epoch = ckpt_io.restore_training_state(
        checkpoint, state.model, state.optimizer, state.scaler, state.ema
    )
    for group, value in zip(state.optimizer.param_groups, decay, strict=True):
        group["weight_decay"] = value
    saved_lrs = [group["lr"] for group in state.optimizer.param_groups]
    state.scheduler = build_scheduler(state.optimizer, state.lr_fn, state.start_epoch)
    if start_batch == batches:  # an epoch with no batch left reports the rates of its last step (warmup's, say)
        for group, lr in zip(state.optimizer.param_groups, saved_lrs, strict=True):
            group["lr"] = lr
    state.best_fitness = float(checkpoint.get("best_fitness", 0.0))
    if checkpoint.get("early_stop") is not None:  # absent in checkpoints of earlier versions: patience starts afresh
        state.stopper.load_state_dict(checkpoint["early_stop"])
    state.start_batch = start_batch
    per_rank = (checkpoint.get("rank_states") or []) if start_batch else []
    own = per_rank[ctx.rank] if len(per_rank) == ctx.world_size else None
    if own is not None:  # a mid-epoch checkpoint: this rank's own running mean and buffers
        state.resumed_mean_loss = np.asarray(own["mean_loss"], dtype=np.float64)
        state.model.load_state_dict(own["model_buffers"], strict=False)
        state.ema.ema.load_state_dict(own["ema_buffers"], strict=False)
    elif per_rank:
        state.resumed_mean_loss = np.mean([np.asarray(saved["mean_loss"], dtype=np.float64) for saved in per_rank], 0)
        if ctx.is_main:
            LOGGER.info(
                f"The checkpoint was saved by {len(per_rank)} rank(s), this run has {ctx.world_size}: the epoch's "
                "running loss goes on from their mean, and rank 0's BatchNorm buffers are used"
            )
    state.last_opt_step = state.start_epoch * batches + state.start_batch - 1


@dataclass(frozen=True)
class ResumePoint:
    """Where a resumed run's loader starts: `batch` of `epoch`, in the epoch's order or, with `seen`, its remainder.

    `seen` holds the dataset indices the epoch trained before the plan the batches count in
    (SmartDistributedSampler.plan_remainder); None: the epoch's own order.
    """

    epoch: int = 0
    batch: int = 0
    seen: np.ndarray | None = None


def resume_point(checkpoint: dict[str, Any] | None, geometry: LoaderGeometry) -> ResumePoint:
    """Where a run resumed from `checkpoint` starts, for a loader of `geometry` (`TrainLoader.geometry`).

    Known before the model state is restored, so the train loader can start its workers there early.
    A mid-epoch checkpoint of the same geometry goes on at its next batch, exactly as the stopped run
    would have. Another world size or per-rank batch puts other images at that position: the epoch
    then goes on with exactly the images it had not trained (the checkpoint's `epoch_seen`), as a
    remainder plan. Another train set (other paths, or another length) restarts the epoch, with a
    warning: the saved indices would name other images. At an epoch's end, another train set is
    only warned of: the run goes on with the files as they are now.
    """
    if checkpoint is None:
        return ResumePoint()
    epoch, done = int(checkpoint["epoch"]) + 1, int(checkpoint.get("batches_done", 0))
    saved, plan_seen = checkpoint.get("epoch_geometry"), checkpoint.get("plan_seen")
    other_files = saved is not None and (saved["dataset_len"], saved.get("dataset")) != (
        geometry["dataset_len"],
        geometry["dataset"],
    )
    if not done and other_files:
        LOGGER.warning(
            f"The train set is not the one the checkpoint trained on ({saved['dataset_len']} images then, "
            f"{geometry['dataset_len']} now, or other files): the run goes on with the train set as it is now"
        )
    if not done or saved is None or dict(saved) == geometry:  # older checkpoints record no geometry
        return ResumePoint(epoch, done, None if plan_seen is None or not done else np.asarray(plan_seen))
    where = (
        f"epoch {epoch + 1} of the checkpoint ({saved['world_size']} rank(s), per-rank batch {saved['per_rank_batch']})"
    )
    if other_files:
        LOGGER.warning(
            f"The train set is not the one {where} trained on ({saved['dataset_len']} images then, "
            f"{geometry['dataset_len']} now, or other files): the images it trained cannot be told apart, so that "
            "epoch restarts from its first batch"
        )
        return ResumePoint(epoch)
    seen = np.asarray(checkpoint["epoch_seen"])
    LOGGER.info(
        f"Resuming {where} on {geometry['world_size']} rank(s) of batch {geometry['per_rank_batch']}: it goes on "
        f"with the {geometry['dataset_len'] - len(seen)} of its {geometry['dataset_len']} images it had not trained"
    )
    return ResumePoint(epoch, 0, seen)


def checkpoint_state(run: TrainRun, state: TrainState, epoch: int) -> ckpt_io.Checkpoint:
    """Return the checkpoint for the end of `epoch`: plain data and state dicts only."""
    cfg, bundle = run.cfg, run.bundle
    info = ckpt_io.RunInfo(
        run.task.name, bundle.spec.to_dict(), list(bundle.names), cfg.to_dict(), cfg.hyp.to_dict(), bundle.spec.family
    )
    checkpoint = ckpt_io.build_checkpoint(
        run=info,
        model=state.model,
        ema=state.ema,
        optimizer=state.optimizer,
        scaler=state.scaler,
        epoch=epoch,
        best_fitness=state.best_fitness,
    )
    checkpoint["callback_state"] = _callback_state(run.callbacks.state, run.unsaved_state)  # the MLflow run id, ...
    checkpoint["early_stop"] = state.stopper.state_dict()  # rank 0's, which decides
    checkpoint["job"] = run.ctx.run_id  # a torchrun restart of this job resumes it before an older --resume file
    # The train set it trained on (resume_point tells a resume on other files); a mid-epoch save's is the same.
    checkpoint["epoch_geometry"] = dict(run.datasets.train_loader.geometry)
    return checkpoint


def _callback_state(state: dict[str, Any], warned: set[str]) -> dict[str, Any]:
    """The callbacks' records as checkpoint data; an entry that is not plain data is left out.

    Each such key is warned about once per run (added to `warned`), not at every save.
    """
    kept = {}
    for key, value in state.items():
        try:
            kept[str(key)] = ckpt_io.plain_data(value)
        except TypeError as error:
            if str(key) not in warned:
                warned.add(str(key))
                LOGGER.warning(f"callback state {key!r} not saved in checkpoints: {error}")
    return kept


def save_epoch(run: TrainRun, state: TrainState, epoch: int, fitness: float) -> None:
    """Write last.pt, best.pt when `fitness` is the best so far, and periodic epoch<N>.pt; every rank calls it.

    Rank 0 writes; a failure there (disk full, no permission) is raised on every rank at once.
    """

    def write() -> None:
        checkpoint = checkpoint_state(run, state, epoch)
        ckpt_io.save_checkpoint(checkpoint, run.last, run.ctx)
        if fitness >= state.best_fitness:
            ckpt_io.save_checkpoint(checkpoint, run.best, run.ctx)
        if run.cfg.save_period > 0 and (epoch + 1) % run.cfg.save_period == 0:
            ckpt_io.save_checkpoint(checkpoint, run.run_dir / "weights" / f"epoch{epoch + 1}.pt", run.ctx)

    run_on_main(write, run.ctx, "saving checkpoints")
    state.steps_since_save = 0


def save_mid_epoch(run: TrainRun, state: TrainState, epoch: int, batches_done: int, mean_loss: np.ndarray) -> Path:
    """Write last.pt after `batches_done` batches of `epoch` (right after an optimizer step); every rank calls it.

    The checkpoint is the end of epoch - 1 plus `batches_done` and, per rank (gathered), the running
    mean loss and the model's and EMA's buffers, which restore_state gives back to each rank.
    """
    loader = run.datasets.train_loader
    own = {
        "mean_loss": mean_loss.tolist(),
        "model_buffers": {name: buf.detach().cpu().clone() for name, buf in state.model.named_buffers()},
        "ema_buffers": {name: buf.detach().cpu().clone() for name, buf in state.ema.ema.named_buffers()},
    }
    rank_states = all_gather_objects(own, run.ctx)
    # What the epoch trained on every rank, so a resume on another geometry can leave exactly those out. As int32:
    # every rank receives every rank's set (4 bytes an image each; a whole epoch of a million images is 4 MB).
    trained = loader.seen_after(epoch, batches_done).astype(np.int32)
    seen = np.unique(np.concatenate(all_gather_objects(trained, run.ctx)))
    plan_seen = loader.sampler.plan_seen if loader.sampler.plan_epoch == epoch else None

    def write() -> None:
        checkpoint = checkpoint_state(run, state, epoch - 1)
        checkpoint.update(
            batches_done=batches_done,
            rank_states=rank_states,
            epoch_geometry=loader.geometry,
            epoch_seen=torch.from_numpy(seen.astype(np.int64)),
            plan_seen=None if plan_seen is None else torch.from_numpy(plan_seen),
        )
        ckpt_io.save_checkpoint(checkpoint, run.last, run.ctx)

    run_on_main(write, run.ctx, "saving the mid-epoch checkpoint")
    state.steps_since_save = 0
    LOGGER.info(f"Saved {run.last} at epoch {epoch + 1} batch {batches_done}")
    return run.last


def open_run_dir(cfg: TrainConfig, resuming: bool, ctx: DistContext) -> tuple[Path, RunFolderLock | None]:
    """Create the run folder (or reopen it, resuming), lock it on rank 0 and write the run's options in it.

    Every rank must call it. The lock (utils/runs.py) is held by rank 0 until the caller releases
    it; a folder another run holds is a one-line ConfigError on every rank, before anything is
    written in it. The lock (None on ranks other than 0) is released here if writing fails.
    """
    run_dir = create_run_dir(cfg.project, cfg.name, cfg.exist_ok or resuming, ctx, subdirs=("weights",))
    restarted = ctx.generation > 0 or ctx.restart_count > 0  # a torchrun restart: its last attempt may hold it
    lock = lambda: lock_run_dir(run_dir, ctx.run_id, restarted)  # noqa: E731
    folder_lock = run_on_main(lock, ctx, f"locking the run folder {run_dir}")
    try:
        run_on_main(lambda: prepare_run_dir(cfg, run_dir, ctx, resuming), ctx, f"writing the run folder {run_dir}")
    except BaseException:
        if folder_lock is not None:
            folder_lock.release()
        raise
    return run_dir, folder_lock


def prepare_run_dir(cfg: TrainConfig, run_dir: Path, ctx: DistContext, resuming: bool = False) -> None:
    """Rank 0: opt.yaml and hyp.yaml, the torchrun job marker, and no temp files of killed saves.

    A new run in a folder an earlier run used (--exist-ok) starts without that run's last.pt,
    best.pt and epochN.pt: under --nosave, or when no epoch of this run beats the earlier best, they
    would be validated and reported as this run's at the end, and a damaged last.pt would fall back
    to the earlier run's epochN.pt on --resume (load_resume_checkpoint). Its figures, TensorBoard
    events and COCO results go too: TensorBoard would show both runs as one, and MLflow and W&B
    upload the folder's figures as this run's.
    """
    save_run_config(cfg, run_dir, ctx)
    mark_run(run_dir, ctx.run_id)
    weights = run_dir / "weights"
    ckpt_io.remove_stale_temp_files(weights)
    if resuming:
        return
    periodic = sorted(path for path in weights.glob("epoch*.pt") if path.name[5:-3].isdigit())
    earlier = [path for path in (weights / "last.pt", weights / "best.pt") if path.exists()] + periodic
    earlier += sorted(path for path in run_dir.iterdir() if path.is_file() and _is_run_output(path.name))
    for path in earlier:
        path.unlink()
    if earlier:
        names = ", ".join(path.name for path in earlier[:3]) + (
            f" and {len(earlier) - 3} more" if len(earlier) > 3 else ""
        )
        LOGGER.info(f"{run_dir}: removed the earlier run's {names} (a new run in the folder, --exist-ok)")


def _is_run_output(name: str) -> bool:
    """Whether a run-folder file is one a run writes as it goes: a figure, TensorBoard events, COCO results."""
    return Path(name).suffix in FIGURE_SUFFIXES or name.startswith(TENSORBOARD_PREFIX) or name in COCO_FILES
