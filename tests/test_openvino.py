"""Tests for OpenVINO export and backend (FP32, INT8), and TensorRT's refusals and metadata without TensorRT."""

from __future__ import annotations

import dataclasses
import logging
import math
import shutil
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np
import pytest
import torch

import detect
import val
from segment import val as segment_val
from segment.task import SEGMENT
from tests.conftest import make_tiny_dataset
from tests.exports import DYNAMIC, Exports, cpu_formats, save_random_checkpoint
from tests.test_backends import _one_line, _request
from utils.backends import BackendRequest, load_backend
from utils.backends.metadata import read_metadata, write_engine_file
from utils.data.synthetic import SHAPE_NAMES, SyntheticSpec
from utils.distributed import DistContext
from utils.errors import ConfigError
from utils.export import (
    ExportConfig,
    ExportWrapper,
    _parity_reference,
    build_export_parser,
    check_export_dependencies,
    export_checkpoint,
    export_config_from_args,
)
from utils.export.quantization import Agreement, _matched, head_output_convs
from utils.families import build_model, spec_from_cfg
from utils.tasks import DETECT

pytest.importorskip("openvino")

TASKS = {DETECT.name: DETECT, SEGMENT.name: SEGMENT}
IMGSZ = 64
MODELS = {"yolov5n": DETECT, "yolov8n": DETECT, "yolov8n-seg": SEGMENT}
TINY = SyntheticSpec(num_train=4, num_val=6, max_objects=3, min_object_frac=0.2, min_side=64, max_side=160)
BOX_ATOL_PX = 2e-3  # as tests/test_backends.py: OpenVINO reorders sums like onnxruntime (boxes move ~1e-4 px at 64 px)
METRIC_ATOL = 0.002
CPU = torch.device("cpu")

pytestmark = [pytest.mark.usefixtures("one_torch_thread")]


class _Folders(Mapping[str, dict[str, Path]]):
    """Per model, on first use: best.pt and the dynamic FP32 best_openvino_model/ of its --dynamic export.

    The export of every CPU format that tests/test_export_matrix.py checks and tests/test_backends.py runs
    (tests/exports.py): made once per session, and only for the models a test (or xdist worker) reads.
    """

    def __init__(self, exports: Exports) -> None:
        self._exports = exports

    def __getitem__(self, name: str) -> dict[str, Path]:
        assert name in MODELS and name in DYNAMIC, name
        found = self._exports.get(name, cpu_formats(), dynamic=True).files
        return {kind: found[kind] for kind in ("pt", "openvino")}

    def __iter__(self) -> Iterator[str]:
        return iter(MODELS)

    def __len__(self) -> int:
        return len(MODELS)


@pytest.fixture(scope="module")
def folders(exports: Exports) -> Mapping[str, dict[str, Path]]:
    return _Folders(exports)


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_dataset(tmp_path_factory.mktemp("openvino-data"), TINY)


@pytest.mark.slow  # OpenVINO conversions: out of the fast loop
@pytest.mark.parametrize("name", MODELS)
def test_an_openvino_folder_holds_the_ir_and_the_metadata_the_backend_reports(
    folders: dict[str, dict[str, Path]], name: str
) -> None:
    folder = folders[name]["openvino"]
    assert folder.name == "best_openvino_model" and {path.name for path in folder.iterdir()} == {
        "best.xml", "best.bin", "metadata.yaml"
    }  # fmt: skip
    metadata = read_metadata(folder)
    assert metadata["names"] == dict(enumerate(SHAPE_NAMES)) and metadata["imgsz"] == [IMGSZ, IMGSZ]
    assert metadata["dynamic"] and not metadata["half"] and metadata["precision"] == "fp32"
    task = MODELS[name].name
    checkpoint = load_backend(folders[name]["pt"], _request(task)).info
    info = load_backend(folder, _request(task)).info
    assert info == dataclasses.replace(checkpoint, path=folder, file_format="openvino", layout=metadata["layout"])
    assert load_backend(folder / "best.xml", _request(task)).info == info  # its .xml stands for it, as in YOLOv5
    assert read_metadata(folder / "best.xml") == metadata


