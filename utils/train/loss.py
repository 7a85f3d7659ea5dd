"""YOLOv5 detection loss: anchor/cell target assignment, CIoU box loss, objectness and class BCE."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from utils.boxes import bbox_iou
from utils.distributed import unwrap_model

if TYPE_CHECKING:
    from utils.hyp import Hyp

# Objectness weight per level (P3, P4, P5): fine grids have many more cells, mostly background.
LEVEL_BALANCE = {3: (4.0, 1.0, 0.4)}
FOCAL_ALPHA = 0.25


@dataclass(frozen=True)
class LossGains:
    """Weights of the three loss terms, already scaled for model depth, class count and image size."""

    box: float
    obj: float
    cls: float


def scale_loss_gains(
    hyp_box: float, hyp_cls: float, hyp_obj: float, num_classes: int, imgsz: int, num_levels: int
) -> LossGains:
    """Scale the hyp-file gains (tuned for 80 classes, 640 px, 3 levels) to this model and data (YOLOv5 rule).

    box *= 3/nl; cls *= nc/80 * 3/nl; obj *= (imgsz/640)^2 * 3/nl: the class term grows with the
    number of class logits, the objectness term with the number of cells.
    """
    level_factor = 3 / num_levels
    return LossGains(
        box=hyp_box * level_factor,
        obj=hyp_obj * (imgsz / 640) ** 2 * level_factor,
        cls=hyp_cls * num_classes / 80 * level_factor,
    )


def smooth_bce_targets(label_smoothing: float) -> tuple[float, float]:
    """Return the (positive, negative) BCE targets for a label-smoothing epsilon: (1 - eps/2, eps/2)."""
    return 1.0 - 0.5 * label_smoothing, 0.5 * label_smoothing


def write_last(target: torch.Tensor, index: torch.Tensor, values: torch.Tensor, valid: torch.Tensor) -> None:
    """`target[index] = values` in place for the `valid` rows, a repeated index taking its last value, on every device.

    Plain index assignment with repeated indices writes them sequentially on CPU (the last wins, as
    YOLOv5's loss relies on) but in no defined order on CUDA, where same-seed runs would then differ.
    Only each index's last valid occurrence is written to its place; every other row writes to the spare
    last element of `target`, so no shape depends on the device's values. target: 1-D, one element longer
    than the indices reach; index: (m,) int64; values: (m,); valid (m,) bool.
    """
    spare = len(target) - 1
    position = torch.arange(len(index), device=index.device)
    index = torch.where(valid, index, spare)
    last = torch.full_like(target, -1, dtype=torch.int64).scatter_reduce_(0, index, position, "amax")
    target[torch.where(last[index] == position, index, spare)] = values.to(target.dtype)


def class_targets(classes: torch.Tensor, num_classes: int, label_smoothing: float = 0.0) -> torch.Tensor:
    """Return (n, num_classes) float BCE targets: the positive value at each `classes` id, negative elsewhere."""
    positive, negative = smooth_bce_targets(label_smoothing)
    is_class = torch.arange(num_classes, device=classes.device) == classes.long()[:, None]
    return torch.where(is_class, positive, negative)


def bce_with_logits(
    logits: torch.Tensor, targets: torch.Tensor, pos_weight: float, fl_gamma: float, reduction: str = "mean"
) -> torch.Tensor:
    """BCE on logits (mean, sum or none) with a positive-class weight; focal-modulated (alpha 0.25) when fl_gamma > 0.

    The focal factor (1 - p_t)^gamma down-weights easy examples (Lin et al. 2017).
    """
    weight = logits.new_full((), pos_weight)  # filled on the device: no host-to-device copy
    loss = F.binary_cross_entropy_with_logits(logits, targets, pos_weight=weight, reduction="none")
    if fl_gamma > 0:
        prob = logits.sigmoid()
        p_t = targets * prob + (1 - targets) * (1 - prob)
        alpha = targets * FOCAL_ALPHA + (1 - targets) * (1 - FOCAL_ALPHA)
        loss = loss * alpha * (1 - p_t) ** fl_gamma
    if reduction == "none":
        return loss
    return loss.sum() if reduction == "sum" else loss.mean()


@dataclass
class LevelTargets:
    """Targets assigned to one feature level; m rows, one per (target, anchor, cell) match candidate.

    `boxes_xywh` are in grid units, xy relative to the cell's top-left corner (so in [-0.5, 1.5]
    for neighbour cells), wh absolute; `anchors` are the matched anchors' (w, h) in grid units.
    `valid` says which rows are matches: all of them in the compact form, those of the fixed-shape
    form's every (cell shift, anchor, target) row that the rules keep (the others hold clamped cells).
    """

    image_index: torch.Tensor  # (m,) long
    anchor_index: torch.Tensor  # (m,) long
    cell_y: torch.Tensor  # (m,) long
    cell_x: torch.Tensor  # (m,) long
    boxes_xywh: torch.Tensor  # (m, 4) float
    anchors: torch.Tensor  # (m, 2) float
    classes: torch.Tensor  # (m,) long
    target_index: torch.Tensor  # (m,) long, the matched row of `targets`
    valid: torch.Tensor  # (m,) bool


def assign_targets(
    targets: torch.Tensor,
    anchors: torch.Tensor,
    grid_hw: tuple[int, int],
    anchor_t: float,
    static_shapes: bool = False,
) -> LevelTargets:
    """Match targets to the anchors and cells of one level, YOLOv5 style.

    targets: (N, 6) [image, cls, cx, cy, w, h] normalised; anchors: (na, 2) grid units.
    A target matches every anchor whose w and h ratios to it are all within `anchor_t`; each
    match goes to the cell holding the centre plus the two neighbour cells nearest the centre
    (one horizontal, one vertical, when they exist), tripling positives for faster training.
    Rows are ordered by cell shift, then anchor, then target. Compact (`nonzero`, a host read on a
    GPU) by default; `static_shapes` returns every (shift, anchor, target) row, 5 x na x N, with
    `valid` marking the matches, so no shape depends on the device's values.
    """
    height, width = grid_hw
    cx, cy, w, h = targets[:, 2:6].unbind(-1)
    boxes = torch.stack((cx * width, cy * height, w * width, h * height), -1)  # (N, 4) grid units
    ratio = boxes[None, :, 2:4] / anchors[:, None, :]  # (na, N, 2)
    fits = torch.max(ratio, 1 / ratio).amax(dim=2) < anchor_t  # (na, N)
    xy = boxes[:, :2]
    xy_from_end = torch.stack((width - xy[:, 0], height - xy[:, 1]), -1)
    near_low = (xy % 1 < 0.5) & (xy > 1)  # left / upper neighbour exists and is the nearer one
    near_high = (xy_from_end % 1 < 0.5) & (xy_from_end > 1)  # right / lower neighbour
    own_cell = torch.ones_like(near_low[:, 0])
    use_shift = torch.stack((own_cell, near_low[:, 0], near_low[:, 1], near_high[:, 0], near_high[:, 1]))  # (5, N)
    valid = use_shift[:, None, :] & fits[None]  # (5, na, N)
    if static_shapes:
        shift_index, anchor_index, target_index = (
            torch.arange(size, device=targets.device).view(shape).expand_as(valid).reshape(-1)
            for size, shape in ((5, (5, 1, 1)), (len(anchors), (1, -1, 1)), (len(targets), (1, 1, -1)))
        )
        valid = valid.reshape(-1)
    else:
        shift_index, anchor_index, target_index = valid.nonzero(as_tuple=True)
        valid = torch.ones_like(shift_index, dtype=torch.bool)
    # Shift index -> cell offset: 0 own cell, 1 left, 2 up, 3 right, 4 down (arithmetic, not a lookup in a
    # table: a tensor made from Python data is a host-to-device copy, which waits on a GPU).
    dx = (shift_index == 3).long() - (shift_index == 1).long()
    dy = (shift_index == 4).long() - (shift_index == 2).long()
    cells = xy[target_index].floor().long() + torch.stack((dx, dy), -1)
    cells[:, 0].clamp_(0, width - 1)
    cells[:, 1].clamp_(0, height - 1)
    boxes = boxes[target_index]
    return LevelTargets(
        image_index=targets[target_index, 0].long(),
        anchor_index=anchor_index,
        cell_y=cells[:, 1],
        cell_x=cells[:, 0],
        boxes_xywh=torch.cat((boxes[:, :2] - cells, boxes[:, 2:4]), dim=1),
        anchors=anchors[anchor_index],
        classes=targets[target_index, 1].long(),
        target_index=target_index,
        valid=valid,
    )


@dataclass(frozen=True)
class LevelTerms:
    """One level's loss pieces before normalisation: box and class sums over matches, objectness mean.

    `num_matches` is a 0-d float on the device. `assigned` and `matched_preds` (m, no) float32, the raw
    predictions at its rows' cells, let a subclass add terms over the same matches (segmentation's mask
    coefficients); `matches()` keeps the valid rows of both.
    """

    box_sum: torch.Tensor
    cls_sum: torch.Tensor
    obj_mean: torch.Tensor
    num_matches: torch.Tensor
    assigned: LevelTargets
    matched_preds: torch.Tensor

    def matches(self) -> tuple[LevelTargets, torch.Tensor]:
        """(assigned, matched_preds) of the valid rows only; reads their count from the device."""
        rows = self.assigned.valid.nonzero().squeeze(1)
        return LevelTargets(*(value[rows] for value in vars(self.assigned).values())), self.matched_preds[rows]


LossT = TypeVar("LossT", bound="DetectionLoss")


class DetectionLoss:
    """YOLOv5 detection loss: (1 - CIoU) box + objectness BCE (IoU as target) + class BCE.

    Reads anchors, level count and class count from `model.head` (unwrapping DDP) at every call,
    so anchors refit by AutoAnchor after construction are used. `__call__(preds, targets)`:
    preds are the raw training outputs [(B, na, H_l, W_l, no)], targets (N, 6) [image, cls, cx, cy,
    w, h] normalised. Returns (loss (1,) multiplied by the batch size, items (3,) [box, obj, cls]
    detached). With a single class the class term is skipped (always right). `static_shapes`:
    the assignment in fixed shapes (`assign_targets`), the same loss without host reads on a GPU.
    """

    item_names = ("box", "obj", "cls")

    def __init__(
        self,
        model: nn.Module,
        gains: LossGains,
        *,
        label_smoothing: float = 0.0,
        anchor_t: float = 4.0,
        fl_gamma: float = 0.0,
        cls_pw: float = 1.0,
        obj_pw: float = 1.0,
        static_shapes: bool = False,
    ) -> None:
        self.head = unwrap_model(model).head
        if self.head.num_levels not in LEVEL_BALANCE:
            raise ValueError(f"DetectionLoss: no objectness balance for {self.head.num_levels} levels")
        self.gains = gains
        self.label_smoothing = label_smoothing
        self.anchor_t = anchor_t
        self.fl_gamma = fl_gamma
        self.cls_pw = cls_pw
        self.obj_pw = obj_pw
        self.static_shapes = static_shapes
        self.one_graph = static_shapes  # torch.compile traces it whole (engine.compiled_loss)

    @classmethod
    def from_hyp(cls: type[LossT], model: nn.Module, hyp: Hyp, imgsz: int, **kwargs: Any) -> LossT:
        """Build the loss with gains scaled for this model's head, class count and `imgsz`, options from `hyp`.

        `kwargs` are extra constructor arguments of a subclass (e.g. segmentation's `overlap`).
        """
        head = unwrap_model(model).head
        gains = scale_loss_gains(hyp.box, hyp.cls, hyp.obj, head.num_classes, imgsz, head.num_levels)
        options = {"anchor_t": hyp.anchor_t, "fl_gamma": hyp.fl_gamma, "cls_pw": hyp.cls_pw, "obj_pw": hyp.obj_pw}
        return cls(model, gains, label_smoothing=hyp.label_smoothing, **options, **kwargs)

    def start_epoch(self, epoch: int, epochs: int) -> None:
        """Called by the engine before each epoch; YOLOv5's loss does not change over the run."""

    def __call__(
        self,
        preds: list[torch.Tensor],
        targets: torch.Tensor,
        reduce_counts: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Compute the loss for one batch; see the class docstring for shapes.

        Box and class terms are means over matched anchors. Under DDP pass `reduce_counts`
        (e.g. all-reduce then divide by the world size): each level's match count is then the
        mean over ranks, so the ranks' losses add up to exactly one process's loss on the global
        batch even when ranks match different numbers of anchors. Objectness is a mean over
        cells, which equal per-rank batches already make exact. Without it (evaluation, one
        process) each call normalises by its own counts, as YOLOv5 does.
        """
        levels, denominators = self._match_levels(preds, targets, reduce_counts)
        losses = torch.stack(self._detection_terms(levels, denominators))
        return losses.sum().view(1) * preds[0].shape[0], losses.detach()

    def _match_levels(
        self,
        preds: list[torch.Tensor],
        targets: torch.Tensor,
        reduce_counts: Callable[[torch.Tensor], torch.Tensor] | None,
    ) -> tuple[list[LevelTerms], torch.Tensor]:
        """Assign targets and compute every level's terms; return them and the (nl,) match-count denominators.

        A denominator is the level's match count (reduced over ranks by `reduce_counts` when given),
        at least 1. Math is fp32 even under AMP.
        """
        targets = targets.to(device=preds[0].device, dtype=torch.float32)
        levels = [self._level_losses(raw.float(), level, targets) for level, raw in enumerate(preds)]
        counts = torch.stack([level.num_matches for level in levels])
        if reduce_counts is not None:
            counts = reduce_counts(counts)
        return levels, counts.clamp(min=1.0)

    def _detection_terms(
        self, levels: list[LevelTerms], denominators: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Return the weighted (box, obj, cls) losses, 0-d each, from `_match_levels`'s output."""
        balance = LEVEL_BALANCE[self.head.num_levels]
        box_loss = obj_loss = cls_loss = denominators.new_zeros(())
        for level, (terms, denominator) in enumerate(zip(levels, denominators, strict=True)):
            box_loss = box_loss + terms.box_sum / denominator
            cls_loss = cls_loss + terms.cls_sum / (denominator * max(self.head.num_classes, 1))
            obj_loss = obj_loss + terms.obj_mean * balance[level]
        return box_loss * self.gains.box, obj_loss * self.gains.obj, cls_loss * self.gains.cls

    def _level_losses(self, raw: torch.Tensor, level: int, targets: torch.Tensor) -> LevelTerms:
        """Return one level's box and class loss sums over matches and its objectness mean.

        raw: (B, na, H, W, no) float32.
        """
        num_classes = self.head.num_classes
        anchors = self.head.anchors[level].float()
        assigned = assign_targets(targets, anchors, tuple(raw.shape[2:4]), self.anchor_t, self.static_shapes)
        valid = assigned.valid
        cells = (assigned.image_index, assigned.anchor_index, assigned.cell_y, assigned.cell_x)
        pred = raw[cells]  # (m, no)
        # Every row is computed and the invalid ones (static shapes) are left out of the sums by `where`.
        pred_xy = pred[:, 0:2].sigmoid() * 2 - 0.5
        pred_wh = (pred[:, 2:4].sigmoid() * 2) ** 2 * assigned.anchors
        iou = bbox_iou(torch.cat((pred_xy, pred_wh), 1), assigned.boxes_xywh, xywh=True, kind="ciou")
        box_sum = torch.where(valid, 1.0 - iou, 0.0).sum()
        # Objectness learns to predict the box quality; where matches share a cell the last one wins (YOLOv5).
        _, num_anchors, height, width = raw.shape[:4]
        obj_target = raw.new_zeros(raw[..., 4].numel() + 1)  # one spare element for write_last
        flat = ((assigned.image_index * num_anchors + assigned.anchor_index) * height + assigned.cell_y) * width
        write_last(obj_target, flat + assigned.cell_x, iou.detach().clamp(min=0), valid)
        obj_target = obj_target[:-1].view(raw.shape[:4])
        cls_sum = raw.new_zeros(())
        if num_classes > 1:
            wanted = class_targets(assigned.classes, num_classes, self.label_smoothing)
            bce = bce_with_logits(pred[:, 5 : 5 + num_classes], wanted, self.cls_pw, self.fl_gamma, "none")
            cls_sum = torch.where(valid[:, None], bce, 0.0).sum()
        obj_mean = bce_with_logits(raw[..., 4], obj_target, self.obj_pw, self.fl_gamma)
        return LevelTerms(box_sum, cls_sum, obj_mean, valid.sum().float(), assigned, pred)
