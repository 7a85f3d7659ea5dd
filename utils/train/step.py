"""One training epoch and its step: AMP, gradient accumulation under DDP's no_sync, warmup, the optimizer step, EMA.

fit() (utils/train/engine.py) runs the epochs; everything here happens inside one.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from utils.data.batch import images_on_device
from utils.data.loader import TrainLoader
from utils.distributed import DistContext, RankMean, all_reduce_sum
from utils.errors import Preempted
from utils.logs import tqdm_disabled
from utils.train.config import TrainConfig
from utils.train.prefetch import DevicePrefetcher, WaitTimer
from utils.train.state import TrainedEpoch, TrainState


def train_one_epoch(
    state: TrainState,
    loader: Any,
    epoch: int,
    cfg: TrainConfig,
    ctx: DistContext,
    on_batch: Callable[[int, dict[str, Any]], None] | None = None,
    save_mid_epoch: Callable[[int, np.ndarray], Path] | None = None,
) -> TrainedEpoch:
    """Train one epoch; return the mean loss items over all ranks' batches, with images/s and data wait.

    `on_batch(i, batch)`, when given, sees each batch as the loader yields it, before training
    on it (fit() draws the first ones); it must not run collectives nor keep the batch's images
    (a `TrainLoader`'s are lent, `TrainLoader.lent`). `save_mid_epoch(batches_done,
    mean_loss)`, called on every rank right after an optimizer step every --save-period-steps
    steps and when a stop signal was agreed, writes last.pt; after a stop it raises Preempted.
    A resumed epoch (`state.start_batch` > 0) starts at that batch with the saved running mean.
    The epoch's last batch always ends in an optimizer step, so no gradient is left pending in
    a checkpoint taken at the epoch's end.

    One optimiser step per `accumulate` micro-batches. Micro-batches that do not end an
    accumulation run under DDP's no_sync(), so gradients are all-reduced once per step, and the
    loss is multiplied by the world size so DDP's averaged gradient matches one process with the
    global batch; the loss normalises by match counts averaged over ranks, so this holds exactly
    even when ranks match different numbers of anchors. The step decision depends only on the
    iteration number, so ranks agree.
    """
    state.model.train()
    skip = state.start_batch if epoch == state.start_epoch else 0
    num_batches = len(loader) + skip  # the loader yields only the batches after `skip`
    # Every rank runs the same number of steps, so the loss may all-reduce its match counts.
    reduce_counts = RankMean(ctx) if ctx.is_distributed else None
    mean_loss = np.zeros(len(state.loss_fn.item_names))
    if skip and state.resumed_mean_loss is not None:
        mean_loss = state.resumed_mean_loss.copy()
    # Loss items are summed on the device and read on the host once per optimizer step, not per micro-batch:
    # a read waits for the GPU, and per micro-batch that stalls the pipeline every few milliseconds.
    loss_sum = torch.tensor(mean_loss * skip, dtype=torch.float64, device=ctx.device)

    def to_device(batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        return {"images": images_on_device(batch, ctx.device), **state.loss_inputs(batch, ctx.device)}

    # No copy of a batch out of its worker's buffer: its images are converted (to_device) and drawn (on_batch)
    # before the next batch is taken, which is all a lent batch asks. On CUDA, pinning has copied them already.
    source = loader.lent() if isinstance(loader, TrainLoader) else loader
    batches = WaitTimer(DevicePrefetcher(source, to_device, ctx.device))
    description = f"epoch {epoch + 1}/{cfg.epochs}"
    progress = tqdm(batches, total=num_batches, initial=skip, desc=description, disable=tqdm_disabled(ctx))
    start, images_seen = time.perf_counter(), 0
    for i, (batch, inputs) in enumerate(progress, start=skip):
        if on_batch is not None:
            on_batch(i, batch)
        images_seen += len(inputs["images"])
        iteration = i + num_batches * epoch
        is_step = iteration - state.last_opt_step >= _accumulate_now(state, iteration, cfg) or i == num_batches - 1
        loss_sum += _forward_backward(state, inputs, iteration, is_step, epoch, ctx, reduce_counts)
        if not is_step:
            continue
        # Before the weights change. A bad micro-batch on any rank has already reached every rank's
        # gradients through DDP's all-reduce, so every rank checks (one 3-number all-reduce per
        # optimizer step, which also carries stop signals) and stops here together; a rank stopping
        # alone would leave the others waiting in the next step's all-reduce until the timeout.
        where = f"the optimizer step at epoch {epoch + 1} batch {i + 1}"
        stop, loss_total = _agree_before_step(state, ctx, where, loss_sum)
        _optimizer_step(state)
        state.startup.first_step(batches.seconds, ctx)  # the run's first step: the start-up time, logged once
        state.last_opt_step, state.steps_since_save = iteration, state.steps_since_save + 1
        mean_loss = loss_total / (i + 1)
        if not tqdm_disabled(ctx):
            progress.set_postfix_str(" ".join(f"{v:.4f}" for v in mean_loss) + f" inst={len(batch['targets'])}")
        due = 0 < cfg.save_period_steps <= state.steps_since_save and i + 1 < num_batches
        if save_mid_epoch is not None and (stop or due):
            saved = save_mid_epoch(i + 1, mean_loss)
            if stop:
                raise Preempted(state.stop.reason, saved, is_main=ctx.is_main)
    return _epoch_over_ranks(mean_loss, images_seen, time.perf_counter() - start, batches.seconds, num_batches, ctx)


def _forward_backward(
    state: TrainState,
    inputs: dict[str, torch.Tensor],
    iteration: int,
    is_step: bool,
    epoch: int,
    ctx: DistContext,
    reduce_counts: RankMean | None,
) -> torch.Tensor:
    """One micro-batch: warmup's learning rates, forward under autocast, backward; returns the loss items.

    Micro-batches that do not end an accumulation run under DDP's no_sync(). The loss is scaled by
    the world size so DDP's averaged gradient equals one process's over the global batch. A NaN/inf
    loss is counted (on the device) for `_agree_before_step`, not read here.
    """
    images = inputs.pop("images")
    if state.resize_input is not None:
        images = state.resize_input(images, iteration)
    state.warmup.apply(state.optimizer, iteration, state.lr_fn(epoch))
    sync_context = state.ddp.no_sync() if ctx.is_distributed and not is_step else contextlib.nullcontext()
    with sync_context:
        with torch.autocast(ctx.device.type, dtype=state.amp_dtype, enabled=state.amp_dtype is not None):
            preds = state.ddp(images)
            loss, items = state.train_loss(preds, reduce_counts=reduce_counts, **inputs)
        state.scaler.scale(loss * ctx.world_size).backward()
    state.nonfinite_losses = state.nonfinite_losses + (~torch.isfinite(loss.detach())).sum()
    return items.detach().to(torch.float64)


def _epoch_over_ranks(
    mean_loss: np.ndarray, images: int, seconds: float, waited: float, batches: int, ctx: DistContext
) -> TrainedEpoch:
    """One collective: results.csv reports every rank's batches (ranks run equally many), and the epoch's figures."""
    figures = np.array([*mean_loss, images, seconds, waited])
    if ctx.is_distributed:
        figures = all_reduce_sum(torch.tensor(figures, dtype=torch.float64, device=ctx.device), ctx).cpu().numpy()
    *loss, images_total, seconds_total, waited_total = figures
    world = ctx.world_size
    return TrainedEpoch(
        np.array(loss) / world, int(images_total), seconds_total / world, waited_total / world, batches, mean_loss
    )


def _agree_before_step(
    state: TrainState, ctx: DistContext, where: str, loss_sum: torch.Tensor
) -> tuple[bool, np.ndarray]:
    """Before an optimizer step: raise on every rank after a NaN/inf loss on any rank; return whether to stop.

    Every rank must call it at each optimizer step. After a bad loss the pending step is not
    taken, so the weights, the EMA and the checkpoints saved so far stay finite. The first value
    returned is True on every rank when any rank received a stop signal (SIGTERM, SIGUSR1, Ctrl-C); the
    second is this rank's `loss_sum` (float64 on the device) read on the host. Both travel in one
    copy: on a GPU each host read waits for the queued work, so the step reads once, not twice.
    """
    bad = torch.as_tensor(state.nonfinite_losses, device=ctx.device).to(torch.int64)
    stopping = torch.tensor(int(state.stop.received is not None), device=ctx.device)
    counts = torch.stack((bad, (bad > 0).to(torch.int64), stopping))
    if ctx.is_distributed:
        counts = all_reduce_sum(counts, ctx)
    host = torch.cat((counts.to(torch.float64), loss_sum.to(torch.float64))).cpu().numpy()  # counts: exact in fp64
    bad_batches, bad_ranks, stopping_ranks = (int(value) for value in host[:3])
    state.nonfinite_losses = 0
    if bad_batches:
        ranks = f" on {bad_ranks} of {ctx.world_size} ranks" if ctx.is_distributed else ""
        raise FloatingPointError(
            f"loss is NaN or inf in {bad_batches} batch(es){ranks} before {where}; stopped without applying "
            "them (checkpoints saved so far are from earlier steps); lower lr0 or check the labels"
        )
    return stopping_ranks > 0, host[3:]


def _accumulate_now(state: TrainState, iteration: int, cfg: TrainConfig) -> int:
    """Accumulation steps at `iteration`: ramps from 1 to the nominal value during warmup."""
    if iteration > state.warmup.iterations:
        return state.accumulate
    global_batch = cfg.batch_size
    return max(1, int(np.interp(iteration, [0, state.warmup.iterations], [1, cfg.hyp.nbs / global_batch]).round()))


def _optimizer_step(state: TrainState) -> None:
    """Clip, step (through the GradScaler), zero the gradients and update the EMA.

    The gradients are dropped (set to None), or zeroed in place when `state.keep_grads` (--cuda-graph:
    a parameter without a gradient tensor would adopt the graph's own buffer, see GraphedForward).
    """
    state.scaler.unscale_(state.optimizer)
    torch.nn.utils.clip_grad_norm_(state.model.parameters(), max_norm=10.0, foreach=True)
    state.scaler.step(state.optimizer)
    state.scaler.update()
    state.optimizer.zero_grad(set_to_none=not state.keep_grads)
    state.ema.update(state.model)
