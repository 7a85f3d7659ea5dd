"""Mask tensor operations: assemble masks from prototypes and coefficients, crop them to boxes, upsample them."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def crop_mask(masks: torch.Tensor, boxes: torch.Tensor) -> torch.Tensor:
    """Zero every mask pixel outside its box; masks (n, h, w) any dtype, boxes (n, 4) xyxy in mask pixels.

    Pixel (row r, column c) covers [c, c+1) x [r, r+1); it is kept when its centre (c + 0.5, r + 0.5)
    satisfies x1 <= c + 0.5 < x2 and y1 <= r + 0.5 < y2. So a box on whole-pixel edges keeps exactly
    the pixels it covers, and a fractional box keeps the pixels it covers at least half-way along
    each axis. Returns a new (n, h, w) tensor of the masks' dtype.
    """
    if masks.dim() != 3 or boxes.shape != (len(masks), 4):
        raise ValueError(
            f"crop_mask: need masks (n, h, w) and boxes (n, 4), got {tuple(masks.shape)}, {tuple(boxes.shape)}"
        )
    _, height, width = masks.shape
    x1, y1, x2, y2 = boxes.float()[:, :, None, None].unbind(1)  # each (n, 1, 1)
    cols = torch.arange(width, device=masks.device, dtype=torch.float32).view(1, 1, width) + 0.5
    rows = torch.arange(height, device=masks.device, dtype=torch.float32).view(1, height, 1) + 0.5
    inside_rows, inside_cols = (rows >= y1) & (rows < y2), (cols >= x1) & (cols < x2)  # (n, h, 1), (n, 1, w)
    if masks.dtype == torch.bool:  # evaluation's binary masks: two logical ands, half the time of a select
        return masks & inside_rows & inside_cols
    inside = inside_rows & inside_cols  # one full-size op
    return torch.where(inside, masks, torch.zeros((), dtype=masks.dtype, device=masks.device))


def assemble_masks(coeffs: torch.Tensor, protos: torch.Tensor) -> torch.Tensor:
    """Return mask logits (n, h, w): each row of coeffs (n, nm) weighting the prototypes protos (nm, h, w)."""
    num_masks, height, width = protos.shape
    if coeffs.dim() != 2 or coeffs.shape[1] != num_masks:
        raise ValueError(f"assemble_masks: coeffs {tuple(coeffs.shape)} do not match {num_masks} prototypes")
    return (coeffs @ protos.reshape(num_masks, -1)).view(-1, height, width)


def process_masks(
    protos: torch.Tensor,
    coeffs: torch.Tensor,
    boxes_xyxy: torch.Tensor,
    input_hw: tuple[int, int],
    chunk: int = 64,
) -> torch.Tensor:
    """Turn detections' mask coefficients into (n, H, W) bool masks at the network input size.

    protos: (nm, h, w) one image's prototypes; coeffs: (n, nm); boxes_xyxy: (n, 4) in input pixels;
    input_hw: (H, W) of the network input. Steps: assemble the logits, bilinear upsample them to
    (H, W) (align_corners=False), keep logit > 0 (probability > 0.5), then crop to the box at input
    resolution. Cropping after upsampling keeps the box edges sharp; cropping at the 4x coarser
    prototype resolution first (YOLOv5-seg) blurs them and shrinks small objects' masks.
    `chunk` rows are upsampled at a time, so memory peaks at chunk x H x W float32.
    """
    height, width = input_hw
    out = torch.zeros((len(coeffs), height, width), dtype=torch.bool, device=protos.device)
    for start in range(0, len(coeffs), chunk):
        logits = assemble_masks(coeffs[start : start + chunk].float(), protos.float())
        logits = F.interpolate(logits[None], size=(height, width), mode="bilinear", align_corners=False)[0]
        out[start : start + chunk] = crop_mask(logits > 0, boxes_xyxy[start : start + chunk])
    return out


def assemble_masks_by_image(coeffs: torch.Tensor, counts: list[int], protos: torch.Tensor) -> torch.Tensor:
    """Return mask logits (n, h, w) for rows grouped by image: the first counts[0] rows use image 0's prototypes, ...

    coeffs: (n, nm) with sum(counts) == n; protos: (B, nm, h, w) with len(counts) == B. One
    matmul per image that has rows, on views of the prototypes (no per-row copies).
    """
    batch, num_masks, height, width = protos.shape
    if coeffs.dim() != 2 or coeffs.shape[1] != num_masks or len(counts) != batch or sum(counts) != len(coeffs):
        raise ValueError(
            f"assemble_masks_by_image: coeffs {tuple(coeffs.shape)} and {len(counts)} image counts summing to "
            f"{sum(counts)} do not match protos {tuple(protos.shape)}"
        )
    flat = protos.reshape(batch, num_masks, height * width).unbind(0)
    pieces = [rows @ image_protos for rows, image_protos in zip(coeffs.split(counts), flat, strict=True) if len(rows)]
    if not pieces:
        return protos.new_zeros((0, height, width))
    return torch.cat(pieces).view(-1, height, width)
