"""--batch-size -1 (AutoBatch, YOLOv5's flag): the largest global batch whose training step fits every rank's GPU.

Each rank measures its own GPU: the model's forward and backward at a few per-rank batch sizes,
the peak memory each takes, a straight line through them, and the batch at which the line meets
AUTOBATCH_FRACTION of the memory the GPU has free. The ranks then take the smallest answer (one
GPU with less room, or another process on it, decides for all), and the global batch is that
times the number of ranks, so `--batch-size` keeps meaning the global batch. The optimizer state,
the EMA copy and the loss's assignment tensors are not in the measured step; the fraction leaves
room for them. Without CUDA there is nothing to measure: the default batch is used, with a warning.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import nn

from utils.config import AUTOBATCH, QUICKSTART_BATCH
from utils.distributed import DistContext, all_gather_objects
from utils.train.config import TrainConfig
from utils.train.multi_scale import largest_size

LOGGER = logging.getLogger(__name__)

AUTOBATCH_FRACTION = 0.6  # of the GPU's free memory the measured step may fill
PROBE_SIZES = (1, 2, 4, 8, 16)  # per-rank batches measured
MAX_PER_RANK = 1024


def fit_batch(sizes: Sequence[int], peaks: Sequence[float], budget: float) -> int | None:
    """The largest per-rank batch whose peak memory, on the line fitted through (sizes, peaks), stays within `budget`.

    None when the measurements say nothing usable (fewer than two sizes, memory not growing with
    the batch). At least 1, at most MAX_PER_RANK.
    """
    if len(sizes) < 2 or len(set(sizes)) < 2:
        return None
    slope, intercept = np.polyfit(np.asarray(sizes, float), np.asarray(peaks, float), 1)
    if not np.isfinite(slope) or slope <= 0:
        return None
    fitting = math.floor((budget - intercept) / slope + 1e-6)  # a fit that meets the budget exactly keeps it
    return int(min(max(fitting, 1), MAX_PER_RANK))


def measure_step_memory(
    model: nn.Module, image_size: int, device: torch.device, amp_dtype: torch.dtype | None, sizes: Sequence[int]
) -> tuple[list[int], list[float], float]:
    """(sizes measured, peak bytes of each forward + backward, free bytes before) on this rank's CUDA device.

    Stops at the first size that runs out of memory; the model is left without gradients.
    """
    model.train()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(device)
    base = torch.cuda.memory_allocated(device)
    measured, peaks = [], []
    for size in sizes:
        torch.cuda.reset_peak_memory_stats(device)
        try:
            images = torch.rand(size, 3, image_size, image_size, device=device)
            with torch.autocast("cuda", dtype=amp_dtype, enabled=amp_dtype is not None):
                total = _output_sum(model(images))
            total.backward()
            torch.cuda.synchronize(device)
        except torch.cuda.OutOfMemoryError:
            break
        finally:
            model.zero_grad(set_to_none=True)
            images = total = None  # noqa: F841 (drop the graph before the next size)
            torch.cuda.empty_cache()
        measured.append(size)
        peaks.append(float(torch.cuda.max_memory_allocated(device) - base))
    return measured, peaks, float(free)


def _output_sum(output: object) -> torch.Tensor:
    """A scalar that depends on every tensor a training forward returns (any nesting of tuples and lists)."""
    if isinstance(output, torch.Tensor):
        return output.float().sum()
    parts = [_output_sum(item) for item in output if item is not None] if isinstance(output, (tuple, list)) else []
    return torch.stack(parts).sum() if parts else torch.zeros(())


def resolve_autobatch(
    cfg: TrainConfig, build: Callable[[], nn.Module], amp_dtype: torch.dtype | None, ctx: DistContext
) -> TrainConfig:
    """Return `cfg` with --batch-size -1 replaced by the measured global batch (every rank calls it).

    `build` makes the model to measure (on CPU; moved to this rank's GPU here).
    """
    if cfg.batch_size != AUTOBATCH:
        return cfg
    proposal, reason, size = None, "no CUDA device to measure", cfg.imgsz
    if ctx.device.type == "cuda":
        model = build().to(ctx.device)
        # --multi-scale trains batches up to 1.5x --imgsz: the batch must fit at the largest.
        size = largest_size(cfg.imgsz, int(model.stride.max())) if cfg.multi_scale else cfg.imgsz
        sizes, peaks, free = measure_step_memory(model, size, ctx.device, amp_dtype, PROBE_SIZES)
        del model
        torch.cuda.empty_cache()
        proposal = fit_batch(sizes, peaks, AUTOBATCH_FRACTION * free)
        reason = f"the step's memory on rank {ctx.rank} gave no usable fit (batches {sizes}: {peaks} bytes)"
    per_rank = agree_on_batch(proposal, ctx)
    if per_rank is None:
        batch = max(QUICKSTART_BATCH // ctx.world_size, 1) * ctx.world_size
        why = reason if proposal is None else "another rank could not measure its GPU"
        LOGGER.warning(f"--batch-size -1 (AutoBatch): {why}; using --batch-size {batch}")
    else:
        batch = per_rank * ctx.world_size
        LOGGER.info(
            f"AutoBatch: --batch-size {batch} ({per_rank} per rank x {ctx.world_size}) at {size} px fills "
            f"{AUTOBATCH_FRACTION:.0%} of the free memory of the tightest rank's GPU in the measured step"
        )
    return dataclasses.replace(cfg, batch_size=batch)


def agree_on_batch(proposal: int | None, ctx: DistContext) -> int | None:
    """Every rank's answer, the smallest per-rank batch; None when any rank could not measure."""
    proposals = all_gather_objects(proposal, ctx)
    return None if any(p is None for p in proposals) else min(proposals)
