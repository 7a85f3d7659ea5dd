"""Tests for utils/train/loss.py: gain scaling, target assignment, loss terms and learning on a tiny batch."""

from __future__ import annotations

import pytest
import torch

from models.yolo import DetectionModel, build_model, spec_from_cfg
from utils.boxes import bbox_iou
from utils.train.loss import (
    LEVEL_BALANCE,
    AnchorMatches,
    DetectionLoss,
    LossGains,
    assign_targets,
    bce_with_logits,
    class_targets,
    grid_tables,
    scale_loss_gains,
    smooth_bce_targets,
    write_last,
)

GAINS = scale_loss_gains(0.05, 0.5, 1.0, num_classes=3, imgsz=64, num_levels=3)
# [image, cls, cx, cy, w, h] normalised
TARGETS = torch.tensor([[0, 1, 0.50, 0.50, 0.30, 0.40], [1, 0, 0.20, 0.70, 0.20, 0.30], [1, 2, 0.70, 0.30, 0.50, 0.50]])


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _assign(targets: torch.Tensor, anchors: torch.Tensor, grid_hw: tuple[int, int], **kwargs: bool) -> AnchorMatches:
    """One level's matches: anchors (na, 2) in grid units on a grid of `grid_hw`."""
    return assign_targets(targets, anchors[None], grid_tables([grid_hw], anchors.device), 4.0, **kwargs).matches


def _model(num_classes: int = 3, cfg: str = "yolov5n") -> DetectionModel:
    torch.manual_seed(0)
    return build_model(spec_from_cfg(cfg, num_classes))


def test_scale_loss_gains_follows_yolov5_rule() -> None:
    gains = scale_loss_gains(0.05, 0.5, 1.0, num_classes=20, imgsz=320, num_levels=3)
    assert gains == LossGains(box=pytest.approx(0.05), obj=pytest.approx(0.25), cls=pytest.approx(0.125))
    four_levels = scale_loss_gains(0.04, 0.8, 2.0, num_classes=80, imgsz=640, num_levels=4)
    assert (four_levels.box, four_levels.obj, four_levels.cls) == pytest.approx((0.03, 1.5, 0.6))


def test_label_smoothing_targets() -> None:
    assert smooth_bce_targets(0.0) == (1.0, 0.0)
    assert smooth_bce_targets(0.1) == pytest.approx((0.95, 0.05))
    smoothed = class_targets(torch.tensor([2, 0]), 4, label_smoothing=0.1)
    expected = torch.tensor([[0.05, 0.05, 0.95, 0.05], [0.95, 0.05, 0.05, 0.05]])
    assert torch.allclose(smoothed, expected)
    assert torch.equal(class_targets(torch.tensor([1]), 3), torch.tensor([[0.0, 1.0, 0.0]]))


def test_assign_targets_uses_two_nearest_neighbour_cells() -> None:
    anchors = torch.tensor([[1.0, 1.0], [4.0, 4.0], [20.0, 20.0]])  # grid units
    # centre (3.3, 4.7) on an 8x8 grid, size 2x2: within 4x of anchors 0 and 1 only.
    targets = torch.tensor([[1, 2, 3.3 / 8, 4.7 / 8, 2 / 8, 2 / 8]])
    assigned = _assign(targets, anchors, (8, 8))
    rows = sorted(zip(assigned.anchor_index.tolist(), assigned.cell_x.tolist(), assigned.cell_y.tolist(), strict=True))
    # own cell (3, 4), left neighbour (x frac 0.3 < 0.5), lower neighbour (y frac 0.7 > 0.5); per anchor.
    assert rows == sorted((a, x, y) for a in (0, 1) for x, y in [(3, 4), (2, 4), (3, 5)])
    assert (assigned.image_index == 1).all() and (assigned.classes == 2).all()
    cells = zip(assigned.cell_x.tolist(), assigned.cell_y.tolist(), assigned.boxes_xywh.tolist(), strict=True)
    offsets = {(x, y): box[:2] for x, y, box in cells}
    assert offsets[(2, 4)] == pytest.approx([1.3, 0.7]) and offsets[(3, 5)] == pytest.approx([0.3, -0.3])
    assert torch.allclose(assigned.boxes_xywh[:, 2:], torch.full((6, 2), 2.0))
    assert torch.equal(assigned.anchors, anchors[assigned.anchor_index])


