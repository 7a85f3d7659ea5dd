"""--multi-scale: each training batch's input size, drawn from the iteration number, and the resize on the device."""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

MIN_SCALE, MAX_SCALE = 0.5, 1.5  # of --imgsz, as YOLOv5's --multi-scale


def multi_scale_size(iteration: int, imgsz: int, stride: int, seed: int) -> int:
    """The long side of iteration `iteration`'s batch: 0.5-1.5x `imgsz`, a multiple of `stride`, uniform.

    Drawn from (seed, iteration) alone, not from a generator that advances: every rank of a DDP
    job trains the same size at the same step (no rank waits on a larger batch of another's), and
    a resumed run draws the sizes the uninterrupted one drew.
    """
    low, high = int(imgsz * MIN_SCALE), int(imgsz * MAX_SCALE) + stride
    drawn = int(np.random.default_rng([seed % 2**32, iteration]).integers(low, high))
    return max(drawn // stride * stride, stride)


def largest_size(imgsz: int, stride: int) -> int:
    """The largest long side multi_scale_size draws (what the batch's memory must allow for)."""
    return max((int(imgsz * MAX_SCALE) + stride - 1) // stride * stride, stride)


def resize_batch(images: torch.Tensor, long_side: int, stride: int) -> torch.Tensor:
    """`images` (B, C, H, W) float, resized (bilinear) to long side `long_side`, each side a multiple of `stride`.

    Labels are normalised to the image ([0, 1] centres and sizes), so they hold for the resized batch
    as they are; segmentation's mask targets are resized to the prototypes by the loss. A batch
    already that size is returned as it is.
    """
    height, width = images.shape[-2:]
    longest = max(height, width)
    # ceil(side * long_side / longest / stride) in integers: float rounding would add a stride now and then
    size = [-(-side * long_side // (longest * stride)) * stride for side in (height, width)]
    if size == [height, width]:
        return images
    return F.interpolate(images, size=size, mode="bilinear", align_corners=False)


def multi_scale_resizer(imgsz: int, stride: int, seed: int) -> Callable[[torch.Tensor, int], torch.Tensor]:
    """The training step's (images, iteration) -> images of --multi-scale: resized to that iteration's size."""
    return functools.partial(_resize_for_iteration, imgsz=imgsz, stride=stride, seed=seed)


def _resize_for_iteration(images: torch.Tensor, iteration: int, imgsz: int, stride: int, seed: int) -> torch.Tensor:
    return resize_batch(images, multi_scale_size(iteration, imgsz, stride, seed), stride)
