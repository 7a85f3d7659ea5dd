"""Tests for utils/backends: val, detect, segment and torch.hub run an exported file as they run its checkpoint."""

from __future__ import annotations

import dataclasses
import logging
import shutil
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch
from torch import nn

import detect
import hubconf
import val
from segment import predict as segment_predict
from segment import val as segment_val
from segment.task import SEGMENT
from tests.conftest import make_tiny_dataset
from tests.exports import DYNAMIC, Exports, cpu_formats
from tests.exports import save_random_checkpoint as _save_random_checkpoint
from utils.backends import AugmentedBackend, BackendRequest, leave_cores_to_runtime, load_backend, resolve_imgsz
from utils.backends.exported import rows_from_detections, run_in_chunks
from utils.backends.metadata import read_metadata
from utils.boxes import best_detections, top_detections
from utils.data.synthetic import SHAPE_NAMES, SyntheticSpec
from utils.distributed import DistContext
from utils.errors import ConfigError
from utils.eval.checkpoint_val import val_imgsz
from utils.export import ExportConfig, export_checkpoint
from utils.predict.config import PredictConfig
from utils.predict.predictor import FramePredictor
from utils.tasks import DETECT

TASKS = {DETECT.name: DETECT, SEGMENT.name: SEGMENT}
IMGSZ = 64
# Three detection families (YOLOv5 rows, anchor-free channels first, YOLO26's end-to-end detections) and one -seg.
MODELS = {"yolov5n": DETECT, "yolov8n": DETECT, "yolo26n": DETECT, "yolov8n-seg": SEGMENT}
TINY = SyntheticSpec(num_train=1, num_val=6, max_objects=3, min_object_frac=0.2, min_side=64, max_side=160)
BOX_ATOL_PX = 2e-3  # ONNX and TorchScript reorder sums: boxes move by ~1e-4 px at 64 px (export allows 1e-3 + 1e-3 x)
METRIC_ATOL = 0.002
CPU = torch.device("cpu")
ROOT = Path(__file__).resolve().parents[1]

pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.filterwarnings("ignore:`torch.jit.load` is deprecated:FutureWarning"),  # TorchScript is under test
]


class _Files(Mapping[str, dict[str, Path]]):
    """Per model, on first use: best.pt, and best.torchscript and best.onnx of one --dynamic export of it.

    yolov5n, yolov8n and yolov8n-seg are the exports tests/test_export_matrix.py checks and tests/test_openvino.py
    runs (all CPU formats, tests/exports.py): made once per session. Lazy: a test (or xdist worker) that reads one
    model's files exports that model only.
    """

    def __init__(self, exports: Exports) -> None:
        self._exports = exports

    def __getitem__(self, name: str) -> dict[str, Path]:
        formats = cpu_formats() if name in DYNAMIC else ("torchscript", "onnx")
        found = self._exports.get(name, formats, dynamic=True).files
        return {kind: found[kind] for kind in ("pt", "torchscript", "onnx")}

    def __iter__(self) -> Iterator[str]:
        return iter(MODELS)

    def __len__(self) -> int:
        return len(MODELS)


@pytest.fixture(scope="module")
def files(exports: Exports) -> Mapping[str, dict[str, Path]]:
    pytest.importorskip("onnxruntime")
    return _Files(exports)


@pytest.fixture(scope="module")
def static_yolov5n_onnx(exports: Exports) -> dict[str, Path]:
    """yolov5n's best.pt and a static (batch 1, 64 px) best.onnx: three anchors per grid point, one shape."""
    pytest.importorskip("onnxruntime")
    return exports.get("yolov5n", ("onnx",)).files


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_dataset(tmp_path_factory.mktemp("backends-data"), TINY)


def _request(task: str | None = "detect", **options: object) -> BackendRequest:
    return BackendRequest(task=task, script="val", device=CPU, **options)


