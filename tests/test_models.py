"""Tests for models/: blocks, YOLOv5 model building and outputs, ModelSpec/cfg parsing, fuse, AutoAnchor."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from models.anchors import anchor_match_ratios, best_possible_recall, check_anchors, kmeans
from models.blocks import C3, SPPF, Conv
from models.model_info import estimate_gflops, memory_format, model_info
from models.yolo import DEFAULT_ANCHORS, DEFAULT_ANCHORS_P6, DetectionModel, ModelSpec, build_model, spec_from_cfg
from segment.task import SEGMENT
from utils.errors import ConfigError
from utils.train.setup import freeze_layers

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def nano() -> DetectionModel:
    torch.manual_seed(0)
    return build_model(spec_from_cfg("yolov5n", 3))


@pytest.fixture(scope="module")
def small() -> DetectionModel:
    torch.manual_seed(0)
    return build_model(spec_from_cfg("yolov5s", 3))


def test_blocks_shapes_and_residual() -> None:
    x = torch.randn(2, 16, 32, 24)
    assert Conv(16, 8, 3, 2)(x).shape == (2, 8, 16, 12)
    assert Conv(3, 8, 6, 2, 2)(torch.randn(1, 3, 64, 96)).shape == (1, 8, 32, 48)
    assert C3(16, 32, num_blocks=2)(x).shape == (2, 32, 32, 24)
    assert SPPF(16, 16)(x).shape == (2, 16, 32, 24)
    c3 = C3(16, 16, num_blocks=1)
    assert c3.blocks[0].use_residual and not C3(16, 16, shortcut=False).blocks[0].use_residual


@pytest.mark.parametrize("size", ["nano", "small"])
@pytest.mark.parametrize("height,width", [(64, 64), (96, 64)])
def test_train_and_eval_output_shapes(size: str, height: int, width: int, request: pytest.FixtureRequest) -> None:
    model: DetectionModel = request.getfixturevalue(size)
    assert model.stride.tolist() == [8.0, 16.0, 32.0]
    x = torch.rand(2, 3, height, width)
    model.train()
    raw = model(x)
    expected = [(2, 3, height // s, width // s, 8) for s in (8, 16, 32)]
    assert [tuple(r.shape) for r in raw] == expected
    model.eval()
    with torch.no_grad():
        decoded, raw_eval = model(x)
    model.train()
    cells = sum(3 * (height // s) * (width // s) for s in (8, 16, 32))
    assert decoded.shape == (2, cells, 8)
    assert [tuple(r.shape) for r in raw_eval] == expected
    assert ((decoded[..., 4:] >= 0) & (decoded[..., 4:] <= 1)).all()


def test_eval_decoding_matches_yolov5_formula() -> None:
    model = build_model(spec_from_cfg("n", 2))
    with torch.no_grad():
        for conv in model.head.convs:  # raw output 0 everywhere -> sigmoid 0.5
            conv.weight.zero_()
            conv.bias.zero_()
    model.eval()
    for height, width in [(64, 64), (96, 64)]:  # second size checks the grid cache is per size
        with torch.no_grad():
            decoded, _ = model(torch.rand(1, 3, height, width))
        grid_h, grid_w = height // 32, width // 32
        p5 = decoded[0, -3 * grid_h * grid_w :].view(3, grid_h, grid_w, 7)
        # xy = (0.5*2 - 0.5 + cell) * 32 = (cell + 0.5) * 32; wh = (0.5*2)^2 * anchor
        assert p5[1, grid_h - 1, 1, :2].tolist() == [1.5 * 32, (grid_h - 0.5) * 32]
        assert torch.allclose(p5[2, 0, 0, 2:4], torch.tensor([373.0, 326.0]))
        assert torch.allclose(p5[..., 4:], torch.full_like(p5[..., 4:], 0.5))


def test_head_attributes_and_bias_init(nano: DetectionModel) -> None:
    head = nano.head
    assert head.num_classes == nano.num_classes == 3 and head.num_outputs == 8 and head.num_levels == 3
    assert nano.width_multiple == 0.25 and nano.depth_multiple == 0.33
    pixels = head.anchors * head.stride.view(-1, 1, 1)
    assert torch.allclose(pixels.flatten(), torch.tensor(DEFAULT_ANCHORS, dtype=torch.float32).flatten())
    for conv, stride in zip(head.convs, (8, 16, 32), strict=True):
        bias = conv.bias.view(3, 8).detach()
        # Default conv init adds at most 1/sqrt(fan_in) <= 0.125 here.
        assert torch.allclose(bias[:, 4], torch.full((3,), np.log(8 / (640 / stride) ** 2)), atol=0.13)
        assert torch.allclose(bias[:, 5:], torch.full((3, 3), np.log(0.6 / (3 - 0.99))), atol=0.13)
    bns = [m for m in nano.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert bns and all(bn.eps == 1e-3 and bn.momentum == 0.03 for bn in bns)


@pytest.mark.parametrize("cfg,published_fused", [("yolov5n", 1_867_405), ("yolov5s", 7_225_885)])
def test_parameter_counts_match_published(cfg: str, published_fused: int) -> None:
    model = build_model(spec_from_cfg(cfg, 80))
    count = sum(p.numel() for p in model.parameters())
    assert abs(count - published_fused) / published_fused < 0.01
    # Ultralytics prints the count of the fused model: BN folded into conv biases.
    assert sum(p.numel() for p in model.fuse().parameters()) == published_fused


# YOLOv5's README gives the P6 models' parameters in millions (3.2, 12.6, 35.7, 76.8, 140.7) and yolov5x6's
# fused model summary 140,730,220 exactly. Our fused counts are within 0.1 M of the README (yolov5l6 is 76.73 M,
# which the README rounds up; its x6 figure is the fused count's, so l6's may come from an earlier release).
@pytest.mark.parametrize(
    "cfg,published_millions,published_fused",
    [("yolov5n6", 3.2, None), ("yolov5s6", 12.6, None), ("yolov5m6", 35.7, None), ("yolov5l6", 76.8, None)]
    + [("yolov5x6", 140.7, 140_730_220)],
)
def test_p6_parameter_counts_match_published(cfg: str, published_millions: float, published_fused: int | None) -> None:
    model = build_model(spec_from_cfg(cfg, 80))
    if cfg == "yolov5n6":
        assert estimate_gflops(model, 640) == pytest.approx(4.6, rel=0.03)  # YOLOv5's table: 4.6 GFLOPs at 640
    fused = sum(p.numel() for p in model.fuse().parameters())
    assert abs(fused / 1e6 - published_millions) < 0.1
    assert published_fused is None or fused == published_fused


def test_p6_model_has_four_levels_strides_to_64_and_yolov5_layer_numbers() -> None:
    torch.manual_seed(0)
    model = build_model(spec_from_cfg("yolov5n6", 3))
    assert model.stride.tolist() == [8.0, 16.0, 32.0, 64.0] and model.spec.max_stride == 64
    pixels = model.anchors * model.stride.view(-1, 1, 1)
    assert torch.allclose(pixels.flatten(), torch.tensor(DEFAULT_ANCHORS_P6, dtype=torch.float32).flatten())
    x = torch.rand(2, 3, 128, 192)
    raw = model(x)
    assert [tuple(r.shape) for r in raw] == [(2, 3, 128 // s, 192 // s, 8) for s in (8, 16, 32, 64)]
    model.eval()
    with torch.no_grad():
        decoded, _ = model(x)
    assert decoded.shape == (2, sum(3 * (128 // s) * (192 // s) for s in (8, 16, 32, 64)), 8)
    layers = model.layers()
    kinds = [type(layer).__name__ for layer in layers]
    assert len(layers) == 34 and kinds[11] == "SPPF" and kinds[12] == "Conv" and kinds[33] == "DetectHead"
    assert [kinds[i] for i in (23, 26, 29, 32)] == ["C3"] * 4  # the head's inputs, as in yolov5s6.yaml
    model.train()
    freeze_layers(model, (12,))
    backbone = {id(p) for p in model.backbone.parameters()}
    assert all(p.requires_grad == (id(p) not in backbone) for p in model.parameters())


def test_p6_spec_round_trips_and_refuses_seg() -> None:
    spec = spec_from_cfg("yolov5s6.yaml", 5)  # a size name with .yaml, not a file
    assert ModelSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    assert build_model(spec_from_cfg("yolov5n", 3)).spec.max_stride == 32
    with pytest.raises(ConfigError, match="no P6 -seg models"):
        spec_from_cfg("yolov5s6-seg", 3)
    with pytest.raises(ConfigError, match="no P6 -seg models"):
        SEGMENT.spec_from_cfg("yolov5n6", 3)


def test_gflops_and_model_info() -> None:
    model = build_model(spec_from_cfg("yolov5n", 80))
    assert estimate_gflops(model, 640) == pytest.approx(4.5, rel=0.03)  # published 4.5 GFLOPs
    assert estimate_gflops(model, (320, 640)) == pytest.approx(estimate_gflops(model, 640) / 2)
    info = model_info(model, 640)
    assert "1,872,157 parameters" in info and re.search(r"4\.\d GFLOPs", info)
    assert model.training  # restored


def _eval_tensors(output: tuple) -> list[torch.Tensor]:
    """Flatten an eval output (detect: decoded, raw; segment: decoded, (raw, protos)); boxes scaled to ~[0, 1]."""
    decoded, second = output
    raw, extra = (second[0], [second[1]]) if isinstance(second, tuple) else (second, [])
    return [decoded[..., 4:], decoded[..., :4] / 640, *raw, *extra]


@pytest.mark.parametrize("cfg", ["yolov5n", "yolov5n-seg"])
def test_fuse_keeps_eval_outputs(cfg: str) -> None:
    torch.manual_seed(1)
    model = build_model(spec_from_cfg(cfg, 3))
    with torch.no_grad():
        for bn in (m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)):
            bn.running_mean.uniform_(-0.2, 0.2)
            bn.running_var.uniform_(0.5, 2.0)
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.uniform_(-0.2, 0.2)
    model.eval()
    x = torch.rand(2, 3, 96, 64)
    with torch.no_grad():
        before = _eval_tensors(model(x))
        model.fuse()
        after = _eval_tensors(model(x))
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in model.modules())
    assert len(before) == (6 if cfg.endswith("-seg") else 5)
    for tensor, fused in zip(before, after, strict=True):
        assert torch.allclose(tensor, fused, atol=1e-4)


def _conv_output_layouts(model: torch.nn.Module, x: torch.Tensor) -> set[bool]:
    """Run `model(x)` and return, for every conv output with channels and pixels > 1, whether it was NHWC."""
    layouts: set[bool] = set()

    def record(module, inputs, output) -> None:
        if output.shape[1] > 1 and output.shape[2] * output.shape[3] > 1:
            layouts.add(output.is_contiguous(memory_format=torch.channels_last) and not output.is_contiguous())

    hooks = [m.register_forward_hook(record) for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
    try:
        model(x)
    finally:
        for hook in hooks:
            hook.remove()
    return layouts


@pytest.mark.parametrize("cfg", ["yolov5n", "yolov5n-seg"])
def test_channels_last_model_matches_nchw_in_training_and_after_fuse(cfg: str) -> None:
    torch.manual_seed(2)
    nchw = build_model(spec_from_cfg(cfg, 3))
    nhwc = build_model(spec_from_cfg(cfg, 3))
    nhwc.load_state_dict(nchw.state_dict())
    nhwc.to(memory_format=memory_format(True))
    x = torch.rand(2, 3, 96, 64)  # NCHW input: the first conv's NHWC weight switches the layout
    assert _conv_output_layouts(nhwc, x) == {True}
    assert _conv_output_layouts(nchw, x) == {False}
    losses = []
    for model in (nchw, nhwc):
        model.train()
        raw = model(x)
        tensors = [*raw[0], raw[1]] if isinstance(raw, tuple) else list(raw)
        loss = sum((t.float() * torch.linspace(-1, 1, t.numel()).view(t.shape)).sum() for t in tensors)
        loss.backward()
        losses.append(loss.detach())
    assert torch.allclose(losses[0], losses[1], rtol=1e-4)
    grads = [dict((n, p.grad) for n, p in m.named_parameters()) for m in (nchw, nhwc)]
    for name, grad in grads[0].items():
        assert (grad - grads[1][name]).norm() <= 1e-3 * grad.norm() + 1e-6, name  # summation order differs
    # fuse() builds new NCHW convs; applying the layout again after it keeps NHWC end to end.
    for model in (nchw, nhwc):
        model.eval().fuse()
    nhwc.to(memory_format=memory_format(True))
    with torch.no_grad():
        assert _conv_output_layouts(nhwc, x) == {True}
        for a, b in zip(_eval_tensors(nchw(x)), _eval_tensors(nhwc(x)), strict=True):
            assert torch.allclose(a, b, rtol=1e-4, atol=1e-4)


def test_spec_from_size_names() -> None:
    assert spec_from_cfg("yolov5s", 5) == spec_from_cfg("s", 5) == spec_from_cfg("yolov5s.yaml", 5)
    spec = spec_from_cfg("yolov5x", 5)
    assert (spec.depth_multiple, spec.width_multiple, spec.num_masks) == (1.33, 1.25, 0)
    seg = spec_from_cfg("yolov5s-seg", 5)
    assert (seg.num_masks, seg.num_protos) == (32, 128)
    assert spec_from_cfg("n-seg", 5).num_protos == 64
    with pytest.raises(ValueError, match="yolov5q"):
        spec_from_cfg("yolov5q", 5)
    assert type(build_model(spec_from_cfg("n-seg", 2))).__name__ == "SegmentationModel"  # see test_seg_model.py


def test_spec_from_yaml_reorders_anchors(tmp_path: Path) -> None:
    reversed_anchors = [list(level) for level in reversed(DEFAULT_ANCHORS)]
    path = tmp_path / "tiny.yaml"
    content = {"depth_multiple": 0.33, "width_multiple": 0.125, "anchors": reversed_anchors, "nc": 80}
    path.write_text(yaml.safe_dump(content))
    spec = spec_from_cfg(str(path), 4)
    assert spec.num_classes == 4 and spec.width_multiple == 0.125
    assert spec.anchors[0] == (116.0, 90.0, 156.0, 198.0, 373.0, 326.0)
    model = build_model(spec)
    pixels = model.head.anchors * model.stride.view(-1, 1, 1)
    assert pixels[0].flatten().tolist() == [10.0, 13.0, 16.0, 30.0, 33.0, 23.0]  # smallest on stride 8
    assert pixels[2].flatten().tolist() == [116.0, 90.0, 156.0, 198.0, 373.0, 326.0]
    assert model.head.convs[0].in_channels == 32  # 256 * 0.125


def test_spec_yaml_errors_name_file_and_key(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("depth_multiple: 0.33\nwidth_multiple: 0.25\nbackbone: []\n")
    with pytest.raises(ValueError, match=r"bad\.yaml.*backbone"):
        spec_from_cfg(str(path), 3)
    path.write_text("depth_multiple: 0.33\nwidth_multiple: 0.25\nanchors: [[1, 2, 3], [4, 5, 6], [7, 8, 9]]\n")
    with pytest.raises(ValueError, match=r"bad\.yaml.*anchors"):
        spec_from_cfg(str(path), 3)


def test_model_spec_round_trip() -> None:
    spec = ModelSpec(0.67, 0.75, ((1.5, 2.0, 3, 4), (5, 6, 7, 8), (9, 10, 11, 12)), 7, num_masks=32, num_protos=192)
    data = json.loads(json.dumps(spec.to_dict()))
    assert ModelSpec.from_dict(data) == spec
    assert ModelSpec.from_dict(yaml.safe_load(yaml.safe_dump(spec.to_dict()))) == spec
    with pytest.raises(ValueError, match="unknown key 'extra'"):
        ModelSpec.from_dict({**data, "extra": 1})
    with pytest.raises(ValueError, match="num_classes"):
        ModelSpec(0.33, 0.25, DEFAULT_ANCHORS, 0)


def test_kmeans_finds_separated_clusters() -> None:
    rng = np.random.default_rng(0)
    centres = np.array([[0.0, 0.0], [10.0, 0.0], [0.0, 10.0]])
    points = np.concatenate([c + rng.normal(0, 0.3, (50, 2)) for c in centres])
    found = kmeans(points, 3, np.random.default_rng(1))
    distances = np.linalg.norm(found[:, None] - centres[None], axis=2)  # (found, true)
    assert found.shape == (3, 2) and (distances.min(axis=0) < 0.2).all() and (distances.min(axis=1) < 0.2).all()


def test_check_anchors_keeps_fitting_anchors(nano: DetectionModel) -> None:
    rng = np.random.default_rng(0)
    anchors_px = np.array(DEFAULT_ANCHORS, dtype=np.float64).reshape(-1, 2)
    label_wh = anchors_px[rng.integers(9, size=500)] * rng.uniform(0.6, 1.6, (500, 2))
    before = nano.head.anchors.clone()
    assert check_anchors(label_wh, nano, threshold=4.0, imgsz=640) is False
    assert torch.equal(nano.head.anchors, before)


def test_check_anchors_refits_elongated_boxes() -> None:
    model = build_model(spec_from_cfg("yolov5n", 1))
    rng = np.random.default_rng(0)
    long_side, short_side = rng.uniform(120, 400, 1500), rng.uniform(3, 8, 1500)
    label_wh = np.concatenate([np.stack([long_side, short_side], 1), np.stack([short_side, long_side], 1)])
    strides = model.stride.view(-1, 1, 1)
    old_bpr = best_possible_recall(label_wh, (model.head.anchors * strides).view(-1, 2).numpy(), 4.0)
    assert old_bpr < 0.5
    assert check_anchors(label_wh, model, threshold=4.0, imgsz=640) is True
    new_px = (model.head.anchors * strides).numpy()
    assert best_possible_recall(label_wh, new_px.reshape(-1, 2), 4.0) >= 0.98
    level_areas = new_px.prod(-1).mean(-1)
    assert (np.diff(level_areas) > 0).all()  # finest level holds the smallest anchors
    assert anchor_match_ratios(label_wh[:1], new_px.reshape(-1, 2)).shape == (1, 9)
