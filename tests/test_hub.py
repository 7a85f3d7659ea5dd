"""torch.hub.load from this checkout (hubconf.py) and in-memory inference: the detections detect.py writes, as data."""

from __future__ import annotations

import logging
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch
from PIL import Image

import detect
from segment import predict as segment_predict
from segment.task import SEGMENT
from tests import yolov5_fakes as v5
from tests.test_predict import untrained_checkpoint, write_image
from utils.data.synthetic import SHAPE_NAMES
from utils.errors import ConfigError
from utils.tasks import DETECT

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _hub(name: str, **kwargs: object):  # noqa: ANN202
    return torch.hub.load(str(ROOT), name, source="local", **kwargs)


@pytest.fixture(scope="module")
def detector_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return untrained_checkpoint(tmp_path_factory.mktemp("hub") / "det.pt", DETECT, "yolov5n")


def test_every_input_kind_gives_the_same_detections_in_original_pixels(detector_file: Path, tmp_path: Path) -> None:
    model = _hub("custom", path=str(detector_file), device="cpu")
    model.size = 64
    path = write_image(tmp_path / "a.jpg", seed=3, hw=(96, 128))
    rgb = cv2.imread(str(path))[..., ::-1]
    from_path, from_array, from_pil = model([str(path), rgb, Image.open(path)])
    assert len(from_path) > 0 and from_path.shape == (96, 128)
    for other in (from_array, from_pil):
        np.testing.assert_array_equal(other.boxes, from_path.boxes)
        np.testing.assert_array_equal(other.classes, from_path.classes)
    assert from_path.boxes.dtype == np.float32 and (from_path.boxes[:, 2] <= 128).all()
    assert from_path.names == tuple(SHAPE_NAMES)
    [single] = model(path)  # one input, still a list of results
    np.testing.assert_array_equal(single.scores, from_path.scores)
    model.conf = 1.0  # settings are attributes, as on YOLOv5's hub models
    assert len(model(path)[0]) == 0


def test_hub_model_predicts_at_the_size_the_checkpoint_was_trained_at(detector_file: Path, tmp_path: Path) -> None:
    trained_224 = untrained_checkpoint(tmp_path / "w224.pt", DETECT, "yolov5n", train_imgsz=224)
    model = _hub("custom", path=str(trained_224), device="cpu")
    assert model.size == 224 and _hub("custom", path=str(detector_file), device="cpu").size == 640  # none recorded
    path = str(write_image(tmp_path / "a.jpg", seed=3, hw=(96, 128)))
    [default], [at_224], [at_640] = model(path), model(path, size=224), model(path, size=640)
    np.testing.assert_array_equal(default.boxes, at_224.boxes)
    assert not np.array_equal(default.boxes, at_640.boxes)  # the size matters: 640 gives other detections
    [at_100], [at_128] = model(path, size=100), model(path, size=128)  # rounded up to a multiple of 32
    np.testing.assert_array_equal(at_100.boxes, at_128.boxes)


def test_results_as_plain_data_and_coco_rows(detector_file: Path, tmp_path: Path) -> None:
    model = _hub("custom", path=str(detector_file), device="cpu")
    [result] = model(str(write_image(tmp_path / "7.jpg", seed=1)), size=64)
    rows = result.to_dicts()
    assert rows and set(rows[0]) == {"box", "score", "class", "name"}
    assert all(isinstance(value, float) for value in rows[0]["box"]) and rows[0]["name"] in SHAPE_NAMES
    coco = result.coco_rows(image_id=7, category_ids=[10, 20, 30, 40, 50, 60][: len(SHAPE_NAMES)])
    assert len(coco) == len(result)
    x1, y1, x2, y2 = result.boxes[0]
    assert coco[0]["image_id"] == 7 and coco[0]["category_id"] == 10 * (int(result.classes[0]) + 1)
    assert coco[0]["bbox"] == pytest.approx([x1, y1, x2 - x1, y2 - y1], abs=1e-3)


