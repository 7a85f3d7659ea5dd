"""Tests for export.py / utils/export/: TorchScript and ONNX files match PyTorch, carry metadata, dynamic batch."""

from __future__ import annotations

import importlib.util
import logging
import shutil
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

import export
from models.yolo import DEFAULT_ANCHORS, DEFAULT_ANCHORS_P6, ModelSpec, build_model, segmentation_spec
from segment.task import SEGMENT
from utils import export as export_lib
from utils.backends.metadata import read_metadata
from utils.checkpoint import RunInfo, build_checkpoint, load_checkpoint, save_checkpoint
from utils.distributed import DistContext
from utils.errors import ConfigError, exit_on_user_error
from utils.export import (
    FP32_TOLERANCE,
    ExportConfig,
    ExportMismatchError,
    ExportWrapper,
    Tolerance,
    build_export_parser,
    check_parity,
    export_checkpoint,
    export_config_from_args,
)
from utils.inference_model import load_inference_model
from utils.tasks import DETECT, Task

TASKS = {DETECT.name: DETECT, SEGMENT.name: SEGMENT}
NAMES = ["circle", "square", "triangle"]
NUM_MASKS = 4
IMGSZ = 64
# The smallest width YOLOv5's layers allow (8 channels after rounding), full depth structure.
TINY_SPEC = ModelSpec(depth_multiple=0.33, width_multiple=0.125, anchors=DEFAULT_ANCHORS, num_classes=len(NAMES))

pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.filterwarnings("ignore:`torch.jit.load` is deprecated:FutureWarning"),  # TorchScript is under test
]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny untrained detection and segmentation checkpoint, saved as training saves them."""
    folder = tmp_path_factory.mktemp("export-weights")
    paths = {}
    for task, spec in ((DETECT, TINY_SPEC), (SEGMENT, segmentation_spec(TINY_SPEC, NUM_MASKS))):
        torch.manual_seed(0)
        model = build_model(spec)
        run = RunInfo(task=task.name, model_spec=spec.to_dict(), names=NAMES, train_config={}, hyp={})
        state = build_checkpoint(run=run, model=model, ema=None, optimizer=None, scaler=None, epoch=0, best_fitness=0)
        paths[task.name] = folder / f"{task.name}.pt"
        save_checkpoint(state, paths[task.name], DistContext())
    return paths


def _copy(checkpoints: dict[str, Path], task: Task, folder: Path) -> Path:
    """Copy the task's checkpoint to `folder` as best.pt, so each test's exports land in its own folder."""
    return Path(shutil.copy(checkpoints[task.name], folder / "best.pt"))


def _config(weights: Path, *include: str, **options: object) -> ExportConfig:
    return ExportConfig(weights=weights, include=include, imgsz=(IMGSZ, IMGSZ), **options)


@pytest.fixture(scope="module")
def references(checkpoints: dict[str, Path]) -> dict[str, ExportWrapper]:
    """Per task: the checkpoint's eval model reduced to the exported outputs, loaded once for every test's images."""
    found = {}
    for name, weights in checkpoints.items():
        model, _ = load_inference_model(weights, name, torch.device("cpu"), channels_last=False)
        found[name] = ExportWrapper(model).eval()
    return found


def _pytorch_outputs(references: dict[str, ExportWrapper], task: Task, images: torch.Tensor) -> list[np.ndarray]:
    """What the eval model of the task's checkpoint (the file each test exports a copy of) gives for `images`."""
    with torch.no_grad():
        outputs = references[task.name](images)
    return [t.numpy() for t in (outputs if isinstance(outputs, tuple) else (outputs,))]


