"""YOLOv5 detection loss: anchor/cell target assignment, CIoU box loss, objectness and class BCE."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from utils.boxes import bbox_iou
from utils.distributed import unwrap_model
from utils.train.device_constants import ShapeCache, filled_table

if TYPE_CHECKING:
    from utils.hyp import Hyp

# Objectness weight per level (P3, P4, P5; and P6 for the four-level models): fine grids have many
# more cells, mostly background. YOLOv5's values, keyed by the head's level count.
LEVEL_BALANCE = {3: (4.0, 1.0, 0.4), 4: (4.0, 1.0, 0.25, 0.06)}
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
class AnchorMatches:
    """Targets matched to anchors and cells on every feature level; m rows, one per (target, anchor, cell) candidate.

    Rows are ordered by level, then cell shift, then anchor, then target, so each level's rows form one
    contiguous block (`AssignedTargets.level_rows` long). `boxes_xywh` are in their level's grid units,
    xy relative to the cell's top-left corner (so in [-0.5, 1.5] for neighbour cells), wh absolute;
    `anchors` are the matched anchors' (w, h) in grid units. `valid` says which rows are matches: all of
    them in the compact form, those of the fixed-shape form's every (level, cell shift, anchor, target)
    row that the rules keep (the others hold clamped cells).
    """

    level: torch.Tensor  # (m,) long
    image_index: torch.Tensor  # (m,) long
    anchor_index: torch.Tensor  # (m,) long
    cell_y: torch.Tensor  # (m,) long
    cell_x: torch.Tensor  # (m,) long
    boxes_xywh: torch.Tensor  # (m, 4) float
    anchors: torch.Tensor  # (m, 2) float
    classes: torch.Tensor  # (m,) long
    target_index: torch.Tensor  # (m,) long, the matched row of `targets`
    valid: torch.Tensor  # (m,) bool

    def select(self, rows: torch.Tensor) -> AnchorMatches:
        """The matches at `rows` ((k,) long), in that order."""
        return AnchorMatches(**{field.name: getattr(self, field.name)[rows] for field in dataclasses.fields(self)})


@dataclass(frozen=True)
class AssignedTargets:
    """`assign_targets`'s result: the matches, each level's row count (host ints) and match count ((nl,) long)."""

    matches: AnchorMatches
    level_rows: tuple[int, ...]
    counts: torch.Tensor


@dataclass(frozen=True)
class GridTables:
    """Per-level constants of one set of grid shapes, made on the device once (`grid_tables`).

    size_wh (nl, 2) float: each level's grid width and height; last_xy (nl, 2) long: its last cell
    (width - 1, height - 1); cells (nl, 3) long: its height, width and the number of cells per anchor
    and image of the levels before it; shift_xy (5, 2) long: the cell offset of each neighbour shift
    (own cell, left, up, right, down).
    """

    size_wh: torch.Tensor
    last_xy: torch.Tensor
    cells: torch.Tensor
    shift_xy: torch.Tensor


def grid_tables(grids_hw: Sequence[tuple[int, int]], device: torch.device) -> GridTables:
    """Build the `GridTables` of grids [(height, width) per level] on `device`."""
    # Cells per anchor and image of the levels before each level.
    starts = itertools.accumulate((height * width for height, width in grids_hw[:-1]), initial=0)
    return GridTables(
        size_wh=filled_table([[width, height] for height, width in grids_hw], torch.float32, device),
        last_xy=filled_table([[width - 1, height - 1] for height, width in grids_hw], torch.int64, device),
        cells=filled_table(
            [[h, w, before] for (h, w), before in zip(grids_hw, starts, strict=True)], torch.int64, device
        ),
        shift_xy=filled_table([[0, 0], [-1, 0], [0, -1], [1, 0], [0, 1]], torch.int64, device),
    )


def assign_targets(
    targets: torch.Tensor,
    anchors: torch.Tensor,
    tables: GridTables,
    anchor_t: float,
    static_shapes: bool = False,
) -> AssignedTargets:
    """Match targets to the anchors and cells of every level at once, YOLOv5 style.

    targets: (N, 6) [image, cls, cx, cy, w, h] normalised; anchors: (nl, na, 2) grid units; `tables`:
    the levels' grids (`grid_tables`). A target matches every anchor of a level whose w and h ratios
    to it are all within `anchor_t`; each match goes to the cell holding the centre plus the two
    neighbour cells nearest the centre (one horizontal, one vertical, when they exist), tripling
    positives for faster training. Compact (`nonzero`, a host read on a GPU) by default;
    `static_shapes` returns every (level, shift, anchor, target) row, nl x 5 x na x N, with `valid`
    marking the matches, so no shape depends on the device's values. All levels go through each
    operation together: the loss's cost on a GPU is its number of small operations.
    """
    num_levels, num_anchors = anchors.shape[:2]
    size_wh = tables.size_wh[:, None, :]  # (nl, 1, 2)
    xy = targets[None, :, 2:4] * size_wh  # (nl, N, 2) grid units
    wh = targets[None, :, 4:6] * size_wh
    ratio = wh[:, None] / anchors[:, :, None]  # (nl, na, N, 2)
    fits = torch.max(ratio, 1 / ratio).amax(dim=3) < anchor_t  # (nl, na, N)
    xy_from_end = size_wh - xy
    near_low = (xy % 1 < 0.5) & (xy > 1)  # left / upper neighbour exists and is the nearer one
    near_high = (xy_from_end % 1 < 0.5) & (xy_from_end > 1)  # right / lower neighbour
    own_cell = torch.ones_like(near_low[:, None, :, 0])
    # (nl, 5, N): own cell, left, up, right, down -- the rows of `tables.shift_xy`.
    use_shift = torch.cat((own_cell, near_low.transpose(1, 2), near_high.transpose(1, 2)), 1)
    valid = use_shift[:, :, None, :] & fits[:, None]  # (nl, 5, na, N)
    counts = valid.flatten(1).sum(1)
    if static_shapes:
        level, shift, anchor, target = (
            torch.arange(size, device=targets.device).view(shape).expand_as(valid).reshape(-1)
            for size, shape in (
                (num_levels, (-1, 1, 1, 1)),
                (5, (1, -1, 1, 1)),
                (num_anchors, (1, 1, -1, 1)),
                (len(targets), (1, 1, 1, -1)),
            )
        )
        valid = valid.reshape(-1)
        level_rows = (5 * num_anchors * len(targets),) * num_levels
    else:
        level, shift, anchor, target = valid.nonzero(as_tuple=True)
        valid = torch.ones_like(level, dtype=torch.bool)
        level_rows = tuple(counts.tolist())  # the nonzero above has waited for the device already
    centre = xy[level, target]
    # A neighbour is the cell half a cell away from the centre (YOLOv5's rule): a centre on a cell edge, x = 4.0,
    # takes cell 3 on the left and its own cell 4 on the right, whose offsets the head can reach.
    neighbour = (centre + 0.5 * tables.shift_xy[shift]).floor().long()
    cells = torch.minimum(neighbour.clamp_(min=0), tables.last_xy[level])
    picked = targets[target]
    matches = AnchorMatches(
        level=level,
        image_index=picked[:, 0].long(),
        anchor_index=anchor,
        cell_y=cells[:, 1],
        cell_x=cells[:, 0],
        boxes_xywh=torch.cat((centre - cells, wh[level, target]), dim=1),
        anchors=anchors[level, anchor],
        classes=picked[:, 1].long(),
        target_index=target,
        valid=valid,
    )
    return AssignedTargets(matches, level_rows, counts)


@dataclass(frozen=True)
class LevelMatches:
    """The loss's matches on all levels with what the terms need of them.

    `raw`: each level's raw output (B, na, H, W, no) in float32; `preds` (m, no) float32: the raw
    predictions at the rows' cells; `cells` (m,) long: each row's cell in all levels' (B, na, H, W)
    grids laid end to end; `denominators` (nl,): each level's match count (reduced over ranks when
    asked), at least 1. A subclass adds terms over the same matches (segmentation's mask
    coefficients); `kept()` gives the valid rows of `assigned` and `preds`.
    """

    raw: list[torch.Tensor]
    assigned: AnchorMatches
    preds: torch.Tensor
    cells: torch.Tensor
    denominators: torch.Tensor

    def kept(self) -> tuple[AnchorMatches, torch.Tensor]:
        """(assigned, preds) of the valid rows only; with static shapes this reads their count from the device."""
        rows = self.assigned.valid.nonzero().squeeze(1)
        return self.assigned.select(rows), self.preds[rows]


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
        self.one_graph = static_shapes  # torch.compile traces it whole (state.compiled_loss)
        self._grid_tables = ShapeCache(grid_tables)

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
        matched = self._match(preds, targets, reduce_counts)
        losses = torch.stack(self._detection_terms(matched))
        return losses.sum().view(1) * preds[0].shape[0], losses.detach()

    def _match(
        self,
        preds: list[torch.Tensor],
        targets: torch.Tensor,
        reduce_counts: Callable[[torch.Tensor], torch.Tensor] | None,
    ) -> LevelMatches:
        """Assign targets on every level and gather the predictions at the matched cells.

        A level's denominator is its match count (reduced over ranks by `reduce_counts` when given),
        at least 1. Math is fp32 even under AMP.
        """
        preds = [raw.float() for raw in preds]
        device = preds[0].device
        targets = targets.to(device=device, dtype=torch.float32)
        grids_hw = tuple((raw.shape[2], raw.shape[3]) for raw in preds)
        tables = self._grid_tables(grids_hw, device)
        assigned = assign_targets(targets, self.head.anchors.float(), tables, self.anchor_t, self.static_shapes)
        matches = assigned.matches
        # Each row's cell in its level's (B, na, H, W) grid, then in all levels' grids laid end to end.
        batch, num_anchors = preds[0].shape[:2]
        height, width, before = tables.cells[matches.level].unbind(1)
        level_cells = ((matches.image_index * num_anchors + matches.anchor_index) * height + matches.cell_y) * width
        level_cells = level_cells + matches.cell_x
        blocks = level_cells.split(assigned.level_rows)
        gathered = torch.cat([raw.reshape(-1, raw.shape[-1])[index] for raw, index in zip(preds, blocks, strict=True)])
        cells = level_cells + before * (batch * num_anchors)
        counts = assigned.counts.float()
        if reduce_counts is not None:
            counts = reduce_counts(counts)
        # A floor of 1 on the global count, the same on any world size (counts are the ranks' mean here).
        return LevelMatches(
            preds, matches, gathered, cells, counts.clamp(min=1.0 / getattr(reduce_counts, "world_size", 1))
        )

    def _detection_terms(self, matched: LevelMatches) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Return the weighted (box, obj, cls) losses, 0-d each: box and class over all levels' matches at once.

        Each match's box and class terms are divided by its level's denominator; objectness is each
        level's mean BCE weighted by `LEVEL_BALANCE`.
        """
        matches, pred = matched.assigned, matched.preds
        per_match = matched.denominators[matches.level]
        pred_xy = pred[:, 0:2].sigmoid() * 2 - 0.5
        pred_wh = (pred[:, 2:4].sigmoid() * 2) ** 2 * matches.anchors
        iou = bbox_iou(torch.cat((pred_xy, pred_wh), 1), matches.boxes_xywh, xywh=True, kind="ciou")
        # Every row is computed and the invalid ones (static shapes) are left out of the sums by `where`.
        box_loss = (torch.where(matches.valid, 1.0 - iou, 0.0) / per_match).sum()
        num_classes = self.head.num_classes
        cls_loss = box_loss.new_zeros(())
        if num_classes > 1:
            wanted = class_targets(matches.classes, num_classes, self.label_smoothing)
            bce = bce_with_logits(pred[:, 5 : 5 + num_classes], wanted, self.cls_pw, self.fl_gamma, "none")
            cls_loss = (torch.where(matches.valid, bce.sum(1), 0.0) / (per_match * num_classes)).sum()
        # Objectness learns to predict the box quality; where matches share a cell the last one wins (YOLOv5).
        sizes = [raw[..., 4].numel() for raw in matched.raw]
        obj_target = box_loss.new_zeros(sum(sizes) + 1)  # one spare element for write_last
        write_last(obj_target, matched.cells, iou.detach().clamp(min=0), matches.valid)
        balance = LEVEL_BALANCE[self.head.num_levels]
        obj_loss = box_loss.new_zeros(())
        for raw, level_target, weight in zip(matched.raw, obj_target[:-1].split(sizes), balance, strict=True):
            level_target = level_target.view(raw.shape[:4])
            obj_loss = obj_loss + bce_with_logits(raw[..., 4], level_target, self.obj_pw, self.fl_gamma) * weight
        return box_loss * self.gains.box, obj_loss * self.gains.obj, cls_loss * self.gains.cls
