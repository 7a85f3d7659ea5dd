"""YOLOv5 checkpoints: read safely (nothing in the pickle runs), mapped onto our models by structure."""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from models.yolo import ModelSpec, build_model
from tests import yolov5_fakes as v5
from utils.checkpoint import load_checkpoint
from utils.convert import convert_checkpoint, load_weights, main
from utils.data.data_config import DataConfig
from utils.distributed import DistContext
from utils.errors import ConfigError
from utils.hyp import load_hyp
from utils.inference_model import load_inference_model
from utils.safe_pickle import Placeholder, RestrictedUnpickler, UnsafePickleError, load_untrusted
from utils.tasks import DETECT
from utils.train.config import TrainConfig
from utils.train.plan import RunPlan, plan_model
from utils.train.records import family_training
from utils.train.setup import build_model_bundle

REPO = Path(__file__).resolve().parents[1]
CUSTOM_ANCHORS = ((9, 11, 21, 19, 17, 41), (43, 32, 39, 70, 86, 64), (65, 131, 134, 114, 184, 192))


def our_model(checkpoint: dict) -> torch.nn.Module:
    model = build_model(ModelSpec.from_dict(checkpoint["model_spec"]))
    model.load_state_dict(checkpoint["model"])
    return model.float().eval()


@pytest.fixture(scope="module")
def yolov5n_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    """A yolov5n with 3 classes and non-default anchors, saved as YOLOv5 saves a best.pt."""
    model = v5.randomise(v5.DetectionModel(0.33, 0.25, nc=3, anchors=CUSTOM_ANCHORS))
    path = tmp_path_factory.mktemp("v5") / "yolov5n.pt"
    v5.save_yolov5_checkpoint(model, str(path))
    return path, model.eval()


