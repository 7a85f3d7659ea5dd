"""Ultralytics YOLOv8 / YOLO11 / YOLO26 checkpoints: read safely, mapped onto AnchorFreeModel, outputs reproduced."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests import ultralytics_fakes as uf
from utils.convert import convert_checkpoint, load_weights
from utils.data.data_config import DataConfig
from utils.distributed import DistContext
from utils.errors import ConfigError
from utils.families import build_model, spec_from_checkpoint
from utils.hyp import load_hyp
from utils.safe_pickle import UnsafePickleError
from utils.tasks import DETECT
from utils.train.config import TrainConfig
from utils.train.plan import RunPlan, plan_model
from utils.train.records import family_training
from utils.train.setup import build_model_bundle

REPO = Path(__file__).resolve().parents[1]


def _saved(model: torch.nn.Module, tmp_path: Path, name: str = "model.pt", released: bool = True) -> Path:
    path = tmp_path / name
    uf.save_ultralytics_checkpoint(model, str(path), released=released)
    model.half().float()  # the file holds fp16 weights: compare against the same rounding
    return path


def _ours(checkpoint: dict) -> torch.nn.Module:
    model = build_model(spec_from_checkpoint(checkpoint))
    model.load_state_dict(checkpoint["model"])
    return model.float().eval()


@pytest.mark.parametrize("layout", ["yolov8", "yolo11", "yolo26"])
@pytest.mark.parametrize("seg", [False, True], ids=["detect", "seg"])
def test_converted_model_reproduces_the_raw_outputs(layout: str, seg: bool, tmp_path: Path) -> None:
    model_type = uf.SegmentationModel if seg else uf.DetectionModel
    original = uf.randomise(model_type(layout, nc=3), seed=len(layout) + seg)
    checkpoint = convert_checkpoint(_saved(original, tmp_path))
    spec = spec_from_checkpoint(checkpoint)
    assert checkpoint["model_family"] == "anchor_free" and checkpoint["task"] == ("segment" if seg else "detect")
    assert checkpoint["names"] == ["class0", "class1", "class2"]
    is_26 = layout == "yolo26"
    assert (spec.layout, spec.scale, spec.width_multiple, spec.num_classes) == (layout, "t", 0.125, 3)
    assert (spec.reg_max, spec.end_to_end, spec.num_masks) == (1 if is_26 else 16, is_26, 32 if seg else 0)
    image = torch.rand(2, 3, 64, 96)
    with torch.no_grad():
        expected = original(image)
        _, raw = _ours(checkpoint)(image)
    if seg:
        (expected, expected_protos), (raw, protos) = expected, raw
        torch.testing.assert_close(protos, expected_protos, rtol=1e-4, atol=1e-4)
    pairs = (
        [(raw.levels, expected["one2many"]), (raw.one_to_one, expected["one2one"])]
        if is_26
        else [(raw.levels, expected)]
    )
    for ours, theirs in pairs:
        for level, (mine, reference) in enumerate(zip(ours, theirs, strict=True)):
            torch.testing.assert_close(mine, reference, rtol=1e-4, atol=1e-4, msg=f"level {level}")


@pytest.mark.parametrize("layout", ["yolov8", "yolo11"])
def test_a_linear_sppf_reduce_from_newer_ultralytics_converts_exactly(layout: str, tmp_path: Path) -> None:
    original = uf.randomise(uf.DetectionModel(layout, nc=3), seed=5)
    original.model[9].cv1.act = torch.nn.Identity()  # how Ultralytics 8.4.0-8.4.140 built it from a YAML
    checkpoint = convert_checkpoint(_saved(original, tmp_path))
    assert spec_from_checkpoint(checkpoint).linear_pool_reduce
    image = torch.rand(1, 3, 64, 64)
    with torch.no_grad():
        expected = original(image)
        _, raw = _ours(checkpoint)(image)
    for mine, reference in zip(raw.levels, expected, strict=True):
        torch.testing.assert_close(mine, reference, rtol=1e-4, atol=1e-4)
    standard = convert_checkpoint(_saved(uf.randomise(uf.DetectionModel(layout, nc=3)), tmp_path, "standard.pt"))
    assert not spec_from_checkpoint(standard).linear_pool_reduce


def test_another_activation_is_refused_naming_the_layer(tmp_path: Path) -> None:
    model = uf.DetectionModel("yolov8", nc=3)
    for module in model.modules():
        if isinstance(module, uf.Conv) and isinstance(module.act, torch.nn.SiLU):
            module.act = torch.nn.ReLU()  # a model.yaml with `activation: nn.ReLU()`
    with pytest.raises(ConfigError, match=r"layer 0 \(Conv\): activation ReLU, ours SiLU; converting it would"):
        convert_checkpoint(_saved(model, tmp_path))


def test_a_pre_strip_last_pt_converts_through_load_weights(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO")
    path = _saved(uf.DetectionModel("yolo11", nc=2), tmp_path, "last.pt", released=False)  # model None, ema set
    checkpoint = load_weights(path)
    assert checkpoint["epoch"] == 4 and checkpoint["model_family"] == "anchor_free"
    assert "converted ultralytics.nn.tasks.DetectionModel" in caplog.text


def test_scale_is_inferred_from_channels_without_model_yaml(tmp_path: Path) -> None:
    model = uf.DetectionModel("yolov8", nc=2, row=tuple(uf.SCALE_ROWS["yolov8"]["s"]), scale="s")
    model.yaml = None
    spec = spec_from_checkpoint(convert_checkpoint(_saved(model, tmp_path)))
    assert (spec.scale, spec.depth_multiple, spec.width_multiple, spec.max_channels) == ("s", 0.33, 0.5, 1024)


def test_a_different_layer_is_refused_in_one_line(tmp_path: Path) -> None:
    model = uf.DetectionModel("yolo11", nc=2)
    model.model[9] = uf.Conv(128, 128)  # SPPF replaced
    with pytest.raises(ConfigError, match="layer 9 is Conv, expected SPPF") as error:
        convert_checkpoint(_saved(model, tmp_path))
    assert "\n" not in str(error.value)


def test_a_tensor_of_another_shape_is_refused_naming_layer_and_tensor(tmp_path: Path) -> None:
    model = uf.DetectionModel("yolov8", nc=2)
    model.model[12].cv2.bn.running_var = torch.ones(7)
    with pytest.raises(ConfigError, match=r"layer 12 \(C2f\): tensor cv2.bn.running_var \(7,\) does not fit our"):
        convert_checkpoint(_saved(model, tmp_path))


class SystemCall:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return os.system, (f"touch {self.marker}",)


def test_code_inside_an_ultralytics_checkpoint_is_refused_and_never_runs(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    model = uf.DetectionModel("yolo26", nc=2)
    model.args = {"task": "detect", "hook": SystemCall(marker)}
    path = tmp_path / "evil.pt"
    with uf.ultralytics_pickle_paths():  # saved as is: a deep copy would run the payload here
        torch.save({"model": model, "ema": None, "version": "8.4.190"}, path)
    with pytest.raises(UnsafePickleError, match=r"names (os|posix)\.system") as error:
        load_weights(path)
    assert "\n" not in str(error.value) and not marker.exists()


def test_fine_tuning_yolo11_to_another_class_count_keeps_all_but_class_outputs(tmp_path: Path) -> None:
    path = _saved(uf.randomise(uf.DetectionModel("yolo11", nc=3)), tmp_path)
    converted = convert_checkpoint(path)["model"]
    hyp = load_hyp(REPO / "data" / "hyps" / "hyp.anchor-free.scratch.yaml")
    cfg = TrainConfig(hyp=hyp, weights=str(path), channels_last=False)
    names = tuple(f"part{i}" for i in range(5))
    data = DataConfig(yaml_file=tmp_path / "d.yaml", root=tmp_path, splits={}, names=names, annotations={})
    spec, weights = plan_model(cfg, DETECT, names, resume=None)
    plan = RunPlan(cfg, data, names, spec, family_training(spec), weights=weights)
    bundle = build_model_bundle(plan, DistContext())
    assert bundle.spec.family == "anchor_free" and bundle.spec.layout == "yolo11" and bundle.model.num_classes == 5
    for key, tensor in bundle.model.state_dict().items():
        if key.startswith("head.class_branches.") and key.split(".")[3] == "2":  # the last 1x1 conv: one row per class
            assert tensor.shape[0] == 5 and converted[key].shape[0] == 3, key
        else:
            torch.testing.assert_close(tensor, converted[key].to(tensor.dtype), msg=key)
