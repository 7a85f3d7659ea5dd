"""Tests for models/anchor_free.py, models/dense_head.py and models/csp_blocks.py: sizes, shapes, decode, branches."""

from __future__ import annotations

import pytest
import torch

from models.anchor_free import LAYOUTS, AnchorFreeSpec, build_model, segmentation_spec, spec_for_name
from models.dense_head import DenseRaw, anchor_points, distances_to_xywh
from models.model_info import estimate_gflops, model_info
from utils.errors import ConfigError

# Parameters and GFLOPs at 640 (nc 80) that Ultralytics 8.4.190 prints for its models built from its YAMLs.
# The parameter counts equal the summary comments of its model YAMLs (yolov8-seg.yaml has none); the GFLOPs
# are the full count at 640 (the YOLO11/26 comments were profiled at 32 px and scaled, which under-counts
# attention by 0.1-0.6; the yolo11-seg comments also count the proto upsampling at its output size).
PUBLISHED: dict[str, tuple[int, float]] = {
    "yolov8n": (3_157_200, 8.86),
    "yolov8s": (11_166_560, 28.81),
    "yolov8m": (25_902_640, 79.31),
    "yolov8l": (43_691_520, 165.74),
    "yolov8x": (68_229_648, 258.54),
    "yolov8n-seg": (3_409_968, 12.14),
    "yolov8s-seg": (11_821_056, 40.34),
    "yolov8m-seg": (27_285_968, 104.98),
    "yolov8l-seg": (45_997_728, 211.06),
    "yolov8x-seg": (71_827_888, 329.19),
    "yolo11n": (2_624_080, 6.67),
    "yolo11s": (9_458_752, 21.84),
    "yolo11m": (20_114_688, 68.64),
    "yolo11l": (25_372_160, 87.85),
    "yolo11x": (56_966_176, 196.31),
    "yolo11n-seg": (2_876_848, 9.96),
    "yolo11s-seg": (10_113_248, 33.36),
    "yolo11m-seg": (22_420_896, 113.97),
    "yolo11l-seg": (27_678_368, 133.18),
    "yolo11x-seg": (62_142_656, 297.89),
    "yolo26n": (2_572_280, 6.24),
    "yolo26s": (10_009_784, 23.08),
    "yolo26m": (21_896_248, 75.64),
    "yolo26l": (26_299_704, 94.16),
    "yolo26x": (58_993_368, 210.07),
    "yolo26n-seg": (3_126_280, 10.63),
    "yolo26s-seg": (11_505_800, 37.66),
    "yolo26m-seg": (27_112_072, 132.78),
    "yolo26l-seg": (31_515_528, 151.30),
    "yolo26x-seg": (70_693_800, 338.20),
}


def _tiny(layout: str, num_classes: int = 3, seg: bool = False) -> AnchorFreeSpec:
    """A small model of `layout`: 1/8 width, channels capped at 256 (attention then has one 16-wide head)."""
    is_26 = layout == "yolo26"
    spec = AnchorFreeSpec(layout, 0.33, 0.125, 256, num_classes, reg_max=1 if is_26 else 16, end_to_end=is_26)
    return segmentation_spec(spec) if seg else spec


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_counts_equal_the_published_ones(name: str) -> None:
    with torch.device("meta"):  # shapes only: no memory for the x models
        model = build_model(spec_for_name(name, 80))
    assert sum(p.numel() for p in model.parameters()) == PUBLISHED[name][0]
    # The DFL bins are a fixed parameter (published counts include them) that is never trained.
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    assert frozen == (16 if model.spec.reg_max == 16 else 0)


@pytest.mark.parametrize("name", ["yolov8n", "yolov8x-seg", "yolo11n", "yolo11m-seg", "yolo26n-seg", "yolo26l"])
def test_gflops_at_640_equal_the_published_count(name: str) -> None:
    with torch.device("meta"):
        model = build_model(spec_for_name(name, 80))
    assert estimate_gflops(model, 640) == pytest.approx(PUBLISHED[name][1], abs=0.01)