@pytest.mark.parametrize("static_shapes", [False, True])
def test_a_centre_on_a_cell_edge_gets_cells_whose_offsets_the_head_can_reach(static_shapes: bool) -> None:
    # Centre (4.0, 4.0): YOLOv5's rule, cell = (centre -/+ 0.5) rounded down, gives the left and upper neighbours
    # (offset 1.0) and the own cell again for the right and lower ones (offset 0); the head's offsets lie in
    # (-0.5, 1.5), so a row in cell 5 with offset -1.0 could never be fitted.
    targets = torch.tensor([[0, 0, 0.5, 0.5, 0.25, 0.25]])
    assigned = _assign(targets, torch.tensor([[2.0, 2.0]]), (8, 8), static_shapes=static_shapes)
    rows = sorted(zip(assigned.cell_x.tolist(), assigned.cell_y.tolist(), strict=True))
    assert rows == sorted([(4, 4), (3, 4), (4, 3), (4, 4), (4, 4)])
    offsets = assigned.boxes_xywh[:, :2]
    assert bool(((offsets > -0.5) & (offsets < 1.5)).all())


def test_assign_targets_skips_neighbours_outside_grid() -> None:
    anchors = torch.tensor([[1.0, 1.0]])
    targets = torch.tensor([[0, 0, 0.4 / 8, 7.8 / 8, 1 / 8, 1 / 8]])  # near the left and bottom edges
    assigned = _assign(targets, anchors, (8, 8))
    assert list(zip(assigned.cell_x.tolist(), assigned.cell_y.tolist(), strict=True)) == [(0, 7)]
    assert len(_assign(torch.zeros(0, 6), anchors, (8, 8)).image_index) == 0


def test_loss_is_finite_and_scaled_by_batch() -> None:
    model = _model()
    loss_fn = DetectionLoss(model, GAINS)
    preds = model(torch.rand(2, 3, 64, 96))
    loss, items = loss_fn(preds, TARGETS)
    assert loss.shape == (1,) and items.shape == (3,) and not items.requires_grad
    assert torch.isfinite(loss).all() and (items > 0).all()
    assert loss.item() == pytest.approx(items.sum().item() * 2, rel=1e-5)
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


class _TwoRanks:
    """Stands in for RankMean on 2 ranks: records the counts it is given, returns `mean` when set."""

    world_size = 2

    def __init__(self, mean: torch.Tensor | None = None) -> None:
        self.mean, self.seen = mean, None

    def __call__(self, counts: torch.Tensor) -> torch.Tensor:
        self.seen = counts
        return counts if self.mean is None else self.mean


def test_two_halves_with_averaged_counts_add_up_to_the_whole_batch_when_a_level_has_one_match() -> None:
    # What DDP relies on. One small label near a corner: one match on the finest level in the whole batch,
    # on one rank only, so the ranks' mean count is 0.5; a floor of 1 on it halved that level's box and class terms.
    model = _model().eval()
    model.head.train()  # the training output, with BatchNorm fixed: the forward is per image
    images = torch.rand(4, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    targets = torch.tensor([[2, 1, 0.04, 0.04, 0.08, 0.08]])
    loss_fn = DetectionLoss(model, GAINS)
    whole, _ = loss_fn(model(images), targets)
    halves = []
    for first in (0, 2):
        local = targets[(targets[:, 0] >= first) & (targets[:, 0] < first + 2)].clone()
        local[:, 0] -= first
        recorder = _TwoRanks()
        loss_fn(model(images[first : first + 2]), local, recorder)
        halves.append((model(images[first : first + 2]), local, recorder.seen))
    mean = (halves[0][2] + halves[1][2]) / 2
    assert 0 < float(mean[0]) < 1, mean  # a level with fewer matches than ranks
    total = sum(loss_fn(preds, local, _TwoRanks(mean))[0] for preds, local, _ in halves)
    assert total.item() == pytest.approx(whole.item(), rel=1e-4)


def test_zero_target_batch_gives_only_objectness_loss() -> None:
    model = _model()
    loss, items = DetectionLoss(model, GAINS)(model(torch.rand(2, 3, 64, 64)), torch.zeros(0, 6))
    assert items[0] == 0 and items[2] == 0 and items[1] > 0
    loss.backward()
    assert model.head.convs[0].bias.grad.abs().sum() > 0


def test_write_last_gives_each_repeated_index_its_last_valid_value() -> None:
    index = torch.tensor([3, 1, 3, 0, 1, 3, 2, 0])
    values = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8])
    valid = torch.tensor([True, True, True, True, True, True, False, False])  # the last two are not matches
    target = torch.zeros(6)  # 5 places and the spare one
    write_last(target, index, values, valid)
    expected = torch.zeros(5)
    for i, v in zip(index[:6].tolist(), values[:6].tolist(), strict=True):  # sequential writes, as YOLOv5's CPU loss
        expected[i] = v
    torch.testing.assert_close(target[:5], expected)  # [0.4, 0.5, 0, 0.6, 0]
    assert target[2] == 0 and target[4] == 0  # untouched elsewhere, also by the invalid row for place 2
    none = torch.zeros(0, dtype=torch.int64)
    write_last(target, none, torch.zeros(0), none.bool())  # no matches: nothing to do
    torch.testing.assert_close(target[:5], expected)


