"""Anchor-free loss: task-aligned assignment, BCE on aligned scores, CIoU + DFL (or L1) boxes, one-to-one branch."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from models.dense_head import DenseRaw, anchor_points, distribution_to_distances
from utils.boxes import bbox_iou
from utils.distributed import unwrap_model
from utils.train.assign import AlignOptions, Assignment, Labels, settle, top_candidates
from utils.train.device_constants import ShapeCache

if TYPE_CHECKING:
    from utils.hyp import Hyp

# One-to-one branch (YOLOv10 / YOLO26): its labels take 7 candidates and keep the single best, the
# one-to-many branch 10 (TOOD). The one-to-many weight falls from 0.8 to 0.1 over the run and the
# one-to-one weight rises to match, so early training shapes the features and late training the
# NMS-free outputs.
ONE_TO_ONE = AlignOptions(topk=7, topk2=1)
ONE_TO_MANY_WEIGHT = (0.8, 0.1)


@dataclass(frozen=True)
class DenseGains:
    """Weights of the box (CIoU), class (BCE) and distribution (DFL, or L1 with reg_max 1) terms."""

    box: float
    cls: float
    dfl: float


@dataclass
class BranchTerms:
    """One branch's loss sums before normalisation, and what a mask term needs of its assignment."""

    box_sum: torch.Tensor
    cls_sum: torch.Tensor
    dist_sum: torch.Tensor
    score_sum: torch.Tensor  # the normaliser: sum of the soft class targets (this rank)
    assignment: Assignment
    flat: torch.Tensor  # (B, N, no) float32 raw outputs
    point_boxes: torch.Tensor  # (B, N, 4) xyxy input pixels, predicted


def distribution_loss(logits: torch.Tensor, target: torch.Tensor, reg_max: int) -> torch.Tensor:
    """DFL (GFL, Li et al. 2020): cross-entropy pulling the two bins around each target distance, per point.

    logits: (n, 4 * reg_max); target: (n, 4) distances in grid units. The target is clamped just below
    the last bin; its neighbours floor(t) and floor(t) + 1 are weighted by closeness. Returns (n,) the
    mean over the 4 sides.
    """
    target = target.clamp(0, reg_max - 1 - 0.01)
    left = target.long()
    right_weight = target - left
    logits = logits.view(-1, reg_max)
    left_loss = F.cross_entropy(logits, left.view(-1), reduction="none").view(left.shape)
    right_loss = F.cross_entropy(logits, (left + 1).view(-1), reduction="none").view(left.shape)
    return (left_loss * (1 - right_weight) + right_loss * right_weight).mean(-1)


LossT = TypeVar("LossT", bound="DenseLoss")


