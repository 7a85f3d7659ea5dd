"""Tests for the YOLOv5-seg models in models/: spec, SegmentHead outputs, published sizes, fuse, layers, round trip."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from models.heads import SegmentHead
from models.model_info import estimate_gflops, model_info
from models.yolo import ModelSpec, SegmentationModel, build_model, segmentation_spec, spec_from_cfg

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# Published YOLOv5-seg sizes (nc=80): README millions, and the exact fused counts of the n/s model summaries.
README_PARAMS_M = {"n": 2.0, "s": 7.6, "m": 22.0, "l": 47.9, "x": 88.8}
FUSED_PARAMS = {"n": 1_986_637, "s": 7_611_485}
PUBLISHED_GFLOPS = {"n": 7.1, "s": 26.4}


@pytest.fixture(scope="module")
def nano_seg() -> SegmentationModel:
    torch.manual_seed(0)
    model = build_model(spec_from_cfg("yolov5n-seg", 3))
    assert isinstance(model, SegmentationModel)
    return model


def test_seg_spec_builds_segment_head(nano_seg: SegmentationModel) -> None:
    head = nano_seg.head
    assert isinstance(head, SegmentHead) and head.num_masks == 32 and head.num_protos == 64
    assert head.num_outputs == 5 + 3 + 32 and head.convs[0].out_channels == 3 * 40
    proto = head.proto
    assert proto.expand.conv.in_channels == nano_seg.neck.out_channels[0] == 64
    channels = [block.conv.out_channels for block in (proto.expand, proto.refine, proto.project)]
    assert channels == [64, 64, 32]
    assert proto.expand.conv.kernel_size == (3, 3) and proto.project.conv.kernel_size == (1, 1)
    assert type(build_model(spec_from_cfg("yolov5n", 3))).__name__ == "DetectionModel"


def test_segmentation_spec_matches_seg_names() -> None:
    for size in "nsmlx":
        assert segmentation_spec(spec_from_cfg(size, 4)) == spec_from_cfg(f"yolov5{size}-seg", 4)
    assert [spec_from_cfg(f"{size}-seg", 4).num_protos for size in "nsmlx"] == [64, 128, 192, 256, 320]
    with pytest.raises(ValueError, match="num_protos"):
        ModelSpec(0.33, 0.25, spec_from_cfg("n", 1).anchors, 1, num_masks=32)


def test_train_and_eval_outputs(nano_seg: SegmentationModel) -> None:
    x = torch.rand(2, 3, 64, 96)
    nano_seg.train()
    raw, protos = nano_seg(x)
    expected = [(2, 3, 64 // s, 96 // s, 40) for s in (8, 16, 32)]
    assert [tuple(r.shape) for r in raw] == expected and protos.shape == (2, 32, 16, 24)
    nano_seg.eval()
    with torch.no_grad():
        decoded, (raw_eval, protos_eval) = nano_seg(x)
    nano_seg.train()
    cells = sum(3 * (64 // s) * (96 // s) for s in (8, 16, 32))
    assert decoded.shape == (2, cells, 40) and protos_eval.shape == (2, 32, 16, 24)
    assert [tuple(r.shape) for r in raw_eval] == expected
    # Mask coefficients pass through decoding unchanged (raw), in the head's level/anchor/cell order.
    flat_coeffs = torch.cat([r[..., 8:].reshape(2, -1, 32) for r in raw_eval], dim=1)
    assert torch.equal(decoded[..., 8:], flat_coeffs)
    assert ((decoded[..., 4:8] >= 0) & (decoded[..., 4:8] <= 1)).all()


@pytest.mark.parametrize("size", list("nsmlx"))
def test_parameter_counts_match_published(size: str) -> None:
    model = build_model(spec_from_cfg(f"yolov5{size}-seg", 80))
    count = sum(p.numel() for p in model.parameters())
    assert abs(count / 1e6 - README_PARAMS_M[size]) / README_PARAMS_M[size] < 0.01
    if size in FUSED_PARAMS:  # Ultralytics' summary counts the fused model (BN folded into conv biases)
        assert sum(p.numel() for p in model.fuse().parameters()) == FUSED_PARAMS[size]


@pytest.mark.parametrize("size", ["n", "s"])
def test_gflops_match_published(size: str) -> None:
    model = build_model(spec_from_cfg(f"yolov5{size}-seg", 80))
    assert estimate_gflops(model, 640) == pytest.approx(PUBLISHED_GFLOPS[size], rel=0.02)
    if size == "n":
        assert "1,991,549 parameters" in model_info(model, 640) and model.training


def test_layers_put_proto_in_head_layer(nano_seg: SegmentationModel) -> None:
    layers = nano_seg.layers()
    assert len(layers) == 25 and layers[24] is nano_seg.head
    head_params = {id(p) for p in layers[24].parameters()}
    assert all(id(p) in head_params for p in nano_seg.head.proto.parameters())
    all_params = {id(p) for layer in layers for p in layer.parameters()}
    assert all_params == {id(p) for p in nano_seg.parameters()}  # --freeze indices cover every parameter


def test_checkpoint_spec_round_trip_rebuilds_the_model(nano_seg: SegmentationModel) -> None:
    data = json.loads(json.dumps(nano_seg.spec.to_dict()))
    rebuilt = build_model(ModelSpec.from_dict(data))
    assert isinstance(rebuilt, SegmentationModel) and rebuilt.spec == nano_seg.spec
    rebuilt.load_state_dict(nano_seg.state_dict())  # strict: same parameters and buffers
    nano_seg.eval()
    rebuilt.eval()
    x = torch.rand(1, 3, 64, 64)
    with torch.no_grad():
        assert torch.equal(nano_seg(x)[1][1], rebuilt(x)[1][1])
    nano_seg.train()


def test_yaml_cfg_with_num_masks(tmp_path: Path) -> None:
    path = tmp_path / "tiny-seg.yaml"
    path.write_text(yaml.safe_dump({"depth_multiple": 0.33, "width_multiple": 0.125, "num_masks": 8}))
    spec = spec_from_cfg(str(path), 2)
    assert (spec.num_masks, spec.num_protos) == (8, 32)
    model = build_model(spec)
    assert model.head.num_outputs == 5 + 2 + 8 and model.head.proto.project.conv.out_channels == 8
    path.write_text(yaml.safe_dump({"depth_multiple": 0.33, "width_multiple": 0.125, "num_masks": -1}))
    with pytest.raises(ValueError, match=r"tiny-seg\.yaml.*num_masks"):
        spec_from_cfg(str(path), 2)
