"""Export of anchor-free models: Ultralytics' output layout, end-to-end files with final detections, --nms."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from models.anchor_free import AnchorFreeSpec, build_model, segmentation_spec
from segment.task import SEGMENT
from tests.exports import DYNAMIC, Exports, cpu_formats, task_of
from utils.backends.metadata import read_metadata
from utils.boxes import best_detections, top_detections
from utils.checkpoint import RunInfo, build_checkpoint, save_checkpoint
from utils.data.synthetic import SHAPE_NAMES
from utils.distributed import DistContext
from utils.export import (
    ExportConfig,
    ExportWrapper,
    Tolerance,
    export_checkpoint,
    match_detection_rows,
)
from utils.inference_model import load_inference_model
from utils.tasks import DETECT

TASKS = {DETECT.name: DETECT, SEGMENT.name: SEGMENT}
NAMES = ["circle", "square", "triangle"]
IMGSZ = 64
POINTS = 8 * 8 + 4 * 4 + 2 * 2

pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.filterwarnings("ignore:`torch.jit.load` is deprecated:FutureWarning"),
]


def _checkpoint(folder: Path, layout: str, seg: bool = False) -> Path:
    """A tiny untrained anchor-free checkpoint saved as training saves one, as `folder/best.pt`."""
    is_26 = layout == "yolo26"
    spec = AnchorFreeSpec(layout, 0.33, 0.125, 256, len(NAMES), reg_max=1 if is_26 else 16, end_to_end=is_26)
    spec = segmentation_spec(spec) if seg else spec
    torch.manual_seed(0)
    model = build_model(spec)
    with torch.no_grad():  # distinct scores: an untrained head gives many equal ones, whose order is arbitrary
        for parameter in model.head.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.5)
    task = SEGMENT if seg else DETECT
    run = RunInfo(task.name, spec.to_dict(), NAMES, {}, {}, spec.family)
    state = build_checkpoint(run=run, model=model, ema=None, optimizer=None, scaler=None, epoch=0, best_fitness=0)
    save_checkpoint(state, folder / "best.pt", DistContext())
    return folder / "best.pt"


def _run(path: Path, images: torch.Tensor) -> list[np.ndarray]:
    if path.suffix == ".onnx":
        onnxruntime = pytest.importorskip("onnxruntime")
        session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        return session.run(None, {"images": images.numpy()})
    with torch.no_grad():
        outputs = torch.jit.load(str(path))(images)
    return [t.numpy() for t in (outputs if isinstance(outputs, tuple) else (outputs,))]


@pytest.mark.parametrize("name", ["yolov8n", "yolo11n-seg"])
def test_files_hold_ultralytics_layout_channels_first(exports: Exports, name: str) -> None:
    pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    seg = name.endswith("-seg")
    assert name in DYNAMIC  # the --dynamic export tests/test_export_matrix.py checks: written once per session
    done = exports.get(name, cpu_formats(), dynamic=True)
    results = [result for result in done.exported if result.file_format in ("torchscript", "onnx")]
    assert len(results) == 2
    images = torch.rand(2, 3, IMGSZ, 96)
    model, _ = load_inference_model(done.weights, task_of(name).name, torch.device("cpu"), channels_last=False)
    with torch.no_grad():
        decoded, extra = model(images)
    points = 8 * 12 + 4 * 6 + 2 * 3
    width = 4 + len(SHAPE_NAMES) + (32 if seg else 0)
    for result in results:
        assert result.max_abs_diff is not None and result.max_abs_diff < 1e-3
        outputs = _run(result.path, images)
        assert outputs[0].shape == (2, width, points)  # (B, 4 + nc [+ nm], N)
        np.testing.assert_allclose(outputs[0], decoded.transpose(1, 2).numpy(), rtol=1e-3, atol=1e-3)
        if seg:
            assert outputs[1].shape == (2, 32, IMGSZ // 4, 96 // 4)
        assert read_metadata(result.path)["end2end"] is False
        if result.path.suffix == ".onnx":  # the row width is stated, the point count is dynamic
            onnx = pytest.importorskip("onnx")
            (output0, *_) = onnx.load(str(result.path)).graph.output
            dims = [dim.dim_value or dim.dim_param for dim in output0.type.tensor_type.shape.dim]
            assert dims == ["batch", width, "anchors"]


def test_end_to_end_files_output_final_detections_and_nms_gives_the_rows(tmp_path: Path) -> None:
    pytest.importorskip("onnx")
    weights = _checkpoint(tmp_path, "yolo26")
    config = ExportConfig(weights=weights, include=("torchscript", "onnx"), imgsz=(IMGSZ, IMGSZ))
    images = torch.rand(1, 3, IMGSZ, IMGSZ)
    model, _ = load_inference_model(weights, (DETECT).name, torch.device("cpu"), channels_last=False)
    with torch.no_grad():
        decoded, _ = model(images)
    wanted = top_detections(decoded, conf_thres=0.0, max_det=300, multi_label=True)[0].numpy()
    for result in export_checkpoint(config, TASKS, DistContext()):
        (output,) = _run(result.path, images)
        assert output.shape == (1, 300, 6)  # [x1, y1, x2, y2, score, class], whatever the input's size
        assert (np.diff(output[0, :, 4]) <= 0).all()  # best first
        # 84 points x 3 classes = 252 pairs, then padding rows (zero box and score) up to 300.
        assert len(wanted) == POINTS * len(NAMES) < 300 and not output[0, len(wanted) :, :5].any()
        # Points whose scores are exactly equal come in any order: pair the rows before comparing.
        paired = match_detection_rows(wanted, output[0, : len(wanted)], Tolerance(rtol=1e-3, atol=1e-3))
        np.testing.assert_allclose(paired, wanted, rtol=1e-3, atol=1e-3)
        assert read_metadata(result.path)["end2end"] is True
    forced = ExportConfig(weights=weights, include=("torchscript",), imgsz=(IMGSZ, IMGSZ), nms=True)
    (result,) = export_checkpoint(forced, TASKS, DistContext())
    assert _run(result.path, images)[0].shape == (1, 4 + len(NAMES), POINTS)
    assert read_metadata(result.path)["end2end"] is False


def test_best_detections_equals_the_per_image_selection() -> None:
    torch.manual_seed(3)
    decoded = torch.cat((torch.rand(2, 50, 4) * 60 + 2, torch.rand(2, 50, 3), torch.randn(2, 50, 5)), dim=-1)
    rows = best_detections(decoded, 3, max_det=20)
    for image in range(2):
        wanted = top_detections(decoded[image : image + 1], 0.0, max_det=20, num_masks=5, multi_label=True)[0]
        torch.testing.assert_close(rows[image], wanted)


def test_end_to_end_wrapper_is_chosen_by_the_head() -> None:
    spec = AnchorFreeSpec("yolo26", 0.33, 0.125, 256, 3, reg_max=1, end_to_end=True)
    model = build_model(spec).eval()
    assert ExportWrapper(model).end_to_end
    model.head.use_one_to_one = False
    assert not ExportWrapper(model).end_to_end
