"""Anchor-free segmentation loss: the dense detection loss plus box-cropped mask BCE on its assignment."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from models.dense_head import DenseRaw
from segment.mask_loss import MaskTermLoss
from segment.mask_targets import overlap_instance_ids
from utils.train.dense_loss import BranchTerms, DenseGains, DenseLoss


def semantic_targets(truth: torch.Tensor, size: tuple[int, int] | torch.Size) -> torch.Tensor:
    """Bring (B, nc, h, w) 0/1 class masks to the semantic logits' (H, W): each cell's covered fraction.

    Each cell takes the mean of the masks over the area it covers, fractions of mask pixels
    included, so the targets stay centred on the masks at any ratio (--multi-scale too) and keep
    their area; 'nearest' took each cell's top-left mask pixel, which at the usual 2:1 moved the
    targets half a cell (two image pixels at --mask-ratio 4) up and left.
    """
    height, width = int(size[0]), int(size[1])
    if truth.shape[-2:] == (height, width):
        return truth
    rows = _area_weights(height, truth.shape[-2], truth)
    cols = _area_weights(width, truth.shape[-1], truth)
    return torch.einsum("Hh,bchw,Ww->bcHW", rows, truth, cols).clamp_(0, 1)  # float rounding stays in [0, 1]


def _area_weights(new: int, old: int, like: torch.Tensor) -> torch.Tensor:
    """(new, old): the share of each new cell's extent that each old pixel covers (rows sum to 1)."""
    edges = torch.arange(new + 1, device=like.device, dtype=like.dtype) * (old / new)
    pixels = torch.arange(old, device=like.device, dtype=like.dtype)
    overlap = torch.minimum(edges[1:, None], pixels + 1) - torch.maximum(edges[:-1, None], pixels)
    return overlap.clamp(min=0) / (old / new)


class DenseSegmentationLoss(MaskTermLoss, DenseLoss):
    """DenseLoss plus a mask term; items [box, seg, cls, dfl|l1], and [.., sem] for YOLO26-seg's semantic branch.

    Called as MaskTermLoss says, with raw a DenseRaw and `overlap` for index masks. Mask term: for every
    foreground point, its coefficients times the prototypes against its assigned instance's mask, BCE
    cropped to the instance box and averaged over the box; summed and divided by the foreground count
    (averaged over ranks, floored as the score sums are); gain: the box gain, for each branch by its
    weight. The semantic term (training only) is half BCE, half soft Dice between the per-pixel class
    logits and the union of each class's instance masks, as `semantic_targets` brings it to the
    logits' size; gain: the box gain.
    """

    def __init__(self, model: nn.Module, gains: DenseGains, *, overlap: bool = False, **kwargs: Any) -> None:
        super().__init__(model, gains, overlap=overlap, **kwargs)
        box, cls, dist = self.item_names
        has_semantic = hasattr(self.head.proto, "semantic")
        self.item_names = (box, "seg", cls, dist, *(("sem",) if has_semantic else ()))

    def _detection_items(
        self, raw: DenseRaw, targets: torch.Tensor, reduce_counts: Callable[[torch.Tensor], torch.Tensor] | None
    ) -> tuple[dict[str, torch.Tensor], list[tuple[float, BranchTerms]]]:
        """Box, cls and dfl|l1 as for detection, and each branch with its assignment."""
        branches, denominators = self._branches(raw, targets, reduce_counts)
        box, cls, dist = self._weighted_items(branches, denominators)
        dist_name = self.item_names[3]  # "dfl", or "l1" at reg_max 1, as DenseLoss names it
        return {"box": box, "cls": cls, dist_name: dist}, branches

    def _mask_items(
        self,
        raw: DenseRaw,
        matches: list[tuple[float, BranchTerms]],
        protos: torch.Tensor,
        masks: torch.Tensor,
        targets: torch.Tensor,
        reduce_counts: Callable[[torch.Tensor], torch.Tensor] | None,
    ) -> dict[str, torch.Tensor]:
        """The mask term on each branch's foreground points and, for YOLO26-seg, the semantic term; box gain."""
        items = {"seg": self._mask_terms(matches, protos, masks, targets, reduce_counts) * self.gains.box}
        if "sem" in self.item_names:
            semantic = raw.semantic
            sem = protos.new_zeros(()) if semantic is None else self._semantic_term(semantic, masks, targets)
            items["sem"] = sem * self.gains.box
        return items

    def _mask_terms(
        self,
        branches: list[tuple[float, BranchTerms]],
        protos: torch.Tensor,
        masks: torch.Tensor,
        targets: torch.Tensor,
        reduce_counts: Callable[[torch.Tensor], torch.Tensor] | None,
    ) -> torch.Tensor:
        """Sum over branches of weight x (mean-in-box mask BCE summed over foreground points) / foreground count."""
        counts = torch.stack([terms.assignment.foreground.sum().float() for _, terms in branches])
        if reduce_counts is not None:
            counts = reduce_counts(counts)
        counts = counts.clamp(min=1.0 / getattr(reduce_counts, "world_size", 1))
        coeff_start = 4 * self.head.reg_max + self.head.num_classes
        # The zero terms keep the prototype and coefficient outputs in the graph when nothing is foreground.
        total = protos.sum() * 0.0
        for (weight, terms), count in zip(branches, counts, strict=True):
            total = total + terms.flat[..., coeff_start:].sum() * 0.0
            image, point = terms.assignment.foreground.nonzero(as_tuple=True)  # row-major: grouped by image
            if not len(image):
                continue
            rows = terms.assignment.label_index[image, point]
            coeffs = terms.flat[image, point, coeff_start:]
            mean_bce, areas = self.box_mask_bce(coeffs, image, rows, protos, masks, targets)
            total = total + weight * (mean_bce / areas).sum() / count
        return total

    def _semantic_term(self, logits: torch.Tensor, masks: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Half BCE, half soft Dice between (B, nc, h, w) logits and each class's instance-mask union."""
        batch, num_classes = logits.shape[:2]
        truth = torch.zeros(batch, num_classes, *masks.shape[-2:], device=logits.device)
        if len(targets):
            rows = torch.arange(len(targets), device=logits.device)
            row_ids = overlap_instance_ids(targets[:, 0].long()) if self.overlap else None
            instance = self._instance_masks(masks, rows, targets, row_ids)
            truth.index_put_((targets[:, 0].long(), targets[:, 1].long()), instance, accumulate=True)
            truth.clamp_(max=1.0)
        truth = semantic_targets(truth, logits.shape[-2:])
        bce = F.binary_cross_entropy_with_logits(logits, truth)
        probs = logits.sigmoid()
        overlap = (probs * truth).sum(dim=(2, 3))
        dice = 1 - (2 * overlap + 1) / (probs.sum(dim=(2, 3)) + truth.sum(dim=(2, 3)) + 1)
        return 0.5 * bce + 0.5 * dice.mean()
