"""Segmentation loss: the YOLOv5 detection loss plus a per-instance mask BCE over the same anchor matches."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from segment.ops import assemble_masks_by_image, crop_mask
from utils.boxes import xywhn_to_xyxy
from utils.config import TrainConfig
from utils.errors import ConfigError
from utils.families import YOLOV5, family_of
from utils.train.loss import DetectionLoss, LevelTerms, LossGains


class SegmentationLoss(DetectionLoss):
    """YOLOv5-seg loss: DetectionLoss's box/obj/cls terms plus a mask term; items [box, seg, obj, cls].

    `__call__((raw, protos), targets, reduce_counts=None, *, masks)`: raw [(B, na, H_l, W_l, 5+nc+nm)],
    protos (B, nm, h, w), targets (N, 6) normalised as for detection; masks are the batch's
    ground truth (docs/CONTRACTS.md): per-instance (N, h', w') 0/1 aligned with the target rows, or
    with `overlap` (B, h', w') holding i + 1 where an image's i-th instance is. Masks of another size
    than the prototypes are resized (nearest) to it first.

    Mask term, per matched anchor (the same matches as the box term): BCE-with-logits between the
    assembled mask and the matched instance's mask, cropped to the instance box (in prototype
    pixels), averaged over all prototype pixels and divided by the normalised box area w*h; this
    equals the mean BCE inside the box (up to pixel rounding) as in YOLOv5-seg, so small and large
    instances weigh alike. Per level it is summed and divided by the box term's (rank-averaged)
    match count; its gain is the box gain. The math runs in fp32 with autocast off.
    """

    item_names = ("box", "seg", "obj", "cls")

    def __init__(self, model: nn.Module, gains: LossGains, *, overlap: bool = False, **kwargs: Any) -> None:
        super().__init__(model, gains, **kwargs)
        self.overlap = overlap

    def __call__(  # type: ignore[override]  # takes (raw, protos) and the masks, unlike detection
        self,
        outputs: tuple[list[torch.Tensor], torch.Tensor],
        targets: torch.Tensor,
        reduce_counts: Callable[[torch.Tensor], torch.Tensor] | None = None,
        *,
        masks: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Compute the loss for one batch: (loss (1,) multiplied by the batch size, items (4,) detached)."""
        raw, protos = outputs
        levels, denominators = self._match_levels(raw, targets, reduce_counts)
        box, obj, cls = self._detection_terms(levels, denominators)
        targets = targets.to(device=protos.device, dtype=torch.float32)
        with torch.autocast(protos.device.type, enabled=False):
            protos = protos.float()
            masks = self._prepare_masks(masks.to(protos.device), targets, len(protos), tuple(protos.shape[-2:]))
            seg = self._mask_term(levels, denominators, protos, masks, targets)
        losses = torch.stack((box, seg * self.gains.box, obj, cls))
        return losses.sum().view(1) * len(protos), losses.detach()

    def _prepare_masks(
        self, masks: torch.Tensor, targets: torch.Tensor, batch_size: int, size: tuple[int, int]
    ) -> torch.Tensor:
        """Check the masks' layout against the targets and resize them (nearest) to the prototypes' (h, w)."""
        expected, layout = (batch_size, "overlap (one per image)") if self.overlap else (len(targets), "per-instance")
        if masks.dim() != 3 or len(masks) != expected:
            raise ValueError(f"SegmentationLoss: {layout} masks need {expected} rows, got shape {tuple(masks.shape)}")
        if len(masks) == 0:  # no instances: nothing to resize (interpolate rejects empty input)
            return masks.new_zeros((0, *size))
        if tuple(masks.shape[-2:]) != size:
            masks = F.interpolate(masks[None].float(), size=size, mode="nearest")[0]
        return masks

    @staticmethod
    def _instance_masks(
        masks: torch.Tensor, target_rows: torch.Tensor, targets: torch.Tensor, row_ids: torch.Tensor | None
    ) -> torch.Tensor:
        """Return (m, h, w) float 0/1 ground-truth masks of the instances at `target_rows` (rows of `targets`).

        `row_ids` (overlap masks only): every target row's value in its image's index mask.
        """
        if row_ids is None:
            return masks[target_rows].float()
        image_index = targets[target_rows, 0].long()
        return (masks[image_index] == row_ids[target_rows].view(-1, 1, 1)).float()

    def _mask_term(
        self,
        levels: list[LevelTerms],
        denominators: torch.Tensor,
        protos: torch.Tensor,
        masks: torch.Tensor,
        targets: torch.Tensor,
    ) -> torch.Tensor:
        """Sum over every level's matches of the box-cropped mask BCE / normalised box area / level count (0-d).

        All levels' matches are computed together: one matmul per image, then one BCE and one crop
        over every match (looping over levels and images cost three times the small ops each way).
        """
        # The zero term keeps the prototype branch in the graph when nothing matched (DDP needs every parameter).
        total = protos.sum() * 0.0
        matched = [(terms, count) for terms, count in zip(levels, denominators, strict=True) if terms.num_matches]
        if not matched:
            return total
        image_index = torch.cat([terms.assigned.image_index for terms, _ in matched])
        # Matches grouped by image (stable), so each image's prototypes meet all its rows in one matmul.
        order = torch.argsort(image_index, stable=True)
        target_index = torch.cat([terms.assigned.target_index for terms, _ in matched])[order]
        coeffs = torch.cat([terms.matched_preds[:, 5 + self.head.num_classes :] for terms, _ in matched])[order]
        # Each match is divided by its level's (rank-averaged) match count, as the box term is.
        level_counts = torch.cat([count.expand(terms.num_matches) for terms, count in matched])[order]
        height, width = protos.shape[-2:]
        boxes_xywhn = targets[target_index, 2:6]
        boxes_xyxy = xywhn_to_xyxy(boxes_xywhn, width, height)  # prototype pixels
        areas = boxes_xywhn[:, 2:].prod(dim=1).clamp(min=1e-9)
        logits = assemble_masks_by_image(coeffs, torch.bincount(image_index, minlength=len(protos)).tolist(), protos)
        row_ids = overlap_instance_ids(targets[:, 0].long()) if self.overlap else None
        truth = self._instance_masks(masks, target_index, targets, row_ids)
        bce = F.binary_cross_entropy_with_logits(logits, truth, reduction="none")
        return total + (crop_mask(bce, boxes_xyxy).mean(dim=(1, 2)) / (areas * level_counts)).sum()


def overlap_instance_ids(image_index: torch.Tensor) -> torch.Tensor:
    """Return each target row's value in its image's overlap mask: 1 + its position among that image's rows.

    image_index: (N,) long, the targets' column 0. Rows of one image must be contiguous and in the
    image's instance order (the collate guarantees it), so the position is the row minus the
    image's first row.
    """
    rows = torch.arange(len(image_index), device=image_index.device)
    num_images = int(image_index.max()) + 1 if len(image_index) else 0
    first_row = rows.new_full((num_images,), len(image_index))
    first_row = first_row.scatter_reduce(0, image_index, rows, reduce="amin")
    return rows - first_row[image_index] + 1


def build_segmentation_loss(model: nn.Module, cfg: TrainConfig) -> SegmentationLoss:
    """Build the segmentation loss for `model` from `cfg.hyp`, `cfg.imgsz` and `cfg.overlap_mask`.

    The mask term extends the detection loss of the model's family; only YOLOv5's has one here.
    """
    family = family_of(model)
    if family.name != YOLOV5.name:
        raise ConfigError(f"segmentation training is not available for {family.name} models yet")
    return SegmentationLoss.from_hyp(model, cfg.hyp, cfg.imgsz, overlap=cfg.overlap_mask)