@pytest.mark.parametrize("name", MODELS)
def test_metadata_read_back_is_what_export_wrote_and_what_the_backend_reports(
    files: dict[str, dict[str, Path]], name: str
) -> None:
    task = MODELS[name]
    checkpoint = load_backend(files[name]["pt"], _request(task.name)).info
    layout = {"yolov5n": "rows", "yolov8n": "channels_first", "yolo26n": "end2end"}.get(name, "channels_first")
    for file_format in ("torchscript", "onnx"):  # one --dynamic export (a static one: tests/test_export.py)
        path = files[name][file_format]
        metadata = read_metadata(path)
        assert {key: metadata[key] for key in ("task", "imgsz", "batch", "dynamic", "half", "family", "layout")} == {
            "task": task.name, "imgsz": [IMGSZ, IMGSZ], "batch": 1, "dynamic": True, "half": False,
            "family": checkpoint.family, "layout": layout,
        }  # fmt: skip
        assert metadata["names"] == dict(enumerate(SHAPE_NAMES)) and metadata["num_masks"] == checkpoint.num_masks
        info = load_backend(path, _request(task.name)).info
        # The file says what the checkpoint says; only its storage differs (and a TorchScript trace takes any batch).
        same = dataclasses.replace(checkpoint, path=path, file_format=file_format, layout=layout)
        assert info == same and info.batch is None and not info.fixed_shape