def test_model_names_pick_layout_scale_head_and_masks() -> None:
    spec = spec_for_name("yolo26s-seg", 5)
    assert (spec.layout, spec.scale, spec.reg_max, spec.end_to_end, spec.num_masks) == ("yolo26", "s", 1, True, 32)
    assert spec.num_protos == 128  # 256 x width 0.5
    v8 = spec_for_name("YOLOv8m", 5)
    assert (v8.reg_max, v8.end_to_end, v8.max_channels, v8.num_masks) == (16, False, 768, 0)
    assert AnchorFreeSpec.from_dict(spec.to_dict()) == spec
    with pytest.raises(ConfigError, match="not an anchor-free model name"):
        spec_for_name("yolo12n", 5)
    with pytest.raises(ValueError, match="unknown key 'anchors'"):
        AnchorFreeSpec.from_dict({**spec.to_dict(), "anchors": []})


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("seg", [False, True])
def test_tiny_models_give_the_documented_shapes(layout: str, seg: bool) -> None:
    spec = _tiny(layout, seg=seg)
    model = build_model(spec)
    images = torch.rand(2, 3, 64, 96)
    points = 8 * 12 + 4 * 6 + 2 * 3
    model.train()
    train_out = model(images)
    raw, protos = train_out if seg else (train_out, None)
    assert isinstance(raw, DenseRaw)
    outputs = 4 * spec.reg_max + spec.num_classes + spec.num_masks
    assert [tuple(level.shape) for level in raw.levels] == [(2, outputs, 8, 12), (2, outputs, 4, 6), (2, outputs, 2, 3)]
    assert (raw.one_to_one is not None) == (layout == "yolo26")
    if seg:
        assert tuple(protos.shape) == (2, 32, 16, 24)
        assert (raw.semantic is not None) == (layout == "yolo26")  # YOLO26-seg's training-only branch
        if raw.semantic is not None:
            assert tuple(raw.semantic.shape) == (2, spec.num_classes, 8, 12)
    model.eval()
    decoded, second = model(images)
    assert tuple(decoded.shape) == (2, points, 4 + spec.num_classes + spec.num_masks)
    scores = decoded[..., 4 : 4 + spec.num_classes]
    assert bool(((scores >= 0) & (scores <= 1)).all())
    assert len(model.layers()) == (23 if layout == "yolov8" else 24)  # the published layer indices, head last
    if seg:
        assert isinstance(second[0], DenseRaw) and tuple(second[1].shape) == (2, 32, 16, 24)


def test_anchor_points_are_cell_centres_of_every_level_in_order() -> None:
    points, strides = anchor_points([(2, 3), (1, 2)], [8.0, 16.0], torch.empty(0), torch.float32)
    assert points.tolist() == [
        [0.5, 0.5],
        [1.5, 0.5],
        [2.5, 0.5],
        [0.5, 1.5],
        [1.5, 1.5],
        [2.5, 1.5],
        [0.5, 0.5],
        [1.5, 0.5],
    ]
    assert strides.view(-1).tolist() == [8.0] * 6 + [16.0] * 2
    boxes = distances_to_xywh(torch.tensor([[1.0, 2.0, 3.0, 4.0]]), torch.tensor([[10.0, 10.0]]))
    assert boxes.tolist() == [[11.0, 11.0, 4.0, 6.0]]  # x1 9, y1 8, x2 13, y2 14


@pytest.mark.parametrize("layout", ["yolo11", "yolo26"])
def test_decode_reads_the_box_distribution_as_its_expectation(layout: str) -> None:
    model = build_model(_tiny(layout)).eval()
    head, reg_max = model.head, model.spec.reg_max
    levels = [torch.zeros(1, head.num_outputs, 2, 2), torch.zeros(1, head.num_outputs, 1, 1)]
    sides = torch.tensor([1.0, 2.0, 3.0, 4.0])  # left, top, right, bottom in cells
    for level in levels:
        if reg_max == 1:
            level[:, :4] = sides.view(1, 4, 1, 1)
        else:  # a near one-hot distribution at bin k has expectation ~k
            for side, bins in enumerate(sides.long().tolist()):
                level[:, side * reg_max + bins] = 50.0
    head.level_strides = (8.0, 16.0)
    decoded = head.decode(levels)
    # First point of level 0: centre (0.5, 0.5) cells, stride 8 -> box x1 = (0.5-1)*8 ... y2 = (0.5+4)*8.
    assert decoded[0, 0, :4].tolist() == pytest.approx([12.0, 12.0, 32.0, 48.0], abs=1e-3)
    # The single point of level 1 (stride 16): centre (0.5, 0.5) cells.
    assert decoded[0, 4, :4].tolist() == pytest.approx([24.0, 24.0, 64.0, 96.0], abs=1e-3)