def test_converted_detector_reproduces_the_yolov5_outputs(yolov5n_file: tuple[Path, torch.nn.Module]) -> None:
    path, original = yolov5n_file
    checkpoint = convert_checkpoint(path)
    assert checkpoint["task"] == "detect"
    assert checkpoint["names"] == ["class0", "class1", "class2"]
    spec = ModelSpec.from_dict(checkpoint["model_spec"])
    assert (spec.depth_multiple, spec.width_multiple, spec.num_classes) == (0.33, 0.25, 3)
    assert spec.anchors == tuple(tuple(float(v) for v in level) for level in CUSTOM_ANCHORS)
    image = torch.rand(2, 3, 96, 128)
    with torch.no_grad():
        expected = original(image)
        _, raw = our_model(checkpoint)(image)
    assert len(raw) == 3
    for ours, theirs in zip(raw, expected, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_converted_segmenter_reproduces_outputs_and_protos(tmp_path: Path) -> None:
    original = v5.randomise(v5.SegmentationModel(0.33, 0.25, nc=2), seed=1)
    path = tmp_path / "yolov5n-seg.pt"
    v5.save_yolov5_checkpoint(original, str(path), with_ema=True)
    checkpoint = convert_checkpoint(path)
    assert checkpoint["task"] == "segment" and checkpoint["epoch"] == 299
    spec = ModelSpec.from_dict(checkpoint["model_spec"])
    assert (spec.num_masks, spec.num_protos) == (32, 64)
    image = torch.rand(1, 3, 64, 64)
    with torch.no_grad():
        expected_raw, expected_protos = original(image)
        _, (raw, protos) = our_model(checkpoint)(image)
    torch.testing.assert_close(protos, expected_protos, rtol=1e-4, atol=1e-4)
    for ours, theirs in zip(raw, expected_raw, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_cli_writes_a_weights_only_checkpoint(yolov5n_file: tuple[Path, torch.nn.Module], tmp_path: Path) -> None:
    output = main([str(yolov5n_file[0]), str(tmp_path / "ours.pt")])
    reloaded = load_checkpoint(output)  # torch.load(weights_only=True) inside
    assert reloaded["optimizer"] is None and reloaded["names"] == ["class0", "class1", "class2"]
    model, _ = load_inference_model(output, (DETECT).name, torch.device("cpu"))
    assert model.num_classes == 3


def test_weights_flag_converts_on_the_fly(yolov5n_file: tuple[Path, torch.nn.Module], caplog) -> None:
    caplog.set_level("INFO")
    checkpoint = load_weights(yolov5n_file[0])
    assert checkpoint["task"] == "detect"
    assert "converted models.yolo.DetectionModel" in caplog.text


def test_fine_tuning_with_another_nc_reinitialises_only_the_head(
    yolov5n_file: tuple[Path, torch.nn.Module], tmp_path: Path
) -> None:
    converted = convert_checkpoint(yolov5n_file[0])["model"]
    hyp = load_hyp(REPO / "data" / "hyps" / "hyp.scratch-low.yaml")
    cfg = TrainConfig(hyp=hyp, weights=str(yolov5n_file[0]), channels_last=False)
    names = tuple(f"part{i}" for i in range(5))
    data = DataConfig(yaml_file=tmp_path / "d.yaml", root=tmp_path, splits={}, names=names, annotations={})
    spec, weights = plan_model(cfg, DETECT, names, resume=None)
    plan = RunPlan(cfg, data, names, spec, family_training(spec), weights=weights)
    bundle = build_model_bundle(plan, DistContext())
    state = bundle.model.state_dict()
    assert bundle.model.num_classes == 5 and bundle.names == names
    for key, tensor in state.items():
        if key.startswith("head.convs."):
            assert tensor.shape != converted[key].shape, key  # new class count: fresh head convs
        else:
            torch.testing.assert_close(tensor, converted[key].to(tensor.dtype), msg=key)
    anchors_px = state["head.anchors"] * state["head.stride"].view(-1, 1, 1)
    torch.testing.assert_close(anchors_px, torch.tensor(CUSTOM_ANCHORS, dtype=torch.float32).view(3, 3, 2))


class SystemCall:
    """A pickle that runs a shell command when loaded by an unrestricted unpickler."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return os.system, (f"touch {self.marker}",)


class EvalCall:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return eval, (f"open({str(self.marker)!r}, 'w').close()",)


@pytest.mark.parametrize("payload", [SystemCall, EvalCall])
def test_a_pickle_that_runs_code_is_refused_and_nothing_runs(payload: type, tmp_path: Path) -> None:
    marker = tmp_path / "side-effect"
    path = tmp_path / "evil.pt"
    torch.save({"model": payload(marker), "epoch": 1}, path)
    for load in (load_untrusted, load_weights, convert_checkpoint):
        with pytest.raises(UnsafePickleError, match="nothing from the file was executed") as error:
            load(path)
        assert "\n" not in str(error.value)
    assert not marker.exists()
    # The same file does run code under plain pickle rules: the test would notice a harmless payload.
    torch.load(path, weights_only=False)
    assert marker.exists()


class WritesOnConstruction:
    """A class whose construction has a side effect: restricted loading must never instantiate it."""

    def __init__(self, marker: str) -> None:
        Path(marker).write_text("constructed")

    def __reduce__(self) -> tuple:
        return WritesOnConstruction, (self.marker,)


def test_unknown_classes_become_inert_placeholders(tmp_path: Path) -> None:
    marker = tmp_path / "constructed"
    obj = object.__new__(WritesOnConstruction)
    obj.marker = str(marker)
    path = tmp_path / "objects.pt"
    torch.save({"thing": obj, "weights": torch.arange(4.0)}, path)
    loaded = load_untrusted(path)
    assert isinstance(loaded["thing"], Placeholder)
    assert loaded["thing"].source.endswith("WritesOnConstruction")
    assert loaded["thing"].args == (str(marker),)
    assert torch.equal(loaded["weights"], torch.arange(4.0))
    assert not marker.exists()


def test_restricted_unpickler_refuses_before_the_call(tmp_path: Path) -> None:
    payload = pickle.dumps(SystemCall(tmp_path / "x"), protocol=2)
    with pytest.raises(UnsafePickleError):
        RestrictedUnpickler(io.BytesIO(payload)).load()
    assert not (tmp_path / "x").exists()


def _saved(model: torch.nn.Module, tmp_path: Path, name: str) -> Path:
    path = tmp_path / name
    v5.save_yolov5_checkpoint(model, str(path))
    return path


def test_converted_p6_detector_reproduces_the_yolov5_outputs(tmp_path: Path) -> None:
    original = v5.randomise(v5.DetectionModel(0.33, 0.25, nc=2, anchors=v5.ANCHORS_P6, p6=True)).eval()
    checkpoint = convert_checkpoint(_saved(original, tmp_path, "yolov5n6.pt"))
    spec = ModelSpec.from_dict(checkpoint["model_spec"])
    assert spec.anchors == tuple(tuple(float(v) for v in level) for level in v5.ANCHORS_P6)
    converted = our_model(checkpoint)
    assert converted.stride.tolist() == [8.0, 16.0, 32.0, 64.0]
    image = torch.rand(1, 3, 128, 192)
    with torch.no_grad():
        expected, (_, raw) = original.float()(image), converted(image)
    assert len(raw) == 4
    for ours, theirs in zip(raw, expected, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_a_custom_layout_is_one_line_error(tmp_path: Path) -> None:
    model = v5.DetectionModel(0.33, 0.25, nc=2)
    model.model.append(v5.Conv(8, 8))  # one layer more than the P5 layout
    with pytest.raises(ConfigError, match="26 layers \\(a custom model\\)"):
        convert_checkpoint(_saved(model, tmp_path, "custom26.pt"))
    model = v5.DetectionModel(0.33, 0.25, nc=2)
    model.model[9] = v5.Conv(256, 256)  # SPP(F) replaced
    with pytest.raises(ConfigError, match="layer 9 is Conv, expected SPPF"):
        convert_checkpoint(_saved(model, tmp_path, "custom.pt"))


def test_an_anchor_free_head_is_refused(tmp_path: Path) -> None:
    model = v5.DetectionModel(0.33, 0.25, nc=2)
    del model.model[24]._buffers["anchors"]
    with pytest.raises(ConfigError, match="anchor-free head"):
        convert_checkpoint(_saved(model, tmp_path, "v8.pt"))


def test_every_tensor_shape_is_checked(tmp_path: Path) -> None:
    model = v5.DetectionModel(0.33, 0.25, nc=2)
    model.model[13].cv3.bn.running_var = torch.ones(7)
    with pytest.raises(ConfigError, match=r"neck.top_down4.mix.bn.running_var has shape \(7,\)"):
        convert_checkpoint(_saved(model, tmp_path, "bad.pt"))


def _leaky(model: torch.nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, v5.Conv):
            module.act = torch.nn.LeakyReLU(0.1)  # yolov5s-LeakyReLU.yaml's network: same tensors, other outputs


def _neck_shortcut(model: torch.nn.Module) -> None:
    model.model[23].m[0].add = True  # a neck C3 built with shortcut=True


def _no_backbone_shortcut(model: torch.nn.Module) -> None:
    model.model[2].m[0].add = False


def _sppf_kernel(model: torch.nn.Module) -> None:
    model.model[9].m = torch.nn.MaxPool2d(3, 1, 1)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (_leaky, r"layer 0 \(Conv\): activation LeakyReLU, ours SiLU"),
        (_neck_shortcut, r"layer 23 \(C3\): m.0 adds its input \(a residual shortcut\), ours does not"),
        (_no_backbone_shortcut, r"layer 2 \(C3\): ours \(blocks.0\) adds its input .*, the file's does not"),
        (_sppf_kernel, r"layer 9 \(SPPF\): m has pool kernel 3, ours \(pool\) 5"),
    ],
    ids=["leaky_relu", "neck_shortcut", "no_backbone_shortcut", "sppf_kernel"],
)
def test_a_network_that_computes_otherwise_with_the_same_tensors_is_refused(
    change, message: str, tmp_path: Path
) -> None:
    model = v5.DetectionModel(0.33, 0.25, nc=2)
    change(model)
    with pytest.raises(ConfigError, match=message + "; converting it would change what the network computes"):
        convert_checkpoint(_saved(model, tmp_path, "other.pt"))


def test_our_own_checkpoint_errors_are_kept_for_files_that_are_neither(tmp_path: Path) -> None:
    path = tmp_path / "plain.pt"
    torch.save({"something": torch.zeros(2), "other": [1, 2]}, path)
    with pytest.raises(ConfigError, match="not a checkpoint of this project"):
        load_weights(path)


def test_scale_is_inferred_when_the_yaml_is_missing(tmp_path: Path) -> None:
    model = v5.DetectionModel(0.67, 0.75, nc=2)
    model.yaml = None
    spec = ModelSpec.from_dict(convert_checkpoint(_saved(model, tmp_path, "m.pt"))["model_spec"])
    assert dataclasses.astuple(spec)[:2] == pytest.approx((0.667, 0.75), abs=1e-3)


@pytest.mark.slow
def test_module_entry_point_converts(yolov5n_file: tuple[Path, torch.nn.Module], tmp_path: Path) -> None:
    output = tmp_path / "cli.pt"
    done = subprocess.run(
        [sys.executable, "-m", "utils.convert", str(yolov5n_file[0]), str(output)],
        cwd=REPO, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "detect model, 3 classes" in done.stdout and output.is_file()


def test_resuming_a_yolov5_checkpoint_says_to_fine_tune_it(yolov5n_file: tuple[Path, torch.nn.Module]) -> None:
    path, _ = yolov5n_file
    with pytest.raises(ConfigError) as refused:
        load_checkpoint(path, for_resume=True)
    message = str(refused.value)
    assert message.startswith(f"checkpoint {path} is a YOLOv5 / Ultralytics checkpoint (WeightsUnpickler error: ")
    assert "models.yolo.DetectionModel" in message and "Please use" not in message  # torch's advice left out
    assert message.endswith(f"fine-tune from it with --weights {path}; its run cannot be resumed here")


def test_a_whole_pickled_network_of_another_kind_is_one_line(tmp_path: Path) -> None:
    # torch.save(model) of any other network: the pickle's top object is a module without a layer list.
    path = tmp_path / "seq.pt"
    torch.save(torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU()), path)
    with pytest.raises(ConfigError, match="not a YOLOv5 or Ultralytics checkpoint"):
        convert_checkpoint(path)
