"""Segmentation loss: the YOLOv5 detection loss plus a per-instance mask BCE over the same anchor matches."""

from __future__ import annotations

from collections.abc import Callable

import torch

from segment.mask_loss import MaskTermLoss
from utils.train.loss import DetectionLoss, LevelTerms


class SegmentationLoss(MaskTermLoss, DetectionLoss):
    """YOLOv5-seg loss: DetectionLoss's box/obj/cls terms plus a mask term; items [box, seg, obj, cls].

    Called as MaskTermLoss says, with raw [(B, na, H_l, W_l, 5+nc+nm)] and `overlap` for index masks.

    Mask term, per matched anchor (the same matches as the box term): BCE-with-logits between the
    assembled mask and the matched instance's mask, cropped to the instance box (in prototype
    pixels), averaged over all prototype pixels and divided by the normalised box area w*h; this
    equals the mean BCE inside the box (up to pixel rounding) as in YOLOv5-seg, so small and large
    instances weigh alike. Per level it is summed and divided by the box term's (rank-averaged)
    match count; its gain is the box gain. The math runs in fp32 with autocast off.
    """

    item_names = ("box", "seg", "obj", "cls")

    def _detection_items(
        self,
        raw: list[torch.Tensor],
        targets: torch.Tensor,
        reduce_counts: Callable[[torch.Tensor], torch.Tensor] | None,
    ) -> tuple[dict[str, torch.Tensor], tuple[list[LevelTerms], torch.Tensor]]:
        """Box, obj and cls as for detection, and the per-level matches with their count denominators."""
        levels, denominators = self._match_levels(raw, targets, reduce_counts)
        box, obj, cls = self._detection_terms(levels, denominators)
        return {"box": box, "obj": obj, "cls": cls}, (levels, denominators)

    def _mask_items(
        self,
        raw: list[torch.Tensor],
        matches: tuple[list[LevelTerms], torch.Tensor],
        protos: torch.Tensor,
        masks: torch.Tensor,
        targets: torch.Tensor,
        reduce_counts: Callable[[torch.Tensor], torch.Tensor] | None,
    ) -> dict[str, torch.Tensor]:
        """The mask term on the box term's matches, with the box gain."""
        levels, denominators = matches
        return {"seg": self._mask_term(levels, denominators, protos, masks, targets) * self.gains.box}

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
        # Each level's matches; with static shapes their valid rows (a host read: the mask term's shapes
        # follow the match count), while the default's compact rows are all matches already.
        kept = [
            (*(terms.matches() if self.static_shapes else (terms.assigned, terms.matched_preds)), count)
            for terms, count in zip(levels, denominators, strict=True)
        ]
        matched = [(assigned, preds, count) for assigned, preds, count in kept if len(assigned.image_index)]
        if not matched:
            return total
        image_index = torch.cat([assigned.image_index for assigned, _, _ in matched])
        # Matches grouped by image (stable), so each image's prototypes meet all its rows in one matmul.
        order = torch.argsort(image_index, stable=True)
        target_index = torch.cat([assigned.target_index for assigned, _, _ in matched])[order]
        coeffs = torch.cat([preds[:, 5 + self.head.num_classes :] for _, preds, _ in matched])[order]
        # Each match is divided by its level's (rank-averaged) match count, as the box term is.
        level_counts = torch.cat([count.expand(len(preds)) for _, preds, count in matched])[order]
        mean_bce, areas = self.box_mask_bce(coeffs, image_index[order], target_index, protos, masks, targets)
        return total + (mean_bce / (areas * level_counts)).sum()