@pytest.mark.slow  # OpenVINO conversions: out of the fast loop
def test_a_broken_openvino_folder_is_refused_in_one_line_that_says_why(
    folders: dict[str, dict[str, Path]], tmp_path: Path
) -> None:
    truncated_yaml, truncated_bin = (Path(shutil.copytree(folders["yolov8n"]["openvino"], tmp_path / name))
                                     for name in ("yaml", "bin"))  # fmt: skip
    (truncated_yaml / "metadata.yaml").write_text("stride: 32\nnames: {0: a\n")  # cut off mid-write
    with pytest.raises(ConfigError) as error:
        load_backend(truncated_yaml, _request("detect"))
    assert str(error.value).startswith(f"{truncated_yaml / 'metadata.yaml'}: not valid YAML") and "\n" not in str(
        error.value
    )
    data = (truncated_bin / "best.bin").read_bytes()
    (truncated_bin / "best.bin").write_bytes(data[:1000])
    with pytest.raises(ConfigError) as error:
        load_backend(truncated_bin, _request("detect"))
    # OpenVINO's message leads with C++ source locations; the line keeps its reason.
    assert str(error.value) == f"{truncated_bin}: OpenVINO cannot read it (Incorrect weights in bin file!)"


@pytest.mark.slow  # OpenVINO conversions: out of the fast loop
@pytest.mark.parametrize("name", MODELS)
def test_openvino_returns_the_checkpoints_detections(folders: dict[str, dict[str, Path]], name: str) -> None:
    task = MODELS[name]
    images = torch.rand(2, 3, IMGSZ, 96, generator=torch.Generator().manual_seed(1))  # not the traced size or batch
    selected = {}
    for kind, path in folders[name].items():
        backend = load_backend(path, _request(task.name))
        with torch.no_grad():
            rows, extra = backend(images)
        selected[kind] = backend.selector()(rows, 0.001, 0.6, max_det=300, num_masks=backend.info.num_masks,
                                            multi_label=True)  # fmt: skip
        if task.with_masks:
            assert extra[1].shape == (2, backend.info.num_masks, IMGSZ // 4, 96 // 4)
    for want, got in zip(selected["pt"], selected["openvino"], strict=True):
        assert len(want) == len(got) > 0
        np.testing.assert_allclose(got.numpy(), want.numpy(), atol=BOX_ATOL_PX, rtol=1e-3)


def _val(script: object, weights: Path, data: Path, project: Path, *extra: str) -> object:
    argv = ["--weights", str(weights), "--data", str(data), "--batch-size", "4", "--workers", "0",
            "--device", "cpu", "--project", str(project), *extra]  # fmt: skip
    return script.main(argv)


@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
def test_val_scores_an_openvino_folder_as_its_checkpoint(
    folders: dict[str, dict[str, Path]], tiny_data: Path, tmp_path: Path, name: str
) -> None:
    script = segment_val if MODELS[name].with_masks else val
    want, got = (_val(script, folders[name][kind], tiny_data, tmp_path / kind) for kind in ("pt", "openvino"))
    assert want.num_images == got.num_images == TINY.num_val
    for key, value in want.as_dict().items():
        assert got.as_dict()[key] == pytest.approx(value, abs=METRIC_ATOL), key


@pytest.mark.slow
def test_detect_writes_an_openvino_folders_detections_as_its_checkpoints(
    folders: dict[str, dict[str, Path]], tiny_data: Path, tmp_path: Path
) -> None:
    source = tiny_data.parent / "shapes" / "images" / "val"
    labels = {}
    for kind, path in folders["yolov8n"].items():
        argv = ["--weights", str(path), "--source", str(source), "--device", "cpu", "--conf-thres", "0.001",
                "--max-det", "40", "--save-txt", "--save-conf", "--nosave",
                "--project", str(tmp_path / kind)]  # fmt: skip
        folder = detect.main(argv).save_dir / "labels"
        labels[kind] = {path.name: np.loadtxt(path, ndmin=2) for path in sorted(folder.glob("*.txt"))}
    assert labels["pt"].keys() == labels["openvino"].keys() and len(labels["pt"]) == TINY.num_val
    for image, rows in labels["pt"].items():
        got = labels["openvino"][image]
        order_want, order_got = np.argsort(-rows[:, -1], kind="stable"), np.argsort(-got[:, -1], kind="stable")
        np.testing.assert_allclose(got[order_got], rows[order_want], atol=1e-4, err_msg=image)


@pytest.mark.slow
def test_int8_export_calibrates_on_train_images_keeps_attention_in_float_and_val_runs_it(
    tiny_data: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pytest.importorskip("nncf")
    import openvino as ov

    weights = save_random_checkpoint("yolo11n", DETECT, tmp_path / "best.pt")
    cfg = ExportConfig(weights, ("openvino",), int8=True, data=tiny_data, calib_images=3)
    with caplog.at_level(logging.INFO):
        (exported,) = export_checkpoint(cfg, TASKS, DistContext())
    assert exported.path == tmp_path / "best_int8_openvino_model" and exported.agreement is not None
    # The agreement line never reports a check that compared nothing as a pass.
    warned = [r.message for r in caplog.records if r.levelno == logging.WARNING and "could not be checked" in r.message]
    (agreement_line,) = [r.message for r in caplog.records if "INT8 finds" in r.message or "not measured" in r.message]
    measured = not math.isnan(exported.agreement)  # NaN: PyTorch found nothing to compare with
    assert ("not measured" in agreement_line) == (not measured) == bool(warned)
    metadata = read_metadata(exported.path)
    assert metadata["precision"] == "int8" and not metadata["dynamic"] and metadata["batch"] == 1
    # Quantized, not a copy of the FP32 graph; yolo11n's C2PSA attention multiplies activations by activations
    # (q.k, weights.v): those MatMuls stay FP32.
    ops = ov.Core().read_model(str(exported.path / "best.xml")).get_ordered_ops()
    convs = [op for op in ops if op.get_type_name() == "Convolution"]
    assert any(op.input_value(0).get_node().get_type_name() == "FakeQuantize" for op in convs)  # the rest is INT8
    matmuls = [op for op in ops if op.get_type_name() == "MatMul" and "attention" in op.get_friendly_name()]
    assert len(matmuls) >= 2
    for op in matmuls:
        inputs = [op.input_value(i).get_node().get_type_name() for i in range(op.get_input_size())]
        assert "FakeQuantize" not in inputs, op.get_friendly_name()
    result = _val(val, exported.path, tiny_data, tmp_path / "val")
    assert result.num_images == TINY.num_val and 0.0 <= result.as_dict()["mAP50-95"] <= 1.0


def test_an_fp16_file_is_checked_against_the_weights_it_stores() -> None:
    # FP16 OpenVINO stores weights rounded to FP16 and computes in FP32: the parity reference has the same weights.
    wrapper = ExportWrapper(build_model(spec_from_cfg("yolov8n", len(SHAPE_NAMES))).eval())
    with torch.no_grad():
        next(wrapper.parameters()).add_(1e-4)  # a value FP16 cannot hold exactly
    half = ExportConfig(Path("best.pt"), ("openvino",), half=True)
    reference = _parity_reference(wrapper, "openvino", half)
    for ours, rounded in zip(wrapper.state_dict().values(), reference.state_dict().values(), strict=True):
        if ours.is_floating_point():
            assert torch.equal(rounded, ours.half().float())
    assert not torch.equal(next(reference.parameters()), next(wrapper.parameters()))  # the graph itself is left as is
    assert _parity_reference(wrapper, "openvino", dataclasses.replace(half, half=False)) is wrapper
    assert _parity_reference(wrapper, "onnx", half) is wrapper  # a CUDA FP16 file is checked against the FP16 graph


@pytest.mark.slow  # OpenVINO conversions: out of the fast loop
def test_half_writes_fp16_weights_on_cpu_that_take_fp32_input(
    folders: dict[str, dict[str, Path]], tmp_path: Path
) -> None:
    weights = Path(shutil.copy(folders["yolov8n"]["pt"], tmp_path / "best.pt"))
    (exported,) = export_checkpoint(ExportConfig(weights, ("openvino",), half=True), TASKS, DistContext())
    assert exported.tolerance_share is not None and exported.tolerance_share <= 1.0  # FP16 tolerance, checked
    fp32_bin = folders["yolov8n"]["openvino"] / "best.bin"
    assert (exported.path / "best.bin").stat().st_size < 0.6 * fp32_bin.stat().st_size
    info = load_backend(exported.path, _request()).info
    assert info.precision == "fp16" and info.dtype == torch.float32 and info.fixed_shape


def test_int8_keeps_the_heads_output_convolutions_in_float() -> None:
    v5 = build_model(spec_from_cfg("yolov5n", 6))
    seg = build_model(spec_from_cfg("yolov8n-seg", 6))
    assert head_output_convs(v5) == ["convs.0", "convs.1", "convs.2"]
    names = head_output_convs(seg)
    assert {name.rsplit(".", 2)[0] for name in names} == {"box_branches", "class_branches", "mask_branches"}
    assert len(names) == 9 and all(name.endswith(".2") for name in names)


def test_agreement_counts_pytorchs_detections_found_with_their_class() -> None:
    want = torch.tensor([[0, 0, 10, 10, 0.9, 1], [20, 20, 30, 30, 0.8, 2], [40, 40, 50, 50, 0.7, 0]])
    got = torch.tensor([[0, 0, 10, 11, 0.88, 1], [20, 20, 30, 30, 0.8, 3], [41, 40, 50, 50, 0.6, 0]])
    assert _matched(want, got) == 2  # the second has another class
    assert _matched(want, got[:1].repeat(3, 1)) == 1  # one file detection matches one PyTorch detection
    assert Agreement(0, 0, 5).recall == 1.0 and Agreement(3, 4, 4).recall == 0.75
    assert not Agreement(0, 0, 5).measured and Agreement(0, 1, 0).measured  # nothing to compare is not a pass


def _flags(*argv: str) -> ExportConfig:
    return export_config_from_args(build_export_parser().parse_args(["--weights", "best.pt", *argv]))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--include", "openvino", "--int8"], "--int8 needs --data, a dataset YAML whose train images calibrate"),
        (["--include", "onnx", "--int8", "--data", "d.yaml"], "--int8 applies to --include openvino / engine"),
        (["--include", "openvino", "--int8", "--half", "--data", "d.yaml"], "--half and --int8 cannot be combined"),
        (["--include", "openvino", "--int8", "--data", "d.yaml", "--calib-images", "0"], "--calib-images 0 must be"),
        (["--include", "openvino", "--int8", "--data", "d.yaml", "--imgsz", "64", "96"], "give one --imgsz side"),
        (["--include", "engine", "--dynamic"], "--dynamic is not supported for engine"),
        (["--include", "openvino", "tflite"], "--include tflite is not supported"),
    ],
)
def test_export_flags_are_refused_in_one_line(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _flags(*argv)


def test_int8_takes_two_sides_that_round_to_a_square() -> None:
    assert _flags("--include", "openvino", "--int8", "--data", "d.yaml", "--imgsz", "60", "64").imgsz == (64, 64)


def test_missing_runtimes_and_devices_are_one_line_before_any_work(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu, cuda = DistContext(), DistContext(device=torch.device("cuda", 0))  # no CUDA is touched by the checks
    check_export_dependencies(_flags("--include", "openvino", "--half"), cpu)  # FP16 IR needs no GPU
    with pytest.raises(ConfigError, match=r"^--half needs a CUDA device \(e.g. --device 0\), except for"):
        check_export_dependencies(_flags("--include", "openvino", "onnx", "--half"), cpu)
    with pytest.raises(ConfigError, match=r"^--include engine needs a CUDA device \(e.g. --device 0\)"):
        check_export_dependencies(_flags("--include", "engine"), cpu)
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # `import tensorrt` now raises ImportError
    with pytest.raises(ConfigError) as error:
        check_export_dependencies(_flags("--include", "engine", "--half"), cuda)
    assert _one_line(error) == "TensorRT export needs the 'tensorrt' package: pip install tensorrt (CUDA only)"
    monkeypatch.setitem(sys.modules, "nncf", None)
    with pytest.raises(ConfigError, match="^--int8 OpenVINO export needs the 'nncf' package: pip install nncf$"):
        check_export_dependencies(_flags("--include", "openvino", "--int8", "--data", "d.yaml"), cpu)
    monkeypatch.setitem(sys.modules, "openvino", None)
    with pytest.raises(ConfigError, match="^OpenVINO export needs the 'openvino' package: pip install openvino$"):
        check_export_dependencies(_flags("--include", "openvino"), cpu)


def test_openvino_mismatches_are_refused_in_one_line_naming_the_folder(
    folders: dict[str, dict[str, Path]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seg = folders["yolov8n-seg"]["openvino"]
    with pytest.raises(ConfigError) as error:
        load_backend(seg, _request("detect"))
    assert _one_line(error) == f"{seg} is a segment export, not a detect one; use segment/val.py"
    det = folders["yolov8n"]["openvino"]
    with pytest.raises(ConfigError) as error:
        load_backend(det, _request(half=True))
    assert _one_line(error) == f"{det} takes FP32 input (fp32 inside, fixed at export); run it without --half"
    foreign = Path(shutil.copytree(det, tmp_path / "foreign_openvino_model"))
    (foreign / "metadata.yaml").unlink()
    with pytest.raises(ConfigError, match="foreign_openvino_model: no metadata from this project's export.py"):
        load_backend(foreign, _request())
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="empty is a folder without an OpenVINO model"):
        load_backend(tmp_path / "empty", _request())
    monkeypatch.setitem(sys.modules, "openvino", None)
    with pytest.raises(ConfigError) as error:
        load_backend(det, _request())
    assert _one_line(error) == f"{det}: running OpenVINO models needs openvino: pip install openvino"


def test_an_engine_files_metadata_reads_back_and_its_refusals_need_no_tensorrt(
    folders: dict[str, dict[str, Path]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    metadata = read_metadata(folders["yolov8n"]["openvino"])
    engine = tmp_path / "best.engine"
    write_engine_file(engine, {**metadata, "dynamic": False}, b"\x00plan bytes")
    assert read_metadata(engine) == {**metadata, "dynamic": False}
    with pytest.raises(ConfigError) as error:
        load_backend(engine, BackendRequest("segment", "predict", CPU))
    assert _one_line(error) == f"{engine} is a detect export, not a segment one; use detect.py"
    with pytest.raises(ConfigError) as error:
        load_backend(engine, _request())
    assert _one_line(error) == f"{engine}: a TensorRT engine runs on CUDA only; use --device 0"
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    with pytest.raises(ConfigError) as error:
        load_backend(engine, BackendRequest("detect", "val", torch.device("cuda", 0)))
    assert _one_line(error) == f"{engine}: running TensorRT engines needs tensorrt: pip install tensorrt"
    bare = tmp_path / "bare.engine"
    bare.write_bytes(b"\xff\xff\xff\x7fnot our header")
    with pytest.raises(ConfigError, match="bare.engine: no metadata from this project's export.py"):
        load_backend(bare, _request())