@pytest.mark.parametrize("grid_hw", [(8, 8), (4, 6)])
def test_static_assignment_holds_the_compact_rows_in_order_and_marks_them_valid(grid_hw: tuple[int, int]) -> None:
    anchors = torch.tensor([[1.0, 1.0], [2.0, 3.0], [6.0, 5.0]])
    generator = torch.Generator().manual_seed(3)
    image_and_class = torch.randint(0, 3, (9, 2), generator=generator).float()
    targets = torch.cat((image_and_class, torch.rand(9, 4, generator=generator)), 1)
    compact = _assign(targets, anchors, grid_hw)
    static = _assign(targets, anchors, grid_hw, static_shapes=True)
    assert len(static.valid) == 5 * 3 * 9 and compact.valid.all() and 0 < int(static.valid.sum()) < len(static.valid)
    rows = static.valid.nonzero().squeeze(1)
    for name, value in vars(compact).items():
        assert torch.equal(getattr(static, name)[rows], value), name


@pytest.mark.parametrize("num_targets", [0, len(TARGETS)])
def test_static_shapes_give_the_compact_loss_and_gradients(num_targets: int) -> None:
    model = _model()
    images = torch.rand(2, 3, 64, 96, generator=torch.Generator().manual_seed(4))
    results = []
    for static in (False, True):
        model.zero_grad()
        loss, items = DetectionLoss(model, GAINS, static_shapes=static)(model(images), TARGETS[:num_targets])
        loss.backward()
        results.append((items, [p.grad.clone() for p in model.parameters()]))
    (items, grads), (static_items, static_grads) = results
    torch.testing.assert_close(static_items, items)
    for grad, static_grad in zip(grads, static_grads, strict=True):
        torch.testing.assert_close(static_grad, grad)