@pytest.mark.parametrize("name", MODELS)
def test_backends_return_the_checkpoints_rows(files: dict[str, dict[str, Path]], name: str) -> None:
    # Rows in the eval layout, then the family's selector: the same selected detections from every file.
    task = MODELS[name]
    images = torch.rand(2, 3, IMGSZ, 96, generator=torch.Generator().manual_seed(1))  # not the traced size or batch
    backends = {kind: load_backend(path, _request(task.name)) for kind, path in files[name].items()}
    selected = {}
    for kind, backend in backends.items():
        with torch.no_grad():
            rows, extra = backend(images)
        selected[kind] = backend.selector()(rows, 0.001, 0.6, max_det=300, num_masks=backend.info.num_masks,
                                            multi_label=True)  # fmt: skip
        if task.with_masks:
            assert extra[1].shape == (2, backend.info.num_masks, IMGSZ // 4, 96 // 4)
    for kind in ("torchscript", "onnx"):
        for want, got in zip(selected["pt"], selected[kind], strict=True):
            assert len(want) == len(got) > 0, kind
            np.testing.assert_allclose(got.numpy(), want.numpy(), atol=BOX_ATOL_PX, rtol=1e-3, err_msg=kind)


def _val(script: object, weights: Path, data: Path, project: Path, *extra: str) -> object:
    argv = ["--weights", str(weights), "--data", str(data), "--batch-size", "4", "--workers", "0",
            "--device", "cpu", "--project", str(project), "--save-txt", *extra]  # fmt: skip
    return script.main(argv)


def _predictions_by_image(result: object) -> dict[str, np.ndarray]:
    """Each image's detections (original pixels), best score first."""
    order = {item.path: np.argsort(-item.detections[:, 4], kind="stable") for item in result.predictions}
    return {item.path: item.detections[order[item.path]] for item in result.predictions}


@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
def test_val_scores_an_exported_file_as_its_checkpoint(
    files: dict[str, dict[str, Path]], tiny_data: Path, tmp_path: Path, name: str
) -> None:
    script = segment_val if MODELS[name].with_masks else val
    results = {kind: _val(script, path, tiny_data, tmp_path / kind) for kind, path in files[name].items()}
    want = results["pt"]
    for kind in ("torchscript", "onnx"):
        got = results[kind]
        for key, value in want.as_dict().items():
            assert got.as_dict()[key] == pytest.approx(value, abs=METRIC_ATOL), (kind, key)
        expected, found = _predictions_by_image(want), _predictions_by_image(got)
        assert expected.keys() == found.keys() and sum(map(len, expected.values())) > 0
        for path, rows in expected.items():
            assert found[path].shape == rows.shape, (kind, path)
            np.testing.assert_allclose(found[path], rows, atol=BOX_ATOL_PX * 4, rtol=1e-3, err_msg=kind)


def _read_labels(folder: Path) -> dict[str, np.ndarray]:
    """detect.py's --save-txt --save-conf files: per image, rows (class, ..., conf) best score first."""
    found = {}
    for path in sorted(folder.glob("*.txt")):
        rows = [[float(v) for v in line.split()] for line in path.read_text().splitlines()]
        found[path.name] = sorted(rows, key=lambda row: -row[-1])
    return found


@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
def test_detect_writes_an_exported_files_detections_as_its_checkpoints(
    files: dict[str, dict[str, Path]], tiny_data: Path, tmp_path: Path, name: str
) -> None:
    script = segment_predict if MODELS[name].with_masks else detect
    source = tiny_data.parent / "shapes" / "images" / "val"
    # --max-det 40: an end-to-end file keeps its 300 best (point, class) scores, which hold the 40 best points'
    # best classes whatever the scores (39 points x 6 classes < 300), so single-label selection is exact.
    labels = {}
    for kind, path in files[name].items():
        argv = ["--weights", str(path), "--source", str(source), "--device", "cpu", "--conf-thres", "0.001",
                "--max-det", "40", "--save-txt", "--save-conf", "--nosave",
                "--project", str(tmp_path / kind)]  # fmt: skip
        result = script.main(argv)
        labels[kind] = _read_labels(result.save_dir / "labels")
    assert len(labels["pt"]) == TINY.num_val and sum(map(len, labels["pt"].values())) > 0
    for kind in ("torchscript", "onnx"):
        assert labels[kind].keys() == labels["pt"].keys()
        for image, rows in labels["pt"].items():
            got = labels[kind][image]
            assert len(got) == len(rows), (kind, image)
            # Class and score of every detection; its box (or for masks the outline's first point) too.
            want_head = np.array([[row[0], row[1], row[2], row[-1]] for row in rows])
            got_head = np.array([[row[0], row[1], row[2], row[-1]] for row in got])
            atol = 2e-2 if MODELS[name].with_masks else 1e-4  # outlines trace mask pixels; boxes are 6-decimal text
            np.testing.assert_allclose(got_head, want_head, atol=atol, err_msg=f"{kind} {image}")


def test_hub_custom_loads_an_onnx_file_and_detects_as_the_checkpoint(
    files: dict[str, dict[str, Path]], tmp_path: Path
) -> None:
    image = np.random.default_rng(0).integers(0, 255, (80, 112, 3), dtype=np.uint8)
    results = {}
    for kind in ("pt", "onnx"):
        model = hubconf.custom(path=str(files["yolov8n"][kind]), device="cpu")
        model.conf = 0.001
        assert model.size == IMGSZ and model.names == SHAPE_NAMES
        (results[kind],) = model(image)
    assert len(results["onnx"]) == len(results["pt"]) > 0
    np.testing.assert_allclose(results["onnx"].boxes, results["pt"].boxes, atol=BOX_ATOL_PX * 2)
    np.testing.assert_allclose(results["onnx"].scores, results["pt"].scores, atol=1e-4)
    assert (results["onnx"].classes == results["pt"].classes).all()


def _one_line(error: pytest.ExceptionInfo[ConfigError]) -> str:
    message = str(error.value)
    assert "\n" not in message
    return message


def test_mismatches_are_refused_in_one_line_naming_the_file(files: dict[str, dict[str, Path]], tmp_path: Path) -> None:
    seg_onnx, det_onnx, e2e_torchscript = (
        files["yolov8n-seg"]["onnx"],
        files["yolov8n"]["onnx"],
        files["yolo26n"]["torchscript"],
    )
    with pytest.raises(ConfigError) as error:
        load_backend(seg_onnx, _request("detect"))
    assert _one_line(error) == f"{seg_onnx} is a segment export, not a detect one; use segment/val.py"
    with pytest.raises(ConfigError) as error:
        load_backend(det_onnx, BackendRequest("segment", "predict", CPU))
    assert _one_line(error) == f"{det_onnx} is a detect export, not a segment one; use detect.py"
    with pytest.raises(ConfigError, match="exported in FP32; for --half export it with export.py --half") as error:
        load_backend(det_onnx, _request(half=True))
    with pytest.raises(ConfigError, match="final detections; for --nms export it with --nms") as error:
        load_backend(e2e_torchscript, _request(nms=True))
    assert str(e2e_torchscript) in _one_line(error)
    with pytest.raises(ConfigError, match="missing.onnx: file not found"):
        load_backend(tmp_path / "missing.onnx", _request())


def test_malformed_metadata_is_refused_in_one_line_and_any_suffix_case_reads(
    files: dict[str, dict[str, Path]], tmp_path: Path
) -> None:
    import onnx

    source = files["yolov8n"]["onnx"]
    upper = Path(shutil.copy(source, tmp_path / "BEST.ONNX"))  # val.py and detect.py take it: so does read_metadata
    assert read_metadata(upper) == read_metadata(source)
    for key, value, shown in (("imgsz", "64", "64"), ("stride", "'32'", "'32'"), ("dynamic", "'yes'", "'yes'")):
        graph = onnx.load(str(source))
        for prop in graph.metadata_props:
            if prop.key == key:
                prop.value = value
        broken = tmp_path / f"bad-{key}.onnx"
        onnx.save(graph, str(broken))
        with pytest.raises(ConfigError) as error:
            load_backend(broken, _request())
        assert _one_line(error).startswith(f"{broken}: its metadata's {key} is {shown}, not ")


def test_metadata_that_does_not_fit_the_graphs_outputs_is_refused_in_one_line(
    files: dict[str, dict[str, Path]], tmp_path: Path
) -> None:
    import onnx

    images = torch.zeros(1, 3, IMGSZ, IMGSZ)
    five_names = str({index: name for index, name in enumerate(SHAPE_NAMES[:5])})
    cases = (  # model, key, value, what the error says
        ("yolov8n", "names", five_names, "has 10 values per row, its metadata says 9 (box + 5 classes + 0 mask"),
        ("yolov5n", "names", five_names, "has 11 values per row, its metadata says 10 (box + objectness + 5 classes"),
        ("yolov8n-seg", "num_masks", "16", "has 42 values per row, its metadata says 26 (box + 6 classes + 16 mask"),
        ("yolo26n", "num_masks", "2", "has 6 values per row, its metadata says 8 (box, score, class + 2 mask"),
    )
    for name, key, value, says in cases:
        graph = onnx.load(str(files[name]["onnx"]))
        for prop in graph.metadata_props:
            if prop.key == key:
                prop.value = value
        edited = tmp_path / f"{name}-{key}.onnx"
        onnx.save(graph, str(edited))
        task = "segment" if key == "num_masks" and name.endswith("-seg") else "detect"
        backend = load_backend(edited, _request(task))
        with pytest.raises(ConfigError) as error:
            backend(images)
        message = _one_line(error)
        assert message.startswith(f"{edited}: output0 (1, ") and says in message, message
    for name in MODELS:  # the files as exported pass the check
        load_backend(files[name]["onnx"], _request(MODELS[name].name))(images)


def test_files_without_our_metadata_are_refused(tmp_path: Path) -> None:
    pytest.importorskip("onnx")
    conv = nn.Conv2d(3, 8, 3).eval()
    images = torch.zeros(1, 3, 32, 32)
    with torch.no_grad():
        torch.onnx.export(conv, (images,), str(tmp_path / "foreign.onnx"), dynamo=False)
        torch.jit.trace(conv, images).save(str(tmp_path / "foreign.torchscript"))
    for name in ("foreign.onnx", "foreign.torchscript"):
        with pytest.raises(ConfigError) as error:
            load_backend(tmp_path / name, _request())
        assert _one_line(error) == (
            f"{tmp_path / name}: no metadata from this project's export.py; export the .pt with export.py"
        )
    (tmp_path / "text.torchscript").write_text("not a model")
    with pytest.raises(ConfigError, match="text.torchscript: not a TorchScript file torch can load"):
        load_backend(tmp_path / "text.torchscript", _request())


def test_a_static_onnx_file_runs_only_its_size_and_any_batch(files: dict[str, dict[str, Path]], tmp_path: Path) -> None:
    weights = Path(shutil.copy(files["yolov8n"]["pt"], tmp_path / "best.pt"))
    (exported,) = export_checkpoint(ExportConfig(weights, ("onnx",), batch_size=2), TASKS, DistContext())
    backend = load_backend(exported.path, _request())
    assert backend.info.fixed_shape and backend.info.batch == 2 and backend.info.imgsz == (IMGSZ, IMGSZ)
    with pytest.raises(ConfigError) as error:
        resolve_imgsz(backend.info, (96, 96))
    assert _one_line(error) == (
        f"{exported.path}: exported at a fixed 64x64, cannot run --imgsz 96x96; omit --imgsz, "
        "or export again with --imgsz 96 96 or --dynamic"
    )
    with pytest.raises(ConfigError, match="fixed 64x64, cannot run --imgsz 96x96"):
        val_imgsz(backend.info, 96)
    assert val_imgsz(backend.info, None) == val_imgsz(backend.info, IMGSZ) == IMGSZ
    # Three images through a batch-2 file: a full chunk, then one padded with a blank image.
    images = torch.rand(3, 3, IMGSZ, IMGSZ, generator=torch.Generator().manual_seed(2))
    checkpoint = load_backend(weights, _request())
    with torch.no_grad():
        want, got = checkpoint(images)[0], backend(images)[0]
    np.testing.assert_allclose(got.numpy(), want.numpy(), atol=1e-3, rtol=1e-3)
    # detect.py letterboxes a wide picture to the file's whole square, not to a 32 x 64 rectangle.
    cfg = PredictConfig(weights=exported.path, source="", imgsz=(IMGSZ, IMGSZ), conf_thres=0.01)
    wide = np.random.default_rng(0).integers(0, 255, (40, 100, 3), dtype=np.uint8)
    assert FramePredictor(backend, DETECT, cfg)(wide)[1] == (IMGSZ, IMGSZ)
    assert FramePredictor(checkpoint, DETECT, cfg)(wide)[1] == (32, IMGSZ)


def test_a_fixed_batch_runs_in_padded_chunks_for_tensors_and_arrays() -> None:
    for items, concat, blank in (
        (torch.arange(5.0).view(5, 1), torch.cat, lambda shape, like: like.new_zeros(shape)),
        (np.arange(5.0).reshape(5, 1), np.concatenate, lambda shape, like: np.zeros(shape, like.dtype)),
    ):
        seen = []

        def run(chunk, seen=seen):  # a two-output file that sees only batches of 2
            seen.append([float(value) for value in chunk[:, 0]])
            return [chunk * 10, chunk + 1]

        doubled, shifted = run_in_chunks(run, items, 2, concat, blank)
        assert seen == [[0.0, 1.0], [2.0, 3.0], [4.0, 0.0]], "the last chunk padded with a blank row"
        assert [float(v) for v in doubled[:, 0]] == [0, 10, 20, 30, 40] and len(shifted) == 5
        assert run_in_chunks(run, items, None, concat, blank)[0].shape == (5, 1)  # any batch: one call


def test_torch_steps_back_to_one_thread_only_beside_a_runtime_with_its_own(files: dict[str, dict[str, Path]]) -> None:
    onnx, torchscript, checkpoint = (
        load_backend(files["yolov8n"][kind], _request()) for kind in ("onnx", "torchscript", "pt")
    )
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        for runs_in_torch in (checkpoint, torchscript):  # torch does the inference: it keeps its threads
            leave_cores_to_runtime(runs_in_torch)
            assert torch.get_num_threads() == 2
        leave_cores_to_runtime(AugmentedBackend(checkpoint))
        assert torch.get_num_threads() == 2
        leave_cores_to_runtime(AugmentedBackend(onnx))  # --augment's passes run in the runtime too
        assert torch.get_num_threads() == 1
        torch.set_num_threads(2)
        leave_cores_to_runtime(onnx)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(previous)


@pytest.mark.slow
def test_val_refuses_another_size_for_a_static_file_in_one_line(
    static_yolov5n_onnx: dict[str, Path], tiny_data: Path, tmp_path: Path
) -> None:
    exported = static_yolov5n_onnx["onnx"]
    argv = ["--weights", str(exported), "--data", str(tiny_data), "--workers", "0", "--device", "cpu"]
    result = val.main([*argv, "--project", str(tmp_path / "runs")])  # no --imgsz: the file's 64, square batches
    assert result.num_images == TINY.num_val
    done = subprocess.run(
        [sys.executable, "val.py", *argv, "--imgsz", "96"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"error: {exported}: exported at a fixed 64x64, cannot run --imgsz 96x96; omit --imgsz, "
        "or export again with --imgsz 96 96 or --dynamic"
    ]


@pytest.mark.parametrize("num_masks", [0, 3])
def test_end_to_end_detections_become_rows_the_top_score_selector_reads_as_the_checkpoints(num_masks: int) -> None:
    generator = torch.Generator().manual_seed(num_masks)
    num_classes, num_points = 6, 500
    decoded = torch.cat(
        (
            torch.rand(2, num_points, 2, generator=generator) * 64,  # centres
            torch.rand(2, num_points, 2, generator=generator) * 20 + 1,  # sizes
            torch.rand(2, num_points, num_classes, generator=generator),
            torch.randn(2, num_points, num_masks, generator=generator),
        ),
        2,
    )
    rows = rows_from_detections(best_detections(decoded, num_classes, 300), num_classes, num_masks)
    assert rows.shape[0] == 2 and rows.shape[2] == 4 + num_classes + num_masks
    for options in ({"multi_label": True, "max_det": 300}, {"multi_label": False, "max_det": 50}):
        want = top_detections(decoded, 0.001, num_masks=num_masks, **options)
        got = top_detections(rows, 0.001, num_masks=num_masks, **options)
        for expected, found in zip(want, got, strict=True):
            assert len(found) == len(expected) == options["max_det"]
            np.testing.assert_allclose(found.numpy(), expected.numpy(), atol=1e-4)


def test_two_end_to_end_points_with_one_box_stay_two_detections_with_their_own_scores() -> None:
    # An fp16 file rounds near boxes together: two points of one box and class (0.9, 0.4), and of another class
    # (0.7, 0.2), are two rows with their own scores, not one row holding whichever score was written last.
    box = [10.0, 10.0, 30.0, 40.0]
    detections = torch.tensor([[[*box, 0.9, 0], [*box, 0.7, 1], [*box, 0.4, 0], [*box, 0.2, 1], [0, 0, 5, 5, 0.1, 2]]])
    rows = rows_from_detections(detections, 3, 0)[0]
    scores = sorted(rows[:, 4:].tolist(), reverse=True)
    np.testing.assert_allclose(scores, [[0.9, 0.7, 0.0], [0.4, 0.2, 0.0], [0.0, 0.0, 0.1]])
    assert rows[:, :4].tolist().count([20.0, 25.0, 20.0, 30.0]) == 2
    assert rows_from_detections(detections[:, :0], 3, 0).shape == (1, 0, 7)


def test_augment_runs_a_fixed_shape_file_as_its_checkpoint(
    files: Mapping[str, dict[str, Path]], static_yolov5n_onnx: dict[str, Path]
) -> None:
    weights = static_yolov5n_onnx["pt"]  # three anchors per grid point
    static = load_backend(static_yolov5n_onnx["onnx"], _request(augment=True))
    checkpoint = load_backend(weights, _request(augment=True))
    assert static.info.fixed_shape and not checkpoint.info.fixed_shape
    images = torch.rand(2, 3, IMGSZ, IMGSZ, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want, got = checkpoint(images)[0], static(images)[0]
    # At 64 px both pad the shrunk passes back to 64 (the stride's multiple): the same inputs, the same rows.
    # Grid points per pass: 8x8 + 4x4 (no 2x2 level at full size), 8x8 + 4x4 + 2x2, 4x4 + 2x2 (no 8x8 at 0.67x).
    assert want.shape[1] == 3 * ((64 + 16) + (64 + 16 + 4) + (16 + 4))
    np.testing.assert_allclose(got.numpy(), want.numpy(), atol=1e-3, rtol=1e-3)
    with pytest.raises(ConfigError, match="--augment is for detection models"):
        load_backend(files["yolov8n-seg"]["pt"], _request("segment", augment=True))


@pytest.mark.slow
def test_val_and_detect_take_augment(files: dict[str, dict[str, Path]], tiny_data: Path, tmp_path: Path) -> None:
    weights = files["yolov8n"]["onnx"]
    plain, augmented = (_val(val, weights, tiny_data, tmp_path / kind, *extra) for kind, extra in
                        (("plain", ()), ("augmented", ("--augment",))))  # fmt: skip
    want, got = _predictions_by_image(plain), _predictions_by_image(augmented)
    assert want.keys() == got.keys() and all(len(rows) for rows in got.values())
    assert any(got[path].shape != rows.shape or not np.allclose(got[path], rows) for path, rows in want.items())
    source = tiny_data.parent / "shapes" / "images" / "val"
    argv = ["--weights", str(weights), "--source", str(source), "--device", "cpu", "--conf-thres", "0.001",
            "--save-txt", "--nosave", "--augment", "--project", str(tmp_path / "detect")]  # fmt: skip
    assert len(_read_labels(detect.main(argv).save_dir / "labels")) == TINY.num_val


@pytest.mark.slow
def test_val_single_cls_scores_a_multi_class_model_as_one_class(
    files: dict[str, dict[str, Path]], tiny_data: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO):
        result = _val(val, files["yolov8n"]["pt"], tiny_data, tmp_path, "--single-cls")
    assert "; class-agnostic single-label (--single-cls) NMS at --conf-thres 0.001" in caplog.text
    assert result.metrics.class_ids.tolist() == [0]
    assert all((item.detections[:, 5] == 0).all() for item in result.predictions)  # the one class, id 0
    assert sum(len(item.detections) for item in result.predictions) > 0


def test_a_class_count_mismatch_says_what_would_fit() -> None:
    from utils.eval.checkpoint_val import check_class_count
    from utils.eval.config import ValConfig

    cfg = ValConfig(weights=Path("w.pt"), data=Path("d.yaml"))
    with pytest.raises(ConfigError, match=r"^w.pt was trained on 1 class but d.yaml has 6 classes; add --single-cls"):
        check_class_count(cfg, 1, 6)
    with pytest.raises(ConfigError, match=r"^w.pt was trained on 6 classes but d.yaml has 2 classes$"):
        check_class_count(cfg, 6, 2)
    for trained, in_yaml in ((1, 6), (6, 6), (6, 2)):  # --single-cls scores any model as one class
        check_class_count(dataclasses.replace(cfg, single_cls=True), trained, in_yaml)


@pytest.mark.slow
def test_val_save_txt_writes_label_files_and_save_conf_adds_the_score(
    files: dict[str, dict[str, Path]], tiny_data: Path, tmp_path: Path
) -> None:
    from utils.data.labels import verify_image_label

    rows = {}
    for name, extra in (("plain", ()), ("conf", ("--save-conf",))):
        result = _val(val, files["yolov8n"]["pt"], tiny_data, tmp_path / name, "--conf-thres", "0.002", *extra)
        written = sorted((tmp_path / name / "exp" / "labels").glob("*.txt"))
        assert len(written) == TINY.num_val
        rows[name] = [line.split() for path in written for line in path.read_text().splitlines()]
    assert rows["plain"] and {len(row) for row in rows["plain"]} == {5}
    assert [row[:5] for row in rows["conf"]] == rows["plain"] and {len(row) for row in rows["conf"]} == {6}
    scores = sorted(detection[4] for item in result.predictions for detection in item.detections)
    assert sorted(float(row[5]) for row in rows["conf"]) == pytest.approx(scores, abs=1e-5)
    # Without scores the files are labels the dataset scanner reads (boxes clipped to the image may repeat).
    image = result.predictions[0].path
    record = verify_image_label(image, str(tmp_path / "plain" / "exp" / "labels" / f"{Path(image).stem}.txt"))
    assert record.status == "found" and len(record.labels) > 0 and "column" not in record.message


def test_other_class_names_in_the_yaml_are_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    from utils.eval.checkpoint_val import warn_on_other_names
    from utils.eval.config import ValConfig

    cfg = ValConfig(weights=Path("w.pt"), data=Path("d.yaml"))
    with caplog.at_level("WARNING"):
        warn_on_other_names(cfg, ("cat", "dog", "cow"), ("cat", "dog", "cow"))
        warn_on_other_names(cfg, (), ("cat", "dog"))  # nothing recorded to compare
        assert not caplog.records
        warn_on_other_names(cfg, ("cat", "dog", "cow"), ("cat", "car", "bus"))
    assert caplog.messages == [
        "w.pt was trained on other class names than d.yaml lists (2 of 3 differ, first class 1: 'dog' vs 'car'); "
        "is --data the dataset it was trained on?"
    ]


def test_without_data_val_scores_the_dataset_the_checkpoint_was_trained_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from utils.config import DEFAULT_DATA
    from utils.eval.checkpoint_val import default_data

    recorded = tmp_path / "mine.yaml"
    info = dataclasses.replace(load_backend(_save_random_checkpoint("yolov8n", DETECT, tmp_path / "a.pt"),
                                            _request()).info, trained_data=recorded)  # fmt: skip
    ctx = DistContext()
    with caplog.at_level("INFO"):
        assert default_data(tmp_path / "given.yaml", info, ctx) == tmp_path / "given.yaml"
        with pytest.raises(ConfigError, match=f"^{info.path} was trained on {recorded}, which is not there; give"):
            default_data(None, info, ctx)  # recorded, but not there any more: not another dataset silently
        recorded.write_text("")
        assert default_data(None, info, ctx) == recorded
        assert default_data(None, dataclasses.replace(info, trained_data=None), ctx) == DEFAULT_DATA
    assert caplog.messages == [
        f"No --data: scoring {info.path} on {recorded}, the dataset it was trained on",
        f"No --data: scoring {info.path} on {DEFAULT_DATA}, the built-in dataset",
    ]


def test_a_checkpoint_backend_reports_the_dataset_it_was_trained_on(tmp_path: Path) -> None:
    weights = _save_random_checkpoint("yolov5n", DETECT, tmp_path / "a.pt")  # records no dataset
    assert load_backend(weights, _request()).info.trained_data is None
    checkpoint = torch.load(weights, weights_only=False)
    checkpoint["train_config"]["data"] = str(tmp_path / "d.yaml")
    torch.save(checkpoint, weights)
    assert load_backend(weights, _request()).info.trained_data == tmp_path / "d.yaml"


@pytest.mark.slow
def test_val_scores_a_file_exported_at_a_non_square_size_on_that_canvas(
    files: dict[str, dict[str, Path]], tiny_data: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from utils.data.augment import letterbox
    from utils.data.cache import resized_hw
    from utils.data.data_config import load_data_config
    from utils.data.dataset import DatasetOptions, LoadImagesAndLabels
    from utils.data.loader import build_val_loader
    from utils.eval.evaluate import EvalOptions

    weights = Path(shutil.copy(files["yolov8n"]["pt"], tmp_path / "best.pt"))
    (static,) = export_checkpoint(ExportConfig(weights, ("onnx",), imgsz=(64, 96)), TASKS, DistContext())
    with caplog.at_level(logging.INFO):
        got = _val(val, static.path, tiny_data, tmp_path / "onnx")
    assert "ms NMS at batch 4 per rank, size 64x96" in caplog.text  # the size that ran, not its long side
    # The checkpoint on the same canvas (every image letterboxed to 64x96): what the file must have computed.
    ctx = DistContext()
    options = DatasetOptions.for_evaluation(
        img_size=96, batch_size=4, stride=32, num_classes=len(SHAPE_NAMES), workers=0
    )
    options = dataclasses.replace(options, rect=False, pad=0.0, canvas_hw=(64, 96))
    dataset = LoadImagesAndLabels(load_data_config(tiny_data, ctx).split("val"), options, ctx)
    for item in (dataset[i] for i in range(len(dataset))):  # resized once to fit the canvas, then padded
        original = cv2.imread(item["path"])
        height, width = resized_hw(*original.shape[:2], (64, 96))
        once = cv2.resize(original, (width, height), interpolation=cv2.INTER_AREA)
        assert height < original.shape[0] and height <= 64 and width <= 96
        np.testing.assert_array_equal(item["image"].numpy(), letterbox(once, (64, 96))[0][..., ::-1])
    eval_options = EvalOptions(num_classes=len(SHAPE_NAMES), collect_predictions=True)
    want = DETECT.evaluate(load_backend(weights, _request()), build_val_loader(dataset, 4, 0, ctx), eval_options, ctx)
    for key, value in want.as_dict().items():
        assert got.as_dict()[key] == pytest.approx(value, abs=METRIC_ATOL), key
    expected, found = _predictions_by_image(want), _predictions_by_image(got)
    assert expected.keys() == found.keys() and sum(map(len, expected.values())) > 0
    for path, rows in expected.items():
        np.testing.assert_allclose(found[path], rows, atol=BOX_ATOL_PX * 4, rtol=1e-3)


def test_nms_on_a_model_without_an_nms_free_head_is_warned_about(
    files: dict[str, dict[str, Path]], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("WARNING", logger="utils.inference_model"):
        load_backend(files["yolo26n"]["pt"], _request(nms=True))  # end-to-end: --nms turns its head
        assert not caplog.records
        load_backend(files["yolov8n"]["pt"], _request(nms=True))
    assert caplog.messages == [
        "--nms changes nothing here: only end-to-end models (yolo26) have an NMS-free head to turn off"
    ]


def test_agnostic_nms_on_an_nms_free_head_is_warned_about(
    files: dict[str, dict[str, Path]], caplog: pytest.LogCaptureFixture
) -> None:
    from utils.predict.config import PredictConfig
    from utils.predict.predictor import load_predictor_model

    for name, nms in (("yolov8n", False), ("yolo26n", True), ("yolo26n", False)):  # warned about the last only
        cfg = PredictConfig(weights=files[name]["pt"], source="", agnostic_nms=True, nms=nms)
        with caplog.at_level("WARNING", logger="utils.predict.predictor"):
            load_predictor_model(cfg, DETECT, DistContext())
    assert caplog.messages == [
        f"--agnostic-nms changes nothing here: {files['yolo26n']['pt']} selects with its NMS-free head, which "
        "suppresses nothing (--nms for its other head and NMS)"
    ]