def _check_outputs(got: list[np.ndarray], want: list[np.ndarray], task: Task, images: torch.Tensor) -> None:
    """Exported outputs equal PyTorch's within fp32 tolerance and have YOLOv5's shapes."""
    batch, _, height, width = images.shape
    num_boxes = 3 * sum((height // stride) * (width // stride) for stride in (8, 16, 32))
    num_outputs = 5 + len(NAMES) + (NUM_MASKS if task.with_masks else 0)
    assert got[0].shape == (batch, num_boxes, num_outputs)
    if task.with_masks:
        assert len(got) == 2 and got[1].shape == (batch, NUM_MASKS, height // 4, width // 4)
    for array, expected in zip(got, want, strict=True):
        np.testing.assert_allclose(array, expected, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("task", [DETECT, SEGMENT], ids=lambda task: task.name)
def test_torchscript_matches_pytorch_at_any_batch_and_size(
    checkpoints: dict[str, Path], references: dict[str, ExportWrapper], task: Task, tmp_path: Path
) -> None:
    weights = _copy(checkpoints, task, tmp_path)
    (result,) = export_checkpoint(_config(weights, "torchscript"), TASKS, DistContext())
    assert result.path == tmp_path / "best.torchscript" and result.path.is_file()
    assert result.max_abs_diff is not None and result.max_abs_diff <= 1e-4
    assert not list(tmp_path.glob(".*.tmp"))  # the temporary file was renamed, not left behind
    loaded = torch.jit.load(str(result.path))
    # Traced at batch 1 and 64 px, the graph builds its grids from the input's size: batch 3 at 96 x 64 works.
    for images in (torch.rand(1, 3, IMGSZ, IMGSZ), torch.rand(3, 3, 96, IMGSZ)):
        with torch.no_grad():
            outputs = loaded(images)
        got = [t.numpy() for t in (outputs if isinstance(outputs, tuple) else (outputs,))]
        _check_outputs(got, _pytorch_outputs(references, task, images), task, images)
    metadata = read_metadata(result.path)
    assert metadata.pop("date").startswith("20") and "exported from best.pt" in metadata.pop("description")
    assert metadata == {
        "stride": 32,
        "names": {0: "circle", 1: "square", 2: "triangle"},
        "task": task.name,
        "imgsz": [IMGSZ, IMGSZ],
        "batch": 1,
        "dynamic": False,
        "half": False,
        "precision": "fp32",
        "end2end": False,
        "channels": 3,
        "family": "yolov5",
        "layout": "rows",
        "num_masks": NUM_MASKS if task.with_masks else 0,
    }


def test_a_p6_model_exports_at_sides_rounded_to_64(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    spec = ModelSpec(0.33, 0.125, DEFAULT_ANCHORS_P6, num_classes=len(NAMES))
    run = RunInfo(task="detect", model_spec=spec.to_dict(), names=NAMES, train_config={}, hyp={})
    model = build_model(spec)
    state = build_checkpoint(run=run, model=model, ema=None, optimizer=None, scaler=None, epoch=0, best_fitness=0)
    save_checkpoint(state, tmp_path / "best.pt", DistContext())
    with caplog.at_level(logging.WARNING):
        (result,) = export_checkpoint(ExportConfig(weights=tmp_path / "best.pt", imgsz=(96, 160)), TASKS, DistContext())
    assert read_metadata(result.path)["imgsz"] == [128, 192] and read_metadata(result.path)["stride"] == 64
    assert any("--imgsz 96 160: sides must be multiples of 64" in record.getMessage() for record in caplog.records)


def test_export_traces_at_the_size_the_checkpoint_was_trained_at(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    checkpoint = load_checkpoint(checkpoints[DETECT.name])
    checkpoint["train_config"] = {"imgsz": 96}
    save_checkpoint(checkpoint, tmp_path / "best.pt", DistContext())
    cfg = export_config_from_args(build_export_parser().parse_args(["--weights", str(tmp_path / "best.pt")]))
    assert cfg.imgsz is None  # resolved when the checkpoint is read
    (result,) = export_checkpoint(cfg, TASKS, DistContext())
    assert read_metadata(result.path)["imgsz"] == [96, 96]


@pytest.mark.parametrize("task", [DETECT, SEGMENT], ids=lambda task: task.name)
def test_dynamic_onnx_matches_pytorch_at_batch_1_and_3(
    checkpoints: dict[str, Path], references: dict[str, ExportWrapper], task: Task, tmp_path: Path
) -> None:
    pytest.importorskip("onnx")
    onnxruntime = pytest.importorskip("onnxruntime")
    weights = _copy(checkpoints, task, tmp_path)
    (result,) = export_checkpoint(_config(weights, "onnx", dynamic=True), TASKS, DistContext())
    assert result.path == tmp_path / "best.onnx"
    assert result.max_abs_diff is not None and result.max_abs_diff <= 1e-3
    session = onnxruntime.InferenceSession(str(result.path), providers=["CPUExecutionProvider"])
    assert [out.name for out in session.get_outputs()] == (["output0", "output1"] if task.with_masks else ["output0"])
    for images in (torch.rand(1, 3, IMGSZ, IMGSZ), torch.rand(3, 3, IMGSZ, IMGSZ), torch.rand(2, 3, 96, IMGSZ)):
        got = session.run(None, {"images": images.numpy()})
        _check_outputs(got, _pytorch_outputs(references, task, images), task, images)
    # The axes that do not change are stated as numbers (readers take the class count from them), not names.
    declared = [output.shape for output in session.get_outputs()]
    assert declared[0] == ["batch", "anchors", got[0].shape[2]]
    if task.with_masks:
        assert declared[1] == ["batch", got[1].shape[1], "mask_height", "mask_width"]
    metadata = read_metadata(result.path)
    assert metadata["task"] == task.name and metadata["dynamic"] is True and metadata["stride"] == 32
    assert metadata["names"] == {0: "circle", 1: "square", 2: "triangle"} and metadata["imgsz"] == [IMGSZ, IMGSZ]


def test_static_onnx_refuses_another_batch_size(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    pytest.importorskip("onnx")
    onnxruntime = pytest.importorskip("onnxruntime")
    from onnxruntime.capi.onnxruntime_pybind11_state import InvalidArgument

    weights = _copy(checkpoints, DETECT, tmp_path)
    (result,) = export_checkpoint(_config(weights, "onnx", batch_size=2), TASKS, DistContext())
    session = onnxruntime.InferenceSession(str(result.path), providers=["CPUExecutionProvider"])
    assert session.run(None, {"images": np.zeros((2, 3, IMGSZ, IMGSZ), np.float32)})[0].shape[0] == 2
    with pytest.raises(InvalidArgument, match="images"):
        session.run(None, {"images": np.zeros((3, 3, IMGSZ, IMGSZ), np.float32)})
    assert read_metadata(result.path)["batch"] == 2


def test_onnx_without_onnxruntime_is_checked_but_parity_not_run(
    checkpoints: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    pytest.importorskip("onnx")
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # `import onnxruntime` now raises ImportError
    weights = _copy(checkpoints, DETECT, tmp_path)
    with caplog.at_level("INFO"):
        (result,) = export_checkpoint(_config(weights, "onnx"), TASKS, DistContext())
    assert result.path.is_file() and result.max_abs_diff is None
    assert "onnxruntime is not installed (pip install onnxruntime): parity not run" in caplog.text


def test_missing_onnx_is_one_line_before_any_work(
    checkpoints: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "onnx", None)  # `import onnx` now raises ImportError
    weights = _copy(checkpoints, DETECT, tmp_path)
    with pytest.raises(ConfigError) as error:
        export_checkpoint(_config(weights, "torchscript", "onnx"), TASKS, DistContext())
    assert str(error.value) == "ONNX export needs the 'onnx' package: pip install onnx"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["best.pt"]  # not even the TorchScript file


def test_simplify_without_onnxsim_is_one_line(
    checkpoints: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "onnx", types.ModuleType("onnx"))  # installed or not, the check passes
    monkeypatch.setitem(sys.modules, "onnxsim", None)
    with pytest.raises(ConfigError, match=r"^--simplify needs the 'onnxsim' package: pip install onnxsim$"):
        export_checkpoint(_config(_copy(checkpoints, DETECT, tmp_path), "onnx", simplify=True), TASKS, DistContext())


def test_half_on_cpu_is_refused(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--half needs a CUDA device"):
        export_checkpoint(_config(_copy(checkpoints, DETECT, tmp_path), "torchscript", half=True), TASKS, DistContext())


def test_failed_parity_leaves_no_file(
    checkpoints: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def mismatch(*args: object) -> float:
        raise ExportMismatchError("outputs differ")

    monkeypatch.setattr(export_lib, "check_parity", mismatch)
    weights = _copy(checkpoints, DETECT, tmp_path)
    with pytest.raises(ExportMismatchError):
        export_checkpoint(_config(weights, "torchscript"), TASKS, DistContext())
    assert sorted(path.name for path in tmp_path.iterdir()) == ["best.pt"]  # neither the file nor its temp


def test_the_margin_is_set_by_the_element_nearest_its_tolerance_not_the_largest_difference(
    checkpoints: dict[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A box corner at 200 px off by 0.05 uses 0.25 of its tolerance; one at 1 px off by 0.0015 uses 0.75.
    images = [torch.tensor([[200.0, 1.0]])]
    off = torch.tensor([[0.05, 0.0015]])
    parity = check_parity(torch.nn.Identity(), lambda x: [(x + off).numpy()], images, FP32_TOLERANCE, Path("m"))
    assert parity.max_abs_diff == pytest.approx(0.05, rel=1e-3)
    assert parity.tolerance_share == pytest.approx(0.75, rel=1e-2) and parity.worst_value == 1.0
    weights = _copy(checkpoints, DETECT, tmp_path)
    with caplog.at_level(logging.INFO):
        (result,) = export_checkpoint(_config(weights, "torchscript"), TASKS, DistContext())
    assert result.tolerance_share is not None and 0 <= result.tolerance_share < 0.1  # TorchScript: ~exact
    line = next(message for message in caplog.messages if message.startswith("torchscript: "))
    assert f"matches PyTorch at batch 1: max |diff| {result.max_abs_diff:.1e}, {result.tolerance_share:.2f} " in line
    assert "of the tolerance 0.001 + 0.001 * |value| (closest at a value of " in line


def test_check_parity_measures_and_rejects() -> None:
    wrapper = torch.nn.Identity()
    images = [torch.full((1, 2), 100.0), torch.full((3, 2), 100.0)]
    tolerance = Tolerance(rtol=1e-3, atol=1e-3)  # 0.101 allowed at 100
    parity = check_parity(wrapper, lambda x: [x.numpy() + 0.05], images, tolerance, Path("m.onnx"))
    assert parity.max_abs_diff == pytest.approx(0.05, abs=1e-5)
    assert parity.tolerance_share == pytest.approx(0.05 / 0.101, rel=1e-3) and parity.worst_value == 100.0
    with pytest.raises(ExportMismatchError, match=r"m\.onnx: outputs differ from PyTorch by up to 0\.2 at batch 1"):
        check_parity(wrapper, lambda x: [x.numpy() + 0.2], images, tolerance, Path("m.onnx"))
    with pytest.raises(ExportMismatchError, match="output shape"):
        check_parity(wrapper, lambda x: [x.numpy()[:, :1]], images, tolerance, Path("m.onnx"))


def test_only_rank_0_exports(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    weights = _copy(checkpoints, DETECT, tmp_path)
    assert export_checkpoint(_config(weights, "torchscript"), TASKS, DistContext(rank=1, world_size=2)) == []
    assert not (tmp_path / "best.torchscript").exists()


def test_flags_follow_yolov5_and_bad_ones_are_one_line() -> None:
    parser = build_export_parser()
    cfg = export_config_from_args(parser.parse_args(["--weights", "w.pt", "--include", "ONNX", "torchscript", "onnx"]))
    assert cfg.include == ("onnx", "torchscript") and cfg.imgsz is None and cfg.opset == 17
    assert export_config_from_args(parser.parse_args(["--weights", "w.pt", "--img", "320", "640"])).imgsz == (320, 640)
    assert export_config_from_args(parser.parse_args(["--weights", "w.pt", "--img", "100"])).imgsz == (128, 128)
    refusals = {
        ("--include", "tflite"): "--include tflite is not supported; choose from torchscript, onnx",
        ("--imgsz", "64", "64", "64"): "--imgsz 64 64 64: give one side or two",
        ("--batch-size", "0"): "--batch-size 0 must be at least 1",
        ("--opset", "99"): "--opset 99 must be within 11..20",
        ("--half", "--dynamic"): "--half and --dynamic cannot be combined",
    }
    for flags, message in refusals.items():
        with pytest.raises(ConfigError, match=f"^{message}"):
            export_config_from_args(parser.parse_args(["--weights", "w.pt", *flags]))


@pytest.mark.slow
def test_export_py_end_to_end(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """export.py's main(): both formats of a segmentation checkpoint, the task read from the file."""
    include = ["torchscript", "onnx"] if importlib.util.find_spec("onnx") else ["torchscript"]
    weights = _copy(checkpoints, SEGMENT, tmp_path)
    results = export.main(["--weights", str(weights), "--include", *include, "--imgsz", str(IMGSZ), "--dynamic"])
    assert [item.file_format for item in results] == include
    assert all(item.path.is_file() and read_metadata(item.path)["task"] == "segment" for item in results)


@pytest.mark.slow
def test_export_py_missing_onnx_prints_one_line_and_exits_2(
    checkpoints: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "onnx", None)
    argv = ["--weights", str(_copy(checkpoints, DETECT, tmp_path)), "--include", "onnx"]
    with pytest.raises(SystemExit) as exit_info:
        exit_on_user_error(lambda: export.main(argv))
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == "error: ONNX export needs the 'onnx' package: pip install onnx\n"


def test_a_yolov5_segmentation_file_exports_as_segmentation(tmp_path: Path) -> None:
    # The task comes from the loaded (here: converted) checkpoint, so a YOLOv5 -seg file is not taken for a detector.
    from tests import yolov5_fakes as v5

    weights = tmp_path / "yolov5n-seg.pt"
    v5.save_yolov5_checkpoint(v5.randomise(v5.SegmentationModel(0.33, 0.25, nc=2)), str(weights))
    (result,) = export_checkpoint(_config(weights, "torchscript"), TASKS, DistContext())
    assert read_metadata(result.path)["task"] == "segment"
