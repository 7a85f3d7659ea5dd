"""Tests for segment/ops.py (crop, assemble, process masks) and segment/loss.py (the segmentation loss)."""

from __future__ import annotations

import math
import types

import numpy as np
import pytest
import torch

from models.yolo import SegmentationModel, build_model, spec_from_cfg
from segment.loss import SegmentationLoss
from segment.mask_targets import MaskTargets, overlap_instance_ids
from segment.ops import assemble_masks, assemble_masks_by_image, crop_mask, process_masks
from segment.training import SEGMENT_TRAINING
from utils.boxes import xywhn_to_xyxy
from utils.config import DEFAULT_HYP
from utils.data.masks import polygons_to_masks, polygons_to_overlap_mask
from utils.hyp import load_hyp
from utils.train.config import TrainConfig
from utils.train.loss import assign_targets, grid_tables, scale_loss_gains

pytestmark = pytest.mark.usefixtures("one_torch_thread")

IMGSZ = 64  # prototypes are 16 x 16
GAINS = scale_loss_gains(0.05, 0.5, 1.0, num_classes=2, imgsz=IMGSZ, num_levels=3)
# [image, cls, cx, cy, w, h] normalised; every box edge falls on a whole prototype pixel (multiples of 1/16).
TARGETS = torch.tensor(
    [
        [0, 0, 0.50, 0.50, 0.50, 0.50],  # proto box x 4..12, y 4..12
        [1, 1, 0.25, 0.25, 0.25, 0.50],  # x 2..6, y 0..8
        [1, 0, 0.75, 0.6875, 0.375, 0.375],  # x 9..15, y 8..14 (no overlap with the previous one)
    ]
)


def _ellipse_masks(targets: torch.Tensor, size: int = 16) -> torch.Tensor:
    """Per-instance (N, size, size) uint8 masks: the ellipse inscribed in each target box."""
    centre = (torch.arange(size) + 0.5) / size
    ys, xs = centre.view(-1, 1), centre.view(1, -1)
    rows = [((xs - cx) / (w / 2)) ** 2 + ((ys - cy) / (h / 2)) ** 2 <= 1 for cx, cy, w, h in targets[:, 2:6].tolist()]
    return torch.stack(rows).to(torch.uint8)


def _overlap_masks(per_instance: torch.Tensor, targets: torch.Tensor, batch_size: int) -> torch.Tensor:
    """(B, h, w) int16 index masks: value 1 + position within its image, from non-overlapping instance masks."""
    out = torch.zeros((batch_size, *per_instance.shape[1:]), dtype=torch.int16)
    image_index = targets[:, 0].long()
    for mask, image, value in zip(per_instance, image_index, overlap_instance_ids(image_index), strict=True):
        out[image][mask.bool()] = int(value)
    return out


@pytest.fixture(scope="module")
def model() -> SegmentationModel:
    torch.manual_seed(0)
    return build_model(spec_from_cfg("yolov5n-seg", 2))


