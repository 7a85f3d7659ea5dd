"""Segmentation loss: the YOLOv5 detection loss plus a per-instance mask BCE over the same anchor matches."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from segment.mask_targets import MaskTargets
from utils.train.loss import DetectionLoss, LevelTerms, LossGains


class SegmentationLoss(MaskTargets, DetectionLoss):
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
        mean_bce, areas = self.box_mask_bce(coeffs, image_index[order], target_index, protos, masks, targets)
        return total + (mean_bce / (areas * level_counts)).sum()