def test_the_one_to_one_branch_trains_only_its_own_convs() -> None:
    model = build_model(_tiny("yolo26")).train()
    raw = model(torch.rand(1, 3, 64, 64))
    sum(level.sum() for level in raw.one_to_one).backward()
    assert all(p.grad is None for p in model.backbone.parameters())  # the features were detached
    assert all(p.grad is not None for p in model.head.one_to_one_class.parameters())
    assert all(p.grad is None for p in model.head.class_branches.parameters())


def test_end_to_end_models_decode_the_one_to_one_branch_unless_told_not_to() -> None:
    model = build_model(_tiny("yolo26")).eval()
    with torch.no_grad():
        model.head.one_to_one_class[0][-1].bias.fill_(-30.0)  # the branches now differ on level 0
        images = torch.rand(1, 3, 64, 64)
        one_to_one, _ = model(images)
        model.head.use_one_to_one = False
        one_to_many, raw = model(images)
    assert raw.one_to_one is None  # not computed when unused
    assert one_to_one[0, :64, 4:].max() < 1e-6 < one_to_many[0, :64, 4:].max()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fused_model_gives_the_same_outputs(layout: str) -> None:
    model = build_model(_tiny(layout, seg=True))
    model.train()
    for _ in range(2):  # non-trivial BN statistics
        model(torch.rand(2, 3, 64, 64))
    model.eval()
    images = torch.rand(1, 3, 64, 64)
    with torch.no_grad():
        before, (_, protos_before) = model(images)
        after, (_, protos_after) = model.fuse()(images)
    assert torch.allclose(before, after, atol=1e-4) and torch.allclose(protos_before, protos_after, atol=1e-4)


@pytest.mark.parametrize("seg", [False, True], ids=["detect", "seg"])
def test_fusing_an_end_to_end_model_drops_the_branch_it_does_not_decode(seg: bool) -> None:
    model = build_model(_tiny("yolo26", seg=seg)).eval()
    images = torch.rand(1, 3, 64, 64)
    with torch.no_grad():
        before = model(images)[0]
        unused = sum(
            p.numel() for p in [*model.head.box_branches.parameters(), *model.head.class_branches.parameters()]
        )
        if seg:
            unused += sum(p.numel() for p in model.head.mask_branches.parameters())
        count = sum(p.numel() for p in model.parameters())
        after = model.fuse()(images)[0]
    assert model.head.box_branches is None and sum(p.numel() for p in model.parameters()) < count - unused + 1
    torch.testing.assert_close(after, before, atol=1e-4, rtol=1e-4)
    model.head.use_one_to_one = False  # --nms chosen too late: one line, not a crash inside the decoder
    with pytest.raises(RuntimeError, match="choose --nms before"):
        model(images)


def test_an_end_to_end_model_fused_for_nms_keeps_its_one_to_many_branch() -> None:
    model = build_model(_tiny("yolo26")).eval()
    model.head.use_one_to_one = False
    images = torch.rand(1, 3, 64, 64)
    with torch.no_grad():
        before = model(images)[0]
        after = model.fuse()(images)[0]
    assert model.head.box_branches is not None
    torch.testing.assert_close(after, before, atol=1e-4, rtol=1e-4)


def test_model_info_prints_the_published_figures() -> None:
    model = build_model(spec_for_name("yolo11n", 80))
    info = model_info(model, 640)
    assert "2,624,080 parameters" in info and "2,624,064 trainable" in info and "6.7 GFLOPs" in info