def _zero_outputs(model: SegmentationModel, batch_size: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Hand-made training outputs (raw list, protos) of zeros for IMGSZ images."""
    raw = [torch.zeros(batch_size, 3, IMGSZ // s, IMGSZ // s, model.head.num_outputs) for s in (8, 16, 32)]
    return raw, torch.zeros(batch_size, model.head.num_masks, IMGSZ // 4, IMGSZ // 4)


def test_crop_mask_keeps_pixels_whose_centre_is_inside() -> None:
    masks = torch.ones(2, 4, 5, dtype=torch.uint8)
    boxes = torch.tensor([[1.0, 0.0, 3.0, 2.0], [0.4, 1.6, 2.6, 4.0]])
    cropped = crop_mask(masks, boxes)
    expected = torch.zeros(2, 4, 5, dtype=torch.uint8)
    expected[0, 0:2, 1:3] = 1  # whole-pixel box: exactly the covered pixels
    expected[1, 2:4, 0:3] = 1  # centres 0.5..2.5 in [0.4, 2.6); centre 1.5 < 1.6 is out
    assert cropped.dtype == torch.uint8 and torch.equal(cropped, expected)
    cropped_bool = crop_mask(masks.bool(), boxes)  # binary masks take their own path
    assert cropped_bool.dtype == torch.bool and torch.equal(cropped_bool, expected.bool())
    values = torch.arange(20.0).view(1, 4, 5)
    assert crop_mask(values, torch.tensor([[3.0, 3.0, 5.0, 4.0]])).sum() == values[0, 3, 3:5].sum()


def test_assemble_masks_is_a_weighted_sum_of_prototypes() -> None:
    protos = torch.tensor([[[1.0, 2.0], [3.0, 4.0]], [[0.0, 1.0], [0.0, -1.0]]])
    coeffs = torch.tensor([[1.0, 0.0], [2.0, -1.0]])
    expected = torch.tensor([[[1.0, 2.0], [3.0, 4.0]], [[2.0, 3.0], [6.0, 9.0]]])
    assert torch.equal(assemble_masks(coeffs, protos), expected)
    with pytest.raises(ValueError, match="3 prototypes"):
        assemble_masks(coeffs, torch.zeros(3, 2, 2))


def test_assemble_masks_by_image_uses_each_rows_own_image() -> None:
    torch.manual_seed(0)
    protos, coeffs = torch.randn(3, 4, 5, 6), torch.randn(5, 4)
    counts = [2, 0, 3]  # image 1 has no rows
    logits = assemble_masks_by_image(coeffs, counts, protos)
    owners = [0, 0, 2, 2, 2]
    expected = torch.cat([assemble_masks(coeffs[i : i + 1], protos[image]) for i, image in enumerate(owners)])
    torch.testing.assert_close(logits, expected)
    assert assemble_masks_by_image(coeffs[:0], [0, 0, 0], protos).shape == (0, 5, 6)
    with pytest.raises(ValueError, match="3 image counts summing to 4"):
        assemble_masks_by_image(coeffs, [2, 0, 2], protos)


def test_process_masks_upsamples_then_crops_to_the_exact_box() -> None:
    protos = torch.full((1, 4, 4), 10.0)  # logit 10 everywhere
    coeffs = torch.tensor([[1.0], [-1.0], [1.0]])
    # Input pixels of a 16 x 16 input: a whole-pixel box, the full image, and a fractional box.
    boxes = torch.tensor([[4.0, 4.0, 12.0, 12.0], [0.0, 0.0, 16.0, 16.0], [2.4, 3.6, 5.5, 9.5]])
    masks = process_masks(protos, coeffs, boxes, (16, 16), chunk=2)
    # Cropping at input resolution keeps exactly the pixels whose centres lie in the box (corners included;
    # cropping the 4x4 prototypes first would lose the corner pixels to bilinear blur).
    expected = torch.zeros(16, 16, dtype=torch.bool)
    expected[4:12, 4:12] = True
    fractional = torch.zeros(16, 16, dtype=torch.bool)
    fractional[4:9, 2:5] = True  # centres x 2.5..4.5 and y 4.5..8.5 fall in [2.4, 5.5) x [3.6, 9.5)
    assert masks.dtype == torch.bool and masks.shape == (3, 16, 16)
    assert torch.equal(masks[0], expected) and not masks[1].any() and torch.equal(masks[2], fractional)
    # A prototype edge: logits -1 | +1 between columns 1 and 2 put the upsampled zero crossing at input x = 8.
    edge = torch.tensor([[-1.0, -1.0, 1.0, 1.0]]).expand(4, 4)[None]
    assert (
        process_masks(edge, torch.ones(1, 1), torch.tensor([[0.0, 0.0, 16.0, 16.0]]), (16, 16))[0, 0].nonzero().min()
        == 8
    )
    assert process_masks(protos, torch.zeros(0, 1), torch.zeros(0, 4), (16, 32)).shape == (0, 16, 32)


def test_overlap_instance_ids_count_within_each_image() -> None:
    assert overlap_instance_ids(torch.tensor([0, 0, 2, 2, 2, 1])).tolist() == [1, 2, 1, 2, 3, 1]
    assert overlap_instance_ids(torch.zeros(0, dtype=torch.long)).tolist() == []


def test_assigned_target_index_points_at_the_matched_row() -> None:
    anchors = torch.tensor([[1.0, 1.0], [2.0, 3.0]])
    assigned = assign_targets(TARGETS, anchors[None], grid_tables([(8, 8)], anchors.device), 4.0).matches
    assert len(assigned.target_index) > len(TARGETS)  # several anchors and cells per target
    assert torch.equal(assigned.image_index, TARGETS[assigned.target_index, 0].long())
    assert torch.equal(assigned.classes, TARGETS[assigned.target_index, 1].long())
    wh = TARGETS[assigned.target_index, 4:6] * 8
    assert torch.allclose(assigned.boxes_xywh[:, 2:], wh)


def test_zero_logits_give_ln2_per_level(model: SegmentationModel) -> None:
    # Logits 0 give BCE ln 2 at every pixel; cropped mean / box area = ln 2 per match, so each level's
    # term is ln 2 whatever its match count, and every target matches an anchor on all 3 levels.
    loss_fn = SegmentationLoss(model, GAINS)
    _, items = loss_fn(_zero_outputs(model, 2), TARGETS[:1], masks=_ellipse_masks(TARGETS[:1]))
    assert items[1].item() == pytest.approx(3 * math.log(2) * GAINS.box, rel=1e-6)
    assert loss_fn.item_names == ("box", "seg", "obj", "cls")


def test_overlap_and_per_instance_masks_agree(model: SegmentationModel) -> None:
    torch.manual_seed(0)
    raw, protos = _zero_outputs(model, 2)
    raw, protos = [torch.randn_like(r) for r in raw], torch.randn_like(protos)
    per_instance = _ellipse_masks(TARGETS)
    overlap = _overlap_masks(per_instance, TARGETS, 2)
    assert overlap[1].unique().tolist() == [0, 1, 2]
    loss, items = SegmentationLoss(model, GAINS)((raw, protos), TARGETS, masks=per_instance)
    loss_overlap, items_overlap = SegmentationLoss(model, GAINS, overlap=True)((raw, protos), TARGETS, masks=overlap)
    assert items[1] > 0 and torch.allclose(items, items_overlap) and torch.allclose(loss, loss_overlap)
    # Masks served at input size (mask_ratio 1) are brought to the prototypes' size: same loss here.
    full_size = per_instance.repeat_interleave(4, dim=1).repeat_interleave(4, dim=2)
    assert torch.allclose(SegmentationLoss(model, GAINS)((raw, protos), TARGETS, masks=full_size)[1], items)
    with pytest.raises(ValueError, match="per-instance masks need 3 rows"):
        SegmentationLoss(model, GAINS)((raw, protos), TARGETS, masks=per_instance[:2])


def test_finer_masks_become_the_masks_drawn_at_the_prototypes_size() -> None:
    # A square on pixels 10..26 of a 64 px image, drawn at --mask-ratio 1, 2 and 4: the loss sees the same
    # (16, 16) targets at every ratio, those drawn at 4 (prototype pixels 2..5, whose centres are inside).
    square = [np.array([[10, 10], [26, 10], [26, 26], [10, 26]], np.float32)]
    drawn = {ratio: torch.from_numpy(polygons_to_masks(square, 64, 64, ratio)) for ratio in (1, 2, 4)}
    want = drawn[4]
    assert want[0].nonzero()[:, 1].unique().tolist() == [2, 3, 4, 5]
    targets = torch.tensor([[0, 0, 0.28, 0.28, 0.25, 0.25]])
    for ratio in (1, 2):
        got = MaskTargets._prepare_masks(types.SimpleNamespace(overlap=False), drawn[ratio], targets, 1, (16, 16))
        torch.testing.assert_close(got.float(), want.float(), msg=f"--mask-ratio {ratio}")


def _random_polygons(count: int, seed: int) -> list[np.ndarray]:
    """`count` random 8-point star-shaped polygons inside a 64 px image, radius 4 to 20 px."""
    rng = np.random.default_rng(seed)
    polygons = []
    for _ in range(count):
        centre, radius, angles = rng.uniform(20, 44, 2), rng.uniform(4, 20), np.sort(rng.uniform(0, 2 * np.pi, 8))
        polygons.append(np.stack([centre[0] + radius * np.cos(angles), centre[1] + radius * np.sin(angles)], 1))
    return polygons


def _shift_and_iou(got: np.ndarray, want: np.ndarray) -> tuple[np.ndarray, float]:
    """Mean (x, y) centroid shift of `got`'s masks from `want`'s (both (n, h, w) bool) and their mean IoU."""
    shifts, ious = [], []
    for mask_got, mask_want in zip(got, want, strict=True):
        if mask_want.any() and mask_got.any():
            shifts.append(np.argwhere(mask_got).mean(0)[::-1] - np.argwhere(mask_want).mean(0)[::-1])
        ious.append((mask_got & mask_want).sum() / max((mask_got | mask_want).sum(), 1))
    return np.mean(shifts, axis=0), float(np.mean(ious))


@pytest.mark.parametrize("side", [48, 80, 96])
def test_multi_scale_masks_match_the_polygons_drawn_at_the_new_size(side: int) -> None:
    # --multi-scale: masks drawn for 64 px (16 x 16) meet the prototypes of a batch resized to `side`. The
    # resized targets must lie where the polygons drawn at that size lie; 'nearest' sampled each pixel's
    # top-left corner and moved them 0.25 to 0.4 prototype pixels (1 to 1.5 input pixels) down and right,
    # 'nearest-exact' rounds every half-way centre down and right, moving them 0.1 to 0.26 up and left.
    polygons, proto = _random_polygons(200, seed=0), side // 4
    scaled = [polygon * side / 64 for polygon in polygons]
    per_instance = torch.from_numpy(polygons_to_masks(polygons, 64, 64, 4))
    got = MaskTargets._prepare_masks(
        types.SimpleNamespace(overlap=False), per_instance, torch.zeros(200, 6), 1, (proto, proto)
    )
    shift, iou = _shift_and_iou(got.numpy() > 0.5, polygons_to_masks(scaled, side, side, 4).astype(bool))
    assert np.abs(shift).max() < 0.1 and iou > 0.8, (shift, iou)
    # Overlap masks (index values, not 0/1) resize alike: 50 images of 4 instances each.
    overlap = torch.from_numpy(
        np.concatenate([polygons_to_overlap_mask(polygons[i : i + 4], 64, 64, 4) for i in range(0, 200, 4)])
    )
    targets = torch.zeros(200, 6)
    targets[:, 0] = torch.arange(200) // 4
    got = MaskTargets._prepare_masks(types.SimpleNamespace(overlap=True), overlap, targets, 50, (proto, proto))
    want = np.concatenate([polygons_to_overlap_mask(scaled[i : i + 4], side, side, 4) for i in range(0, 200, 4)])
    instance_id = np.arange(1, 5).reshape(1, 4, 1, 1)
    got_each = (got.numpy()[:, None] == instance_id).reshape(200, proto, proto)
    shift, iou = _shift_and_iou(got_each, (want[:, None] == instance_id).reshape(200, proto, proto))
    assert np.abs(shift).max() < 0.1 and iou > 0.72, (shift, iou)


def test_rank_halves_with_averaged_counts_add_up_to_full_batch(model: SegmentationModel) -> None:
    torch.manual_seed(1)
    raw, protos = _zero_outputs(model, 4)
    raw, protos = [torch.randn_like(r) for r in raw], torch.randn_like(protos)
    targets = torch.cat((TARGETS, TARGETS + torch.tensor([2, 0, 0, 0, 0, 0])))
    targets[4, 2:6] = torch.tensor([0.5, 0.5, 0.75, 0.25])  # differ from the first half
    masks = _ellipse_masks(targets)
    loss_fn = SegmentationLoss(model, GAINS)
    full_loss, full_items = loss_fn((raw, protos), targets, masks=masks)
    halves = []
    for images, rows in ((slice(0, 2), slice(0, 3)), (slice(2, 4), slice(3, 6))):
        half_targets = targets[rows] - torch.tensor([images.start, 0, 0, 0, 0, 0])
        halves.append((([r[images] for r in raw], protos[images]), half_targets, masks[rows]))
    counts = []
    for outputs, half_targets, half_masks in halves:  # "rank" k's own match counts, as the all-reduce would see
        loss_fn(outputs, half_targets, lambda c: counts.append(c) or c, masks=half_masks)
    averaged = (counts[0] + counts[1]) / 2
    assert not torch.equal(counts[0], counts[1])
    results = [loss_fn(o, t, lambda _: averaged, masks=m) for o, t, m in halves]
    assert (results[0][0] + results[1][0]).item() == pytest.approx(full_loss.item(), rel=1e-5)
    assert torch.allclose((results[0][1] + results[1][1]) / 2, full_items, rtol=1e-5)


def _reference_mask_term(loss_fn: SegmentationLoss, raw, protos, targets, masks) -> torch.Tensor:
    """The mask term computed one match at a time, straight from the docstring's definition."""
    matched = loss_fn._match(raw, targets, None)
    assigned, preds = matched.kept()
    coeffs = preds[:, 5 + loss_fn.head.num_classes :]
    total = torch.zeros(())
    for row in range(len(preds)):
        denominator = matched.denominators[assigned.level[row]]
        image, target = int(assigned.image_index[row]), int(assigned.target_index[row])
        logits = (coeffs[row] @ protos[image].flatten(1)).view(protos.shape[-2:])
        bce = torch.nn.functional.binary_cross_entropy_with_logits(logits, masks[target].float(), reduction="none")
        box = xywhn_to_xyxy(targets[target : target + 1, 2:6], protos.shape[-1], protos.shape[-2])
        area = targets[target, 4] * targets[target, 5]
        total = total + crop_mask(bce[None], box).mean() / area / denominator
    return total * loss_fn.gains.box


def test_mask_term_equals_the_per_match_definition_with_its_gradients(model: SegmentationModel) -> None:
    # Three images, one without targets, instances of several sizes: matches on every level, interleaved images.
    torch.manual_seed(4)
    targets = torch.cat((TARGETS, torch.tensor([[2, 1, 0.4, 0.6, 0.7, 0.6], [0, 1, 0.2, 0.8, 0.2, 0.3]])))
    targets[:3, 0] = torch.tensor([2.0, 0.0, 0.0])
    masks = _ellipse_masks(targets)
    raw, protos = _zero_outputs(model, 4)
    results = []
    for _ in range(2):
        torch.manual_seed(5)
        leaves = [torch.randn_like(r).requires_grad_() for r in raw], torch.randn_like(protos).requires_grad_()
        results.append(leaves)
    loss_fn = SegmentationLoss(model, GAINS)
    _, items = loss_fn(results[0], targets, masks=masks)
    seg = loss_fn._mask_term(loss_fn._match(results[0][0], targets, None), results[0][1], masks, targets)
    reference = _reference_mask_term(loss_fn, results[1][0], results[1][1], targets, masks)
    assert items[1].item() == pytest.approx(reference.item(), rel=1e-5) and reference.item() > 0
    (seg * GAINS.box).backward()
    reference.backward()
    torch.testing.assert_close(results[0][1].grad, results[1][1].grad, rtol=1e-4, atol=1e-7)
    for got, want in zip(results[0][0], results[1][0], strict=True):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-4, atol=1e-7)
    assert results[0][1].grad[3].abs().sum() == 0 and results[0][1].grad[:3].abs().sum() > 0  # image 3: no targets


