"""Segmentation loss: the YOLOv5 detection loss plus a per-instance mask BCE over the same anchor matches."""

from __future__ import annotations

from collections.abc import Callable

import torch

from segment.mask_loss import MaskTermLoss
from utils.train.loss import DetectionLoss, LevelMatches


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
    ) -> tuple[dict[str, torch.Tensor], LevelMatches]:
        """Box, obj and cls as for detection, and the matches with their levels' count denominators."""
        matched = self._match(raw, targets, reduce_counts)
        box, obj, cls = self._detection_terms(matched)
        return {"box": box, "obj": obj, "cls": cls}, matched

    def _mask_items(
        self,
        raw: list[torch.Tensor],
        matches: LevelMatches,
        protos: torch.Tensor,
        masks: torch.Tensor,
        targets: torch.Tensor,
        reduce_counts: Callable[[torch.Tensor], torch.Tensor] | None,
    ) -> dict[str, torch.Tensor]:
        """The mask term on the box term's matches, with the box gain."""
        return {"seg": self._mask_term(matches, protos, masks, targets) * self.gains.box}

    def _mask_term(
        self, matched: LevelMatches, protos: torch.Tensor, masks: torch.Tensor, targets: torch.Tensor
    ) -> torch.Tensor:
        """Sum over all matches of the box-cropped mask BCE / normalised box area / their level's count (0-d).

        All levels' matches are computed together: one matmul per image, then one BCE and one crop
        over every match (looping over levels and images cost three times the small ops each way).
        """
        # The zero term keeps the prototype branch in the graph when nothing matched (DDP needs every parameter).
        total = protos.sum() * 0.0
        # With static shapes the valid rows (a host read: the mask term's shapes follow the match count);
        # the default's compact rows are all matches already.
        assigned, preds = matched.kept() if self.static_shapes else (matched.assigned, matched.preds)
        if not len(assigned.image_index):
            return total
        # Matches grouped by image (stable), so each image's prototypes meet all its rows in one matmul.
        order = torch.argsort(assigned.image_index, stable=True)
        coeffs = preds[order, 5 + self.head.num_classes :]
        # Each match is divided by its level's (rank-averaged) match count, as the box term is.
        level_counts = matched.denominators[assigned.level[order]]
        image_index, target_index = assigned.image_index[order], assigned.target_index[order]
        mean_bce, areas = self.box_mask_bce(coeffs, image_index, target_index, protos, masks, targets)
        return total + (mean_bce / (areas * level_counts)).sum()