@pytest.mark.slow  # runs detect.py's entry point
@pytest.mark.parametrize("task", [DETECT, SEGMENT], ids=lambda task: task.name)
def test_hub_model_returns_what_detect_py_writes(task, tmp_path: Path) -> None:
    weights = untrained_checkpoint(tmp_path / f"{task.name}.pt", task, "yolov5n-seg" if task is SEGMENT else "yolov5n")
    images = [write_image(tmp_path / "images" / f"img{i}.jpg", seed=i, hw=(96, 128)) for i in range(2)]
    entry = segment_predict if task is SEGMENT else detect
    result = entry.run(weights=weights, source=tmp_path / "images", imgsz=64, device="cpu", save_txt=True,
                       save_conf=True, project=tmp_path / "runs")  # fmt: skip
    model = _hub("custom", path=str(weights), device="cpu")
    for image, found in zip(images, model([str(path) for path in images], size=64), strict=True):
        written = (result.save_dir / "labels" / f"{image.stem}.txt").read_text().splitlines()
        assert written and found.txt_lines(save_conf=True) == written
        assert (found.masks is not None) == (task is SEGMENT)
        if found.masks is not None:
            assert found.masks.shape == (len(found), 96, 128) and found.masks.dtype == bool


@pytest.mark.slow  # runs detect.py's entry point
def test_hub_augment_returns_what_detect_py_augment_writes(detector_file: Path, tmp_path: Path) -> None:
    image = write_image(tmp_path / "images" / "img.jpg", seed=4, hw=(96, 128))
    result = detect.run(weights=detector_file, source=image, imgsz=64, device="cpu", save_txt=True, save_conf=True,
                        augment=True, project=tmp_path / "runs")  # fmt: skip
    written = (result.save_dir / "labels" / "img.txt").read_text().splitlines()
    model = _hub("custom", path=str(detector_file), device="cpu")
    [augmented], [plain] = model(image, size=64, augment=True), model(image, size=64)
    assert written and augmented.txt_lines(save_conf=True) == written != plain.txt_lines(save_conf=True)
    segmenter = _hub(
        "custom", path=str(untrained_checkpoint(tmp_path / "seg.pt", SEGMENT, "yolov5n-seg")), device="cpu"
    )
    with pytest.raises(ConfigError, match="--augment is for detection models"):
        segmenter(image, size=64, augment=True)


def test_converted_yolov5_checkpoints_and_scratch_sizes_load_the_same_way(tmp_path: Path) -> None:
    path = tmp_path / "yolov5n.pt"
    v5.save_yolov5_checkpoint(v5.randomise(v5.DetectionModel(0.33, 0.25, nc=3)), str(path))
    model = _hub("custom", path=str(path), device="cpu")
    assert model.names == ("class0", "class1", "class2")
    image = np.random.default_rng(0).integers(0, 255, (70, 90, 3), dtype=np.uint8)
    assert model(image, size=64)[0].shape == (70, 90)
    scratch = _hub("yolo11n_seg", classes=2, device="cpu")
    assert scratch.task is SEGMENT and len(scratch.names) == 2
    with pytest.raises(ConfigError, match="yolo11n: no weights are downloaded"):
        _hub("yolo11n", pretrained=True)


def test_a_p6_hub_model_rounds_sizes_to_multiples_of_64(caplog: pytest.LogCaptureFixture) -> None:
    model = _hub("yolov5n6", classes=2, device="cpu")
    image = np.random.default_rng(0).integers(0, 255, (70, 90, 3), dtype=np.uint8)
    with caplog.at_level(logging.WARNING):
        assert model(image, size=96)[0].shape == (70, 90)
    assert any("size 96 96: sides must be multiples of 64" in record.getMessage() for record in caplog.records)


def test_bad_inputs_are_one_line_errors(detector_file: Path, tmp_path: Path) -> None:
    model = _hub("custom", path=str(detector_file), device="cpu")
    with pytest.raises(ConfigError, match=r"image 0: expected an \(H, W, 3\) uint8 RGB array, got \(4, 4\)"):
        model(np.zeros((4, 4), np.uint8))
    with pytest.raises(ConfigError, match="missing.jpg"):
        model(str(tmp_path / "missing.jpg"))
    with pytest.raises(ConfigError, match="nothing.pt: file not found"):
        _hub("custom", path=str(tmp_path / "nothing.pt"))