def test_zero_targets_give_finite_loss_and_zero_seg(model: SegmentationModel) -> None:
    model.zero_grad()
    outputs = model(torch.rand(2, 3, IMGSZ, IMGSZ))
    loss, items = SegmentationLoss(model, GAINS)(outputs, torch.zeros(0, 6), masks=torch.zeros(0, 16, 16))
    assert torch.isfinite(loss).all() and items[0] == items[1] == items[3] == 0 and items[2] > 0
    # --mask-ratio 1 or 2 serve masks larger than the prototypes: an empty batch must not reach the resize.
    for size in (32, 64):
        _, empty_items = SegmentationLoss(model, GAINS)(outputs, torch.zeros(0, 6), masks=torch.zeros(0, size, size))
        torch.testing.assert_close(empty_items, items)
    loss.backward()
    assert model.head.proto.project.conv.weight.grad is not None  # proto branch stays in the graph (DDP)
    model.zero_grad()


def test_perfect_masks_score_far_below_random(model: SegmentationModel) -> None:
    masks = _ellipse_masks(TARGETS)
    raw, protos = _zero_outputs(model, 2)
    coeff0 = 5 + model.head.num_classes
    for level_raw in raw:
        level_raw[..., coeff0] = 1.0  # every anchor uses prototype 0 only
    for image in (0, 1):  # prototype 0 = confident logits of the union of the image's (disjoint) masks
        union = masks[TARGETS[:, 0] == image].amax(dim=0).float()
        protos[image, 0] = 20 * (2 * union - 1)
    loss_fn = SegmentationLoss(model, GAINS)
    perfect = loss_fn((raw, protos), TARGETS, masks=masks)[1][1]
    torch.manual_seed(2)
    random_outputs = ([torch.randn_like(r) for r in raw], torch.randn_like(protos))
    random = loss_fn(random_outputs, TARGETS, masks=masks)[1][1]
    assert perfect < 1e-6 and random > 0.1