def _level_by_level(model: DetectionModel, preds: list[torch.Tensor], targets: torch.Tensor) -> torch.Tensor:
    """YOLOv5's loss items [box, obj, cls] computed one level at a time, as its definition reads."""
    head = model.head
    box = obj = cls = torch.zeros(())
    for level, (raw, weight) in enumerate(zip(preds, LEVEL_BALANCE[len(preds)], strict=True)):
        matches = _assign(targets, head.anchors[level], tuple(raw.shape[2:4]))
        pred = raw[matches.image_index, matches.anchor_index, matches.cell_y, matches.cell_x]
        box_xywh = torch.cat((pred[:, :2].sigmoid() * 2 - 0.5, (pred[:, 2:4].sigmoid() * 2) ** 2 * matches.anchors), 1)
        iou = bbox_iou(box_xywh, matches.boxes_xywh)
        count = max(len(iou), 1)
        box = box + (1 - iou).sum() / count
        wanted = torch.nn.functional.one_hot(matches.classes, head.num_classes).float()
        bce = torch.nn.functional.binary_cross_entropy_with_logits(pred[:, 5:], wanted, reduction="sum")
        cls = cls + bce / (count * head.num_classes)
        obj_target = torch.zeros(raw.shape[:4])
        cells = (matches.image_index, matches.anchor_index, matches.cell_y, matches.cell_x)
        obj_target[cells] = iou.detach().clamp(min=0)  # sequential on CPU: a shared cell keeps the last value
        obj = obj + torch.nn.functional.binary_cross_entropy_with_logits(raw[..., 4], obj_target) * weight
    return torch.stack((box * GAINS.box, obj * GAINS.obj, cls * GAINS.cls))


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("cfg", ["yolov5n", "yolov5n6"])  # P6: four levels, YOLOv5's (4, 1, 0.25, 0.06) balance
def test_all_levels_at_once_give_the_level_by_level_loss_and_gradients(static: bool, cfg: str) -> None:
    model = _model(cfg=cfg)
    strides = [int(s) for s in model.stride.tolist()]
    height, width = 2 * strides[-1], 3 * strides[-1]
    generator = torch.Generator().manual_seed(5)
    image_and_class = torch.randint(0, 2, (12, 2), generator=generator).float()
    targets = torch.cat((image_and_class, torch.rand(12, 4, generator=generator)), 1)
    targets[:, 4:] = targets[:, 4:] * 0.6 + 0.02
    targets[:4, 2:4] = targets[4:8, 2:4]  # shared cells: the last listed target sets their objectness
    results = []
    for compute in ("levels", "loss"):
        preds = []
        for stride in strides:
            generator = torch.Generator().manual_seed(stride)
            preds.append(torch.randn(2, 3, height // stride, width // stride, 8, generator=generator).requires_grad_())
        if compute == "levels":
            items = _level_by_level(model, preds, targets)
            total = items.sum()
        else:
            loss, items = DetectionLoss(model, GAINS, static_shapes=static)(preds, targets)
            total = loss.sum() / 2  # the loss is the items' sum times the batch size
        total.backward()
        results.append((items.detach(), [p.grad for p in preds]))
    (expected, expected_grads), (got, grads) = results
    assert (expected > 0).all()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=0)
    for grad, expected_grad in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(grad, expected_grad, rtol=1e-5, atol=1e-9)


def test_objectness_of_a_shared_cell_takes_the_last_listed_target() -> None:
    # Two boxes of one image centred alike match the same cells and anchors with different IoUs: the target
    # listed last sets those cells, as in YOLOv5, so swapping the order changes the objectness term.
    model = _model()
    preds = model(torch.rand(1, 3, 64, 64))
    pair = torch.tensor([[0, 1, 0.5, 0.5, 0.30, 0.40], [0, 2, 0.5, 0.5, 0.45, 0.25]])
    loss_fn = DetectionLoss(model, GAINS)
    forward, backward = loss_fn(preds, pair)[1], loss_fn(preds, pair.flip(0))[1]
    assert forward[1] != pytest.approx(backward[1].item(), rel=1e-4)
    assert torch.equal(loss_fn(preds, pair)[1], forward)  # and the same order gives the same value


def test_single_class_and_unmatchable_anchors() -> None:
    model = _model(num_classes=1)
    preds = model(torch.rand(2, 3, 64, 64))
    targets = TARGETS.clone()
    targets[:, 1] = 0
    items = DetectionLoss(model, GAINS)(preds, targets)[1]
    assert items[0] > 0 and items[2] == 0  # no class term with one class
    with torch.no_grad():
        model.head.anchors.mul_(100.0)  # read live: no target is within anchor_t of any anchor now
    items = DetectionLoss(model, GAINS)(preds, targets)[1]
    assert items[0] == 0 and items[2] == 0 and items[1] > 0


def test_label_smoothing_and_focal_change_the_loss_as_expected() -> None:
    model = _model()
    preds = [p.detach() for p in model(torch.rand(2, 3, 64, 64))]
    plain = DetectionLoss(model, GAINS)(preds, TARGETS)[1]
    smoothed = DetectionLoss(model, GAINS, label_smoothing=0.2)(preds, TARGETS)[1]
    assert torch.allclose(plain[:2], smoothed[:2]) and smoothed[2] != plain[2]
    focal = DetectionLoss(model, GAINS, fl_gamma=1.5)(preds, TARGETS)[1]
    assert (focal[1:] < plain[1:]).all()
    logits, ones = torch.randn(50), torch.ones(50)
    assert bce_with_logits(logits, ones, 2.0, 0.0) == pytest.approx(2 * bce_with_logits(logits, ones, 1.0, 0.0))


def test_loss_falls_when_overfitting_one_batch() -> None:
    model = _model(num_classes=3)
    loss_fn = DetectionLoss(model, GAINS)
    images = torch.rand(2, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
    history = []
    for _ in range(30):
        loss, _ = loss_fn(model(images), TARGETS)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        history.append(loss.item())
    assert history[-1] < 0.6 * history[0]