class DenseLoss:
    """Anchor-free detection loss over DenseHead outputs; items [box, cls, dfl] ([box, cls, l1] at reg_max 1).

    Per branch: labels are assigned to points by task alignment (utils/train/assign.py); the class
    term is BCE of every point's logits against the soft targets; the box term is (1 - CIoU) and the
    distribution term DFL (reg_max > 1) or L1 on the side distances over the image size (reg_max 1),
    both over foreground points weighted by their target score. All three are divided by the sum of
    target scores: under DDP pass `reduce_counts`, which turns each rank's sum into the mean over
    ranks, so N ranks give one process's gradients on the global batch. An end-to-end model adds its
    one-to-one branch with the epoch's weight (`start_epoch`). Returns (loss (1,) x batch size, items
    (3,) detached), as DetectionLoss does.
    """

    def __init__(
        self, model: nn.Module, gains: DenseGains, *, label_smoothing: float = 0.0, align: AlignOptions | None = None
    ) -> None:
        self.head = unwrap_model(model).head
        self.gains = gains
        self.label_smoothing = label_smoothing
        self.align = align or AlignOptions()
        self.one_graph = self.align.static_shapes  # torch.compile traces it whole (state.compiled_loss)
        self._points = ShapeCache(self._anchor_points)
        # A 0-d CPU tensor, not a float: under torch.compile a float is a constant of the graph, and its
        # change every epoch would compile the loss again; a tensor is an input. Multiplying a device
        # tensor by a CPU scalar tensor reads nothing from the device.
        self.one_to_one_weight = torch.tensor(1 - ONE_TO_MANY_WEIGHT[0] if self.head.end_to_end else 0.0)
        self.item_names = ("box", "cls", "dfl" if self.head.reg_max > 1 else "l1")

    @classmethod
    def from_hyp(
        cls: type[LossT], model: nn.Module, hyp: Hyp, imgsz: int, *, static_shapes: bool = False, **kwargs: Any
    ) -> LossT:
        """Build the loss with the hyp file's box, cls and dfl gains (no scaling by image size or classes).

        `static_shapes`: the assignment's candidate search in fixed shapes (`AlignOptions.static_shapes`).
        """
        gains = DenseGains(hyp.box, hyp.cls, float(hyp.dfl))
        align = AlignOptions(static_shapes=static_shapes)
        return cls(model, gains, label_smoothing=hyp.label_smoothing, align=align, **kwargs)

    def start_epoch(self, epoch: int, epochs: int) -> None:
        """Set the branch weights for `epoch` (0-based) of `epochs`: one-to-many 0.8 -> 0.1, one-to-one the rest."""
        if not self.head.end_to_end:
            return
        start, end = ONE_TO_MANY_WEIGHT
        progress = min(epoch / max(epochs - 1, 1), 1.0)
        self.one_to_one_weight = torch.tensor(1 - (start + (end - start) * progress))

    def _anchor_points(
        self, sizes: tuple[tuple[int, int], ...], device: torch.device, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(strides (N, 1), points (N, 2) in input pixels) of the anchor points of these level sizes."""
        points, strides = anchor_points(sizes, self.head.level_strides, torch.empty(0, device=device), dtype)
        return strides, points * strides

    def __call__(
        self,
        preds: DenseRaw,
        targets: torch.Tensor,
        reduce_counts: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Compute the loss for one batch; see the class docstring."""
        branches, denominators = self._branches(preds, targets, reduce_counts)
        items = self._weighted_items(branches, denominators)
        return items.sum().view(1) * preds.levels[0].shape[0], items.detach()

    def _branches(
        self,
        preds: DenseRaw,
        targets: torch.Tensor,
        reduce_counts: Callable[[torch.Tensor], torch.Tensor] | None,
    ) -> tuple[list[tuple[float, BranchTerms]], torch.Tensor]:
        """Every trained branch as (weight, terms) and their normalisers (reduced over ranks when asked)."""
        levels = preds.levels
        finest = int(self.head.level_strides[0])
        input_hw = (levels[0].shape[2] * finest, levels[0].shape[3] * finest)
        labels = Labels.from_targets(targets.to(device=levels[0].device, dtype=torch.float32), input_hw)
        weighted = []
        if preds.one_to_one is not None:
            weighted.append((1 - self.one_to_one_weight, self._branch(levels, labels, input_hw, self.align)))
            one_to_one = replace(
                ONE_TO_ONE, max_elements=self.align.max_elements, static_shapes=self.align.static_shapes
            )
            weighted.append((self.one_to_one_weight, self._branch(preds.one_to_one, labels, input_hw, one_to_one)))
        else:
            weighted.append((1.0, self._branch(levels, labels, input_hw, self.align)))
        sums = torch.stack([terms.score_sum for _, terms in weighted])
        if reduce_counts is not None:
            sums = reduce_counts(sums)
        # A floor of 1 on the global sum (few, poorly predicted labels early on), the same on any world size.
        return weighted, sums.clamp(min=1.0 / getattr(reduce_counts, "world_size", 1))

    def _weighted_items(self, branches: list[tuple[float, BranchTerms]], denominators: torch.Tensor) -> torch.Tensor:
        """(3,) [box, cls, dist] gained, normalised and summed over branches by weight."""
        items = []
        for (weight, terms), denominator in zip(branches, denominators, strict=True):
            sums = torch.stack((terms.box_sum, terms.cls_sum, terms.dist_sum)) / denominator
            items.append(weight * sums)
        box, cls, dist = torch.stack(items).sum(0).unbind()  # gains as Python numbers: no host-to-device copy
        return torch.stack((box * self.gains.box, cls * self.gains.cls, dist * self.gains.dfl))

    def _branch(
        self, levels: list[torch.Tensor], labels: Labels, input_hw: tuple[int, int], options: AlignOptions
    ) -> BranchTerms:
        """Assign and compute one branch's sums; math in fp32 even under AMP.

        The box and distribution terms run over the assignment's fixed-shape matches, (L, topk) pairs of
        which those not kept weigh 0, rather than over a `nonzero` list of foreground points: no shape
        depends on the device's values, so a GPU step need not wait for them.
        """
        head, reg_max = self.head, self.head.reg_max
        flat = head.flatten([level.float() for level in levels])  # (B, N, no)
        sizes = [tuple(level.shape[2:]) for level in levels]
        strides, pixel_points = self._points(tuple(sizes), flat.device, flat.dtype)
        box_end = 4 * reg_max
        bins = head.bins.weight if head.bins is not None else None
        distances = distribution_to_distances(flat[..., :box_end], reg_max, bins)  # (B, N, 4) grid units
        boxes = torch.cat(
            (pixel_points - distances[..., :2] * strides, pixel_points + distances[..., 2:] * strides), -1
        )
        logits = flat[..., box_end : box_end + head.num_classes]
        candidates = top_candidates(logits.detach().sigmoid(), boxes.detach(), pixel_points, labels, options)
        point, image = candidates.point, candidates.image  # (L, k)
        target_boxes = labels.boxes[:, None, :].expand(*point.shape, 4)
        # The candidates' CIoU, once: with its gradient for the box term, detached for the assignment.
        iou = bbox_iou(target_boxes, boxes[image, point], xywh=False, kind="ciou")
        assignment = settle(candidates, iou, labels, options, logits.shape)
        target_scores = assignment.target_scores
        if self.label_smoothing:  # as YOLOv5's smoothing: positives towards 1 - eps/2, negatives eps/2
            target_scores = target_scores * (1 - self.label_smoothing) + 0.5 * self.label_smoothing
        cls_sum = F.binary_cross_entropy_with_logits(logits, target_scores, reduction="sum")
        weight = assignment.matches.quality  # (L, k); 0 on pairs not kept
        box_sum = ((1.0 - iou) * weight).sum()
        stride = strides[point]
        target_ltrb = torch.cat(
            (pixel_points[point] - target_boxes[..., :2], target_boxes[..., 2:] - pixel_points[point]), -1
        )
        if reg_max > 1:
            logits_ltrb = flat[image, point, :box_end].reshape(-1, box_end)
            dist = distribution_loss(logits_ltrb, (target_ltrb / stride).reshape(-1, 4), reg_max).view(point.shape)
        else:  # YOLO26: the distances themselves, in pixels over the image size (left, top, right, bottom)
            height, width = input_hw
            error = (distances[image, point] * stride - target_ltrb).abs()
            dist = ((error[..., 0] + error[..., 2]) / width + (error[..., 1] + error[..., 3]) / height) / 4
        dist_sum = (dist * weight).sum()
        return BranchTerms(box_sum, cls_sum, dist_sum, assignment.target_scores.sum(), assignment, flat, boxes)
