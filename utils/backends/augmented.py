"""Test-time augmentation (--augment): a backend that also runs flipped and shrunk copies of a batch, rows pooled."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from utils.backends.base import InferenceBackend
from utils.backends.metadata import END_TO_END
from utils.errors import ConfigError
from utils.families import family_named

# (scale, left-right flip) per pass: YOLOv5's --augment set. The shrunk passes let large objects fit the
# receptive fields, the flip gives asymmetric shapes a second look; each pass costs a forward.
AUGMENTATIONS: tuple[tuple[float, bool], ...] = ((1.0, False), (0.83, True), (0.67, False))
PAD_VALUE = 114 / 255  # the letterbox's grey: a shrunk image is padded as a letterboxed one is


class AugmentedBackend(InferenceBackend):
    """Run `inner` on every pass of AUGMENTATIONS and return all passes' rows, mapped back to the input's pixels.

    forward(images (B, 3, H, W)) returns ((B, N x passes, no) rows in the ROWS layout, None): each pass's
    boxes are divided by its scale and mirrored back when flipped, so one NMS (`selector`) keeps the best
    of overlapping boxes from every pass. A shrunk image is padded right and bottom with the letterbox
    grey, to H x W for a fixed-shape file and to the next stride multiple otherwise, so exported files
    run it too. Detection only: masks come from each pass's own prototypes and are not pooled.
    """

    def __init__(self, inner: InferenceBackend) -> None:
        if inner.info.num_masks:
            raise ConfigError(
                f"{inner.info.path or 'this model'}: --augment is for detection models; a segmentation model's "
                "masks come from one pass's prototypes and are not pooled across flips and scales"
            )
        super().__init__(inner.info)
        self.inner = inner

    @property
    def device(self) -> torch.device:
        return self.inner.device

    @property
    def dtype(self) -> torch.dtype:
        return self.inner.dtype

    def selector(self) -> Callable[..., list[torch.Tensor]]:
        """NMS for every family: an end-to-end head's one-box-per-object holds within a pass, not across passes."""
        return family_named(self.info.family).detection_selector(False)

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """All passes' rows for `images` (B, 3, H, W), boxes in `images`' pixels (see the class)."""
        width = images.shape[-1]
        passes = []
        for index, (scale, flip) in enumerate(AUGMENTATIONS):
            view = images.flip(-1) if flip else images
            view = self._shrink(view, scale) if scale != 1.0 else view
            rows = self._drop_unreliable_level(self.inner(view)[0], view.shape[-2:], index).clone()
            rows[..., :4] /= scale  # cx, cy, w, h
            if flip:
                rows[..., 0] = width - rows[..., 0]
            passes.append(rows)
        return torch.cat(passes, 1), None

    def _drop_unreliable_level(self, rows: torch.Tensor, input_hw: torch.Size, index: int) -> torch.Tensor:
        """`rows` of pass `index` without the level its scale sees worst, when they are one row per grid point.

        The full-size pass drops its coarsest level (the largest objects, which the shrunk passes see
        whole), the smallest pass its finest (objects shrunk below what that level resolves): on the
        quick start's weights this scores higher than pooling every row. Rows come level by level,
        finest first, at strides stride/4, stride/2 and stride (every P3-P5 model), one per grid point
        and anchor (1, or YOLOv5's 3); an end-to-end file's rows are its top detections in score order,
        kept whole whatever their count.
        """
        last = len(AUGMENTATIONS) - 1
        if index not in (0, last) or self.info.layout == END_TO_END:
            return rows
        stride = self.info.stride
        cells = [(input_hw[0] // level) * (input_hw[1] // level) for level in (stride // 4, stride // 2, stride)]
        per_cell, remainder = divmod(rows.shape[1], sum(cells))
        if remainder or per_cell not in (1, 3):
            return rows
        if index == 0:
            return rows[:, : rows.shape[1] - per_cell * cells[-1]]
        return rows[:, per_cell * cells[0] :]

    def _shrink(self, images: torch.Tensor, scale: float) -> torch.Tensor:
        """`images` resized by `scale` (bilinear), padded right and bottom to the size the inner model runs."""
        height, width = images.shape[-2:]
        new_hw = (round(height * scale), round(width * scale))
        shrunk = F.interpolate(images, size=new_hw, mode="bilinear", align_corners=False)
        if self.info.fixed_shape:
            out_hw = (height, width)
        else:
            stride = self.info.stride
            out_hw = (math.ceil(new_hw[0] / stride) * stride, math.ceil(new_hw[1] / stride) * stride)
        padding = (0, out_hw[1] - new_hw[1], 0, out_hw[0] - new_hw[0])  # left, right, top, bottom
        return F.pad(shrunk, padding, value=PAD_VALUE)