def test_mask_math_runs_in_fp32_under_autocast(model: SegmentationModel) -> None:
    torch.manual_seed(3)
    raw, protos = _zero_outputs(model, 2)
    raw = [torch.randn_like(r).bfloat16() for r in raw]
    protos = torch.randn_like(protos).bfloat16()
    loss_fn, masks = SegmentationLoss(model, GAINS), _ellipse_masks(TARGETS)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        items_amp = loss_fn((raw, protos), TARGETS, masks=masks)[1]
    items_fp32 = loss_fn(([r.float() for r in raw], protos.float()), TARGETS, masks=masks)[1]
    assert items_amp.dtype == torch.float32 and torch.allclose(items_amp, items_fp32, rtol=1e-6)


def test_mask_loss_falls_when_overfitting_one_batch() -> None:
    torch.manual_seed(0)
    model = build_model(spec_from_cfg("yolov5n-seg", 2))
    cfg = TrainConfig(hyp=load_hyp(DEFAULT_HYP), imgsz=IMGSZ)
    loss_fn = SEGMENT_TRAINING.build_loss(model, cfg)
    assert loss_fn.gains == scale_loss_gains(cfg.hyp.box, cfg.hyp.cls, cfg.hyp.obj, 2, IMGSZ, 3)
    images = torch.rand(2, 3, IMGSZ, IMGSZ, generator=torch.Generator().manual_seed(0))
    masks = _ellipse_masks(TARGETS)
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
    seg_history = []
    for _ in range(30):
        loss, items = loss_fn(model(images), TARGETS, masks=masks)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        seg_history.append(items[1].item())
    assert seg_history[-1] < 0.1 * seg_history[0]