def test_a_pil_image_is_turned_upright_by_its_exif_orientation_as_its_path_is(tmp_path: Path) -> None:
    from utils.predict.hub import _as_bgr

    stored = np.zeros((8, 16, 3), np.uint8)  # 8 high, 16 wide as stored; orientation 6: shown rotated 90° clockwise
    stored[:, :4] = (255, 0, 0)  # a red band down the stored left edge ends up along the top
    path = tmp_path / "phone.jpg"
    exif = Image.Exif()
    exif[0x0112] = 6
    Image.fromarray(stored).save(path, exif=exif, quality=100)
    _, from_path = _as_bgr(str(path), 0)
    _, from_pil = _as_bgr(Image.open(path), 1)
    assert from_path.shape == from_pil.shape == (16, 8, 3)
    assert np.abs(from_path.astype(int) - from_pil.astype(int)).max() <= 2  # the same decoder, same rotation
    assert from_pil[:3, :, 2].mean() > 200 and from_pil[-3:, :, 2].mean() < 50  # BGR: red on top, none at the bottom


def test_a_file_exported_at_a_non_square_size_runs_at_it_as_detect_py_does(detector_file: Path, tmp_path: Path) -> None:
    pytest.importorskip("onnxruntime")
    from utils.distributed import DistContext
    from utils.export import ExportConfig, export_checkpoint
    from utils.predict.config import PredictConfig
    from utils.predict.predictor import FramePredictor

    weights = tmp_path / "det.pt"
    weights.write_bytes(detector_file.read_bytes())
    tasks = {DETECT.name: DETECT, SEGMENT.name: SEGMENT}
    (static,) = export_checkpoint(ExportConfig(weights, ("onnx",), imgsz=(64, 96)), tasks, DistContext())
    model = _hub("custom", path=str(static.path), device="cpu")
    path = write_image(tmp_path / "a.jpg", seed=3, hw=(96, 128))
    [found] = model(str(path))  # no size given: the file's own 64x96, not a 96x96 it cannot run
    cfg = PredictConfig(weights=static.path, source="", imgsz=(64, 96), conf_thres=0.25)
    prediction, input_hw, _ = FramePredictor(model.model, DETECT, cfg)(cv2.imread(str(path)))
    assert input_hw == (64, 96) and len(found) > 0
    np.testing.assert_array_equal(found.boxes, prediction.boxes_xyxy)
    with pytest.raises(ConfigError, match="exported at a fixed 64x96, cannot run --imgsz 96x96"):
        model(str(path), size=96)
    assert len(model(str(path), size=(64, 96))) == 1
    for bad in (-32, 0, (64,), 1.5, "64"):
        with pytest.raises(ConfigError, match=r"give a side in pixels, or an \(h, w\) pair of them"):
            model(str(path), size=bad)
    with pytest.raises(ConfigError, match="exported at a fixed 64x96, cannot run --imgsz 64x128"):
        model(str(path), size=(np.int64(60), 100))  # rounded up to multiples of 32, as YOLOv5's hub does
    model.size = 96  # set, even to the file's long side: the attribute asks for 96x96, as size=96 does
    with pytest.raises(ConfigError, match="exported at a fixed 64x96, cannot run --imgsz 96x96"):
        model(str(path))


def test_a_16_bit_pil_image_gives_the_detections_of_its_path_and_one_class_id_filters(
    detector_file: Path, tmp_path: Path
) -> None:
    model = _hub("custom", path=str(detector_file), device="cpu")
    model.size, model.conf = 64, 0.01
    grey = np.random.default_rng(3).integers(0, 65536, (96, 128), dtype=np.uint16)
    path = tmp_path / "deep.png"
    assert cv2.imwrite(str(path), grey)
    from_path, from_pil = model([str(path), Image.open(path)])  # PIL opens it as 16-bit grey (mode I or I;16)
    assert len(from_path) > 0
    np.testing.assert_array_equal(from_pil.boxes, from_path.boxes)
    model.classes = int(from_path.classes[0])  # one id, as YOLOv5's hub models take it
    [only] = model(str(path))
    assert len(only) > 0 and set(only.classes.tolist()) == {int(from_path.classes[0])}
    model.classes = [7]
    with pytest.raises(ConfigError, match=r"classes \[7\]: the model has 6 \(0-5\)"):
        model(str(path))
