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


def _source_taps(out_size: int, in_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Along one axis, per output pixel: the input pixels either side of its centre (low, high) and high's weight.

    As bilinear interpolation without align_corners: output pixel k's centre is input index
    (k + 0.5) * in_size / out_size - 0.5, clamped to the first and last pixel. Worked out in float64,
    so a centre exactly between two pixels gets weight 0.5 on each, not 0.5 plus rounding.
    """
    centre = (torch.arange(out_size, dtype=torch.float64) + 0.5) * in_size / out_size - 0.5
    centre = centre.clamp(0, in_size - 1)
    low = centre.floor().long()
    weight_high = (centre - low).float()
    return low.to(device), (low + 1).clamp(max=in_size - 1).to(device), weight_high.to(device)


def _tie_break(masks: torch.Tensor) -> torch.Tensor:
    """(n, max value + 1) float: per row and value, a bonus too small to outweigh a real difference in weight.

    Background (0) gets none, an instance up to 1e-4, more the smaller its area in its row, so a tie goes to
    an instance over the background and to the smaller of two instances, as polygons_to_overlap_mask
    draws a small object over a large one.
    """
    values = masks.flatten(1).long()
    num_values = int(values.max()) + 1
    row_offsets = torch.arange(len(masks), device=masks.device).view(-1, 1) * num_values
    # bincount without weights is deterministic on CUDA; a 2-D scatter_add_ is not.
    areas = torch.bincount((values + row_offsets).flatten(), minlength=len(masks) * num_values)
    tie_break = 1e-4 * (1 - areas.view(len(masks), num_values) / values.shape[1])
    tie_break[:, 0] = 0
    return tie_break


def resize_masks_by_vote(masks: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Resize (n, h, w) 0/1 or index masks to (n, *size), same dtype, keeping them centred.

    Each output pixel takes the value that holds the most bilinear weight among the four input
    pixels around its centre, which for 0/1 masks is bilinear interpolation thresholded at 0.5: the
    outline is placed between input pixels, close to where drawing at the new size puts it.
    'nearest' took the pixel under each output pixel's top-left corner and moved --multi-scale
    targets 1 to 1.5 input pixels down and right; 'nearest-exact' still rounds every half-way
    centre the same way (0.1 to 0.25 output pixels up and left). A vote, unlike averaging, keeps
    overlap masks' instance indices whole. A tie goes to an instance over the background.
    """
    rows_low, rows_high, weight_y = _source_taps(size[0], masks.shape[-2], masks.device)
    cols_low, cols_high, weight_x = _source_taps(size[1], masks.shape[-1], masks.device)
    weight_y, weight_x = weight_y.view(-1, 1), weight_x.view(1, -1)
    top, bottom = masks[:, rows_low], masks[:, rows_high]
    taps = (
        (top[:, :, cols_low], (1 - weight_y) * (1 - weight_x)),
        (top[:, :, cols_high], (1 - weight_y) * weight_x),
        (bottom[:, :, cols_low], weight_y * (1 - weight_x)),
        (bottom[:, :, cols_high], weight_y * weight_x),
    )
    tie_break = _tie_break(masks)

    def score(value: torch.Tensor) -> torch.Tensor:
        """The weight of the taps that hold `value`, plus its tie-break."""
        weight = sum(weight * (other == value) for other, weight in taps)
        return weight + tie_break.gather(1, value.flatten(1).long()).view_as(weight)

    best, best_score = taps[0][0], score(taps[0][0])
    for value, _ in taps[1:]:
        value_score = score(value)
        better = value_score > best_score
        best, best_score = torch.where(better, value, best), torch.where(better, value_score, best_score)
    return best


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
        that are no whole multiple (--multi-scale), are resized as `resize_masks_by_vote` does.
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
        if self.overlap:
            return resize_masks_by_vote(masks, size)
        # 0/1 masks: the same vote is bilinear interpolation at 0.5 or more (1e-4: its float32 rounding),
        # which torch does some 50 times faster on CPU.
        blended = F.interpolate(masks[None].float(), size=size, mode="bilinear", align_corners=False)[0]
        return (blended > 0.5 - 1e-4).to(masks.dtype)

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
