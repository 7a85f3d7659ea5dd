"""The ground-truth side of a segmentation loss's mask term, shared by every model family's loss."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from segment.ops import assemble_masks_by_image, crop_mask
from utils.boxes import xywhn_to_xyxy


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


class MaskTargets:
    """The ground-truth side of a mask term, shared by every family's segmentation loss (needs `self.overlap`)."""

    overlap: bool

    def _prepare_masks(
        self, masks: torch.Tensor, targets: torch.Tensor, batch_size: int, size: tuple[int, int]
    ) -> torch.Tensor:
        """Check the masks' layout against the targets and bring them to the prototypes' (h, w).

        Finer masks (--mask-ratio 1 or 2) keep, per prototype pixel, the mask pixel at its centre, as
        drawing at the prototypes' size would (utils/data/masks.py: a pixel is set when its centre is
        inside); nearest interpolation kept the block's first pixel, which moved the targets up and
        left by 1.5 (ratio 1) or 1 (ratio 2) image pixels against the box crop. Coarser masks, or sizes
        that are no whole multiple (--multi-scale), are resized taking the mask pixel under each prototype
        pixel's centre ('nearest-exact'); plain 'nearest' took the one under its top-left corner, which
        shifted the targets up and left by up to half a mask pixel.
        """
        expected, layout = (batch_size, "overlap (one per image)") if self.overlap else (len(targets), "per-instance")
        if masks.dim() != 3 or len(masks) != expected:
            raise ValueError(f"SegmentationLoss: {layout} masks need {expected} rows, got shape {tuple(masks.shape)}")
        if len(masks) == 0:  # no instances: nothing to resize (interpolate rejects empty input)
            return masks.new_zeros((0, *size))
        if tuple(masks.shape[-2:]) == size:
            return masks
        (height, width), (step_y, step_x) = size, (masks.shape[-2] // size[0], masks.shape[-1] // size[1])
        if step_y >= 1 and step_x >= 1 and masks.shape[-2:] == (step_y * height, step_x * width):
            # The pixel whose top-left corner is the prototype pixel's centre (the top-left rule, as drawn).
            return masks[:, step_y // 2 :: step_y, step_x // 2 :: step_x]
        return F.interpolate(masks[None].float(), size=size, mode="nearest-exact")[0]

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

    def box_mask_bce(
        self,
        coeffs: torch.Tensor,
        image_index: torch.Tensor,
        target_index: torch.Tensor,
        protos: torch.Tensor,
        masks: torch.Tensor,
        targets: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per match: (mean over prototype pixels of the BCE cropped to the instance's box, the box's area w*h).

        Matches must be grouped by image (`image_index` sorted): each image's prototypes meet all its rows
        in one matmul. coeffs (m, nm); target_index (m,) rows of `targets`. Dividing the first by the
        second gives the mean BCE inside the box, so small and large instances weigh alike.
        """
        height, width = protos.shape[-2:]
        boxes_xywhn = targets[target_index, 2:6]
        boxes_xyxy = xywhn_to_xyxy(boxes_xywhn, width, height)  # prototype pixels
        areas = boxes_xywhn[:, 2:].prod(dim=1).clamp(min=1e-9)
        logits = assemble_masks_by_image(coeffs, torch.bincount(image_index, minlength=len(protos)).tolist(), protos)
        row_ids = overlap_instance_ids(targets[:, 0].long()) if self.overlap else None
        truth = self._instance_masks(masks, target_index, targets, row_ids)
        bce = F.binary_cross_entropy_with_logits(logits, truth, reduction="none")
        return crop_mask(bce, boxes_xyxy).mean(dim=(1, 2)), areas
