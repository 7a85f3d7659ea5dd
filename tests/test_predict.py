"""Prediction on new inputs (utils/predict, detect.py, segment/predict.py): sources, outputs, filters, sharding."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch

import detect
from segment import predict as segment_predict
from segment.task import SEGMENT
from tests.dist_helpers import run_distributed
from utils.checkpoint import RunInfo, build_checkpoint, save_checkpoint
from utils.data.masks import polygons_to_mask
from utils.data.synthetic import SHAPE_NAMES
from utils.distributed import DistContext
from utils.errors import ConfigError
from utils.families import build_model as build_family_model
from utils.predict.config import PredictConfig, SaveOptions, build_predict_parser, predict_config_from_args
from utils.predict.outputs import annotated_suffix, mask_polygon, txt_lines
from utils.predict.prediction import Prediction, counted
from utils.predict.predictor import FramePredictor, PredictResult, describe, load_predictor_model, predict
from utils.predict.sources import InputItem, UnreadableInputError, VideoReader, discover_inputs, shard_inputs
from utils.tasks import DETECT, Task

IMGSZ = (64, 64)
VIDEO_FRAMES = 5
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def untrained_checkpoint(path: Path, task: Task, cfg: str, train_imgsz: int | None = None) -> Path:
    """Save an untrained `cfg` model that finds small boxes everywhere: objectness biased to 0.88, classes
    to 0.5 (scores ~0.44 > 0.25, the class being whichever logit the random weights raise). A
    segmentation model's prototypes and coefficients are biased positive, so each mask fills its box.
    `train_imgsz` is recorded as the training size (train_config imgsz); None records none."""
    torch.manual_seed(0)
    spec = task.spec_from_cfg(cfg, len(SHAPE_NAMES))
    model = build_family_model(spec)
    with torch.no_grad():
        for conv in model.head.convs:
            bias = conv.bias.view(model.head.num_anchors, model.head.num_outputs)
            bias[:, 2:4] = -2.0  # boxes at ~6% of their anchor: no far-negative corners (see the --classes test)
            bias[:, 4] = 2.0
            bias[:, 5 : 5 + len(SHAPE_NAMES)] = 0.0
            bias[:, 5 + len(SHAPE_NAMES) :] = 3.0
        if hasattr(model.head, "proto"):
            model.head.proto.project.bn.bias.fill_(5.0)
    train_config = {} if train_imgsz is None else {"imgsz": train_imgsz}
    run = RunInfo(task=task.name, model_spec=spec.to_dict(), names=list(SHAPE_NAMES), train_config=train_config, hyp={})
    checkpoint = build_checkpoint(run=run, model=model, ema=None, optimizer=None, scaler=None, epoch=0, best_fitness=0)
    save_checkpoint(checkpoint, path, DistContext())
    return path


def write_image(path: Path, seed: int, hw: tuple[int, int] = (96, 128)) -> Path:
    """A noisy image with a few filled shapes, so the random model's class logits vary."""
    rng = np.random.default_rng(seed)
    image = rng.integers(0, 255, (*hw, 3), dtype=np.uint8)
    for _ in range(3):
        centre = (int(rng.integers(10, hw[1] - 10)), int(rng.integers(10, hw[0] - 10)))
        colour = tuple(int(c) for c in rng.integers(0, 255, 3))
        cv2.circle(image, centre, int(rng.integers(5, 25)), colour, -1)
    path.parent.mkdir(parents=True, exist_ok=True)
    assert cv2.imwrite(str(path), image)
    return path


def write_video(path: Path, frames: int = VIDEO_FRAMES, fps: float = 10.0) -> Path:
    """A tiny mp4v video (80x64) with a moving disc."""
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), fps, (80, 64))
    for index in range(frames):
        frame = np.full((64, 80, 3), 30 * index, np.uint8)
        cv2.circle(frame, (20 + 8 * index, 32), 12, (0, 0, 255), -1)
        writer.write(frame)
    writer.release()
    return path


def video_frames(path: Path) -> tuple[int, float]:
    """(frames, fps) of a written video, counted by reading it."""
    capture = cv2.VideoCapture(str(path))
    fps, frames = capture.get(cv2.CAP_PROP_FPS), 0
    while capture.read()[0]:
        frames += 1
    capture.release()
    return frames, fps


def make_inputs(folder: Path, images: int = 3, corrupt: bool = True, video: bool = True) -> Path:
    """A folder of `images` images, optionally a corrupt .jpg and a video, plus a file predict must ignore."""
    for index in range(images):
        write_image(folder / f"img{index}.jpg", seed=index)
    if corrupt:
        (folder / "broken.jpg").write_bytes(b"\xff\xd8 this is not a jpeg")
    if video:
        write_video(folder / "clip.mp4")
    (folder / "notes.json").write_text("{}")
    return folder


def config(weights: Path, source: Path | str, project: Path, **changes: object) -> PredictConfig:
    cfg = PredictConfig(weights=weights, source=str(source), imgsz=IMGSZ, device="cpu", project=project)
    return replace(cfg, **changes)


def read_labels(path: Path) -> list[list[float]]:
    return [[float(v) for v in line.split()] for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def det_weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return untrained_checkpoint(tmp_path_factory.mktemp("weights") / "det.pt", DETECT, "yolov5n")


@pytest.fixture(scope="module")
def seg_weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return untrained_checkpoint(tmp_path_factory.mktemp("weights") / "seg.pt", SEGMENT, "yolov5n-seg")


# ---- sources ----------------------------------------------------------------------------------------


def test_discover_folder_glob_list_file_and_webcam(tmp_path: Path) -> None:
    folder = make_inputs(tmp_path / "in")
    write_image(folder / "nested" / "deep.jpg", seed=9)  # folders are not searched recursively (YOLOv5)
    found = discover_inputs(str(folder))
    assert [Path(i.path).name for i in found] == ["broken.jpg", "clip.mp4", "img0.jpg", "img1.jpg", "img2.jpg"]
    assert [i.kind for i in found] == ["image", "video", "image", "image", "image"]
    assert [i.index for i in found] == list(range(5))
    assert [Path(i.path).name for i in discover_inputs(str(folder / "img*.jpg"))] == [
        "img0.jpg",
        "img1.jpg",
        "img2.jpg",
    ]
    assert len(discover_inputs(str(folder / "**" / "*.jpg"))) == 5  # ** is recursive
    (folder / "gone.jpg").symlink_to(folder / "nowhere.jpg")  # kept, to be skipped and counted when read
    assert "gone.jpg" in [Path(i.path).name for i in discover_inputs(str(folder))]
    assert "gone.jpg" in [Path(i.path).name for i in discover_inputs(str(folder / "*.jpg"))]
    (folder / "gone.jpg").unlink()
    listing = tmp_path / "list.txt"
    listing.write_text("in/img1.jpg\n\nin/clip.mp4\nin/missing.jpg\n")
    listed = discover_inputs(str(listing))  # entries are kept as given; the missing one is skipped later, counted
    expected = [("img1.jpg", "image"), ("clip.mp4", "video"), ("missing.jpg", "image")]
    assert [(Path(i.path).name, i.kind) for i in listed] == expected
    assert Path(listed[0].path) == folder / "img1.jpg"  # relative to the list's folder
    # As YOLOv5, a line may name a folder or a glob; a list saved with a byte-order mark keeps its first line,
    # and a name that is not UTF-8 names its file.
    odd = os.fsdecode(os.fsencode(folder) + b"/caf\xe9.jpg")
    shutil.copy(folder / "img0.jpg", odd)
    listing.write_bytes(b"\xef\xbb\xbfin/img2.jpg\r\nin\r\nin/img1*.jpg\r\nin/caf\xe9.jpg\r\n")
    names = [Path(i.path).name for i in discover_inputs(str(listing))]
    assert names == ["img2.jpg", "broken.jpg", os.fsdecode(b"caf\xe9.jpg"), "clip.mp4", "img0.jpg", "img1.jpg",
                     "img2.jpg", "img1.jpg", os.fsdecode(b"caf\xe9.jpg")]  # fmt: skip
    os.unlink(odd)
    assert [(i.path, i.kind, i.stem) for i in discover_inputs("0")] == [("0", "webcam", "webcam0")]
    assert discover_inputs(str(folder / "img0.jpg"))[0].kind == "image"


def test_a_listed_file_whose_name_holds_glob_characters_is_that_file(tmp_path: Path) -> None:
    for name, seed in (("shot[1].jpg", 1), ("shot?.jpg", 2), ("shot1.jpg", 3)):
        write_image(tmp_path / name, seed=seed)
    listing = tmp_path / "list.txt"
    listing.write_text("shot[1].jpg\nshot?.jpg\nshot*.png\n")  # the last is a pattern: no file has that name
    assert [Path(i.path).name for i in discover_inputs(str(listing))] == ["shot[1].jpg", "shot?.jpg"]


def test_a_list_line_missing_beside_the_list_is_read_from_the_current_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A list written for YOLOv5, which reads its lines from the current directory.
    for name, seed in (("shots/a.jpg", 1), ("shots/b.jpg", 2), ("lists/c.jpg", 3), ("c.jpg", 4)):
        write_image(tmp_path / name, seed=seed)
    listing = tmp_path / "lists" / "list.txt"
    listing.write_text("shots/a.jpg\nshots/b*.jpg\nc.jpg\nshots/gone.jpg\n")
    monkeypatch.chdir(tmp_path)
    paths = [Path(i.path).resolve() for i in discover_inputs(str(listing))]
    # c.jpg is beside the list as well: the list's folder comes first; a missing line stays there, to be skipped.
    assert paths == [tmp_path / "shots/a.jpg", tmp_path / "shots/b.jpg", tmp_path / "lists/c.jpg",
                     tmp_path / "lists/shots/gone.jpg"]  # fmt: skip


@pytest.mark.parametrize("source", ["nowhere", "empty", "in/notes.json", "in/*.png"])
def test_discover_refuses_bad_sources_in_one_line(tmp_path: Path, source: str) -> None:
    make_inputs(tmp_path / "in")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="--source") as error:
        discover_inputs(str(tmp_path / source))
    assert "\n" not in str(error.value)


def test_shard_inputs_partition_and_webcam_refused() -> None:
    items = [InputItem(f"{i}.jpg", "image", i) for i in range(7)]
    shards = [shard_inputs(items, DistContext(rank=r, world_size=3)) for r in range(3)]
    assert sorted(i.index for shard in shards for i in shard) == list(range(7))  # disjoint and complete
    assert [len(s) for s in shards] == [3, 2, 2]
    webcam = [InputItem("0", "webcam", 0)]
    assert shard_inputs(webcam, DistContext()) == webcam
    with pytest.raises(ConfigError, match="webcam"):
        shard_inputs(webcam, DistContext(rank=1, world_size=2))


def test_video_reader_stride_keeps_first_frame(tmp_path: Path) -> None:
    video = write_video(tmp_path / "v.mp4", frames=5)
    with VideoReader(InputItem(str(video), "video", 0), vid_stride=2) as reader:
        kept = [number for number, _ in reader]
        assert reader.frame_count == 3 and reader.fps == pytest.approx(10.0)
    assert kept == [1, 2, 3]  # frames 1, 3, 5 of the file, numbered as kept
    broken = tmp_path / "broken.mp4"
    broken.write_bytes(b"\x00\x00\x00\x18ftypmp42 but nothing else")
    with pytest.raises(UnreadableInputError, match="broken.mp4"):
        VideoReader(InputItem(str(broken), "video", 0))
    # A name that is not valid UTF-8 would crash the process inside cv2.VideoCapture: refused first.
    undecodable = os.fsdecode(bytes(tmp_path) + b"/caf\xe9.mp4")
    with pytest.raises(UnreadableInputError, match="not valid UTF-8"):
        VideoReader(InputItem(undecodable, "video", 0))
    with pytest.raises(ConfigError, match="cannot open webcam 99"):  # the only input of a one-process run
        VideoReader(InputItem("99", "webcam", 0))


# ---- flags ------------------------------------------------------------------------------------------


def test_flags_defaults_and_refusals() -> None:
    cfg = predict_config_from_args(build_predict_parser("detect").parse_args(["--source", "x"]))
    assert (cfg.imgsz, cfg.conf_thres, cfg.iou_thres, cfg.max_det) == (None, 0.25, 0.45, 1000)  # None: trained size
    assert cfg.project.parts[-2:] == ("runs", "detect") and cfg.save.save_images and cfg.classes is None
    seg = predict_config_from_args(build_predict_parser("segment").parse_args(["--source", "x"]))
    assert seg.project.name == "predict-seg" and seg.weights.parts[-4] == "train-seg"
    argv = ["--source", "x", "--imgsz", "320", "480", "--classes", "0", "2", "--nosave", "--hide-conf"]
    cfg = predict_config_from_args(build_predict_parser().parse_args(argv))
    assert cfg.imgsz == (320, 480) and cfg.classes == (0, 2) and not cfg.save.save_images and cfg.style.hide_conf
    rounded = predict_config_from_args(build_predict_parser().parse_args(["--source", "x", "--imgsz", "100", "64"]))
    assert rounded.imgsz == (128, 64)  # up to multiples of 32, as YOLOv5
    for bad in (["--view-img"], ["--imgsz", "64", "64", "64"], ["--conf-thres", "2"], ["--vid-stride", "0"]):
        with pytest.raises(ConfigError):
            predict_config_from_args(build_predict_parser().parse_args(["--source", "x", *bad]))


# ---- formats ----------------------------------------------------------------------------------------


def test_txt_lines_boxes_and_polygons() -> None:
    boxes = np.array([[10, 20, 50, 60]], np.float32)
    prediction = Prediction(boxes, np.array([0.9], np.float32), np.array([2]))
    assert txt_lines(prediction, (100, 200), with_conf=True) == ["2 0.150000 0.400000 0.200000 0.400000 0.90000"]
    mask = np.zeros((1, 100, 200), bool)
    mask[0, 20:60, 10:50] = True
    polygon = mask_polygon(mask[0])  # along the pixels' outer edges: columns 10..49 span x 10 to 50
    assert polygon.min(0).tolist() == [10, 20] and polygon.max(0).tolist() == [50, 60]
    np.testing.assert_array_equal(polygons_to_mask([polygon], 100, 200).astype(bool), mask[0])  # drawn again
    (line,) = txt_lines(replace(prediction, masks=mask), (100, 200), with_conf=False)
    values = [float(v) for v in line.split()]
    assert values[0] == 2 and len(values) % 2 == 1 and len(values) >= 7
    # The largest region by area: a square (4 outline points) over a small disc (dozens of points).
    mask[0] = False
    mask[0, 10:90, 10:90] = True
    cv2.circle(mask_u8 := mask[0].astype(np.uint8), (170, 80), 8, 1, -1)
    polygon = mask_polygon(mask_u8.astype(bool))
    assert polygon.min(0).tolist() == [10, 10] and polygon.max(0).tolist() == [90, 90]
    for side in (1, 2, 3):  # the smallest regions too: a saved label must not shrink them
        small = np.zeros((20, 20), bool)
        small[5 : 5 + side, 7 : 7 + side] = True
        np.testing.assert_array_equal(polygons_to_mask([mask_polygon(small)], 20, 20).astype(bool), small)
    empty = replace(prediction, masks=np.zeros((1, 100, 200), bool))  # an empty mask falls back to the box
    corners = "0.050000 0.200000 0.250000 0.200000 0.250000 0.600000 0.050000 0.600000"
    assert txt_lines(empty, (100, 200), False) == [f"2 {corners}"]
    assert describe(replace(prediction, class_ids=np.array([2])), SHAPE_NAMES) == "1 square"
    several = replace(prediction, class_ids=np.array([4, 0, 4, 0, 5, 5, 5]), scores=np.ones(7, np.float32))
    assert describe(several, SHAPE_NAMES) == "2 circles, 2 crosses, 3 crescents"  # YOLOv5 says "2 crosss"
    words = ["bus", "glass", "box", "batch", "dish", "battery", "toy", "skis", "scissors", "person"]
    plurals = ["buses", "glasses", "boxes", "batches", "dishes", "batteries", "toys", "skis", "scissors", "persons"]
    assert [counted(2, word) for word in words] == [f"2 {word}" for word in plurals]


def test_an_output_named_after_an_input_that_is_not_utf8_is_written(tmp_path: Path) -> None:
    # cv2.imwrite would crash the process (SIGSEGV) on such a name: run it in a child to see a failure, not die of it.
    code = (
        "import os, sys, numpy as np\n"
        "from utils.predict.outputs import write_image\n"
        "write_image(__import__('pathlib').Path(os.fsdecode(os.fsencode(sys.argv[1]) + b'/caf\\xe9.jpg')), "
        "np.full((8, 8, 3), 200, np.uint8))\n"
    )
    root = Path(__file__).resolve().parents[1]
    child = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=root, capture_output=True, text=True)
    assert child.returncode == 0, child.stderr
    written = tmp_path / os.fsdecode(b"caf\xe9.jpg")
    assert cv2.imdecode(np.fromfile(written, np.uint8), cv2.IMREAD_COLOR).mean() == pytest.approx(200, abs=2)


# ---- the loop ---------------------------------------------------------------------------------------


def test_predict_folder_writes_images_video_labels_crops_and_skips_bad(
    tmp_path: Path, det_weights: Path, caplog: pytest.LogCaptureFixture
) -> None:
    source = make_inputs(tmp_path / "in")
    save = SaveOptions(save_txt=True, save_conf=True, save_crop=True)
    with caplog.at_level(logging.INFO):
        result = predict(config(det_weights, source, tmp_path / "runs", save=save), DETECT, DistContext())
    run = result.save_dir
    assert run == tmp_path / "runs" / "exp"
    assert (result.total.images, result.total.videos, result.total.frames) == (3, 1, 3 + VIDEO_FRAMES)
    assert result.total.num_skipped == 1 and "broken.jpg" in result.total.skipped[0]
    skipped = [r for r in caplog.records if r.levelno == logging.WARNING and "broken.jpg" in r.getMessage()]
    assert len(skipped) == 2  # once when skipped, once in the summary
    assert all((run / f"img{i}.jpg").is_file() for i in range(3)) and not (run / "broken.jpg").exists()
    assert video_frames(run / "clip.mp4") == (VIDEO_FRAMES, pytest.approx(10.0))
    labels = sorted(p.name for p in (run / "labels").iterdir())
    assert labels == sorted([f"img{i}.txt" for i in range(3)] + [f"clip_{n}.txt" for n in range(1, 6)])
    rows = [row for name in labels for row in read_labels(run / "labels" / name)]
    assert len(rows) == result.total.detections > 0
    assert all(len(row) == 6 and row[0] in range(len(SHAPE_NAMES)) for row in rows)
    assert all(0 <= v <= 1 for row in rows for v in row[1:5]) and all(0.25 < row[5] <= 1 for row in rows)
    crops = list((run / "crops").glob("*/*.jpg"))
    assert len(crops) == len(rows) and {c.parent.name for c in crops} <= set(SHAPE_NAMES)
    lines = [r.getMessage() for r in caplog.records]
    assert any(line.startswith("image 3/5 ") and line.endswith("ms") for line in lines)
    assert any(line.startswith("video 2/5 (frame 5/5) ") for line in lines)
    assert any(line.startswith("Speed: ") and "per image at shape (1, 3, 64, 64)" in line for line in lines)


def test_an_image_of_a_type_opencv_cannot_write_is_annotated_as_jpg(tmp_path: Path, det_weights: Path) -> None:
    source = tmp_path / "in"
    write_image(source / "shot.jpg", seed=0)
    (source / "shot.jpg").rename(source / "shot.mpo")  # a camera's multi-picture JPEG: read as JPEG, no encoder
    result = predict(config(det_weights, source, tmp_path / "runs"), DETECT, DistContext())
    assert result.total.images == 1 and result.total.num_skipped == 0
    assert [p.name for p in result.save_dir.iterdir() if p.is_file()] == ["shot.jpg"]
    assert [annotated_suffix(s) for s in (".png", ".JPG", ".dng", ".pfm")] == [".png", ".JPG", ".jpg", ".jpg"]


def test_inputs_of_one_name_from_several_folders_get_their_own_outputs(
    tmp_path: Path, det_weights: Path, caplog: pytest.LogCaptureFixture
) -> None:
    for index, camera in enumerate(("cam1", "cam2", "cam3")):
        write_image(tmp_path / "in" / camera / "0001.jpg", seed=index)
    write_image(tmp_path / "in" / "cam1" / "0001-2.jpg", seed=7)  # comes first and holds the name 0001-2
    save = SaveOptions(save_txt=True)
    with caplog.at_level(logging.WARNING):
        result = predict(config(det_weights, tmp_path / "in" / "**" / "*.jpg", tmp_path / "runs", save=save), DETECT,
                         DistContext())  # fmt: skip
    written = sorted(path.name for path in result.save_dir.glob("*.jpg"))
    assert written == ["0001-2.jpg", "0001-3.jpg", "0001-4.jpg", "0001.jpg"]  # four inputs, four pictures
    assert len(list((result.save_dir / "labels").glob("*.txt"))) == result.total.images == 4
    assert (
        "2 input(s) share a file name with an earlier one or a video's frame; their outputs are renamed" in caplog.text
    )


def test_an_image_named_like_a_videos_frame_gets_its_own_outputs(
    tmp_path: Path, det_weights: Path, caplog: pytest.LogCaptureFixture
) -> None:
    write_image(tmp_path / "in" / "v_1.jpg", seed=0)
    write_video(tmp_path / "in" / "v.mp4", frames=3)  # frames v_1, v_2, v_3
    write_image(tmp_path / "in" / "v_1-2.jpg", seed=1)  # holds the first rename already
    write_image(tmp_path / "in" / "v_x.jpg", seed=2)  # no frame number: keeps its name
    save = SaveOptions(save_images=False, save_txt=True, save_crop=True)
    with caplog.at_level(logging.WARNING):
        result = predict(config(det_weights, tmp_path / "in", tmp_path / "runs", save=save, conf_thres=0.001),
                         DETECT, DistContext())  # fmt: skip
    labels = sorted(path.stem for path in (result.save_dir / "labels").glob("*.txt"))
    assert labels == ["v_1", "v_1-2", "v_1-3", "v_2", "v_3", "v_x"]
    assert result.total.frames == result.total.labels == 6
    crops = list((result.save_dir / "crops").rglob("*.jpg"))
    assert len(crops) == result.total.detections > 0  # no picture's crop wrote over another's
    assert "in/v_1.jpg -> v_1-3 (a frame of video v has its name)" in caplog.text


def test_detect_predicts_at_the_size_the_checkpoint_was_trained_at_unless_told(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    weights = untrained_checkpoint(tmp_path / "w224.pt", DETECT, "yolov5n", train_imgsz=224)
    image = write_image(tmp_path / "in" / "a.jpg", seed=0, hw=(96, 128))
    shapes = []
    for flags in ([], ["--imgsz", "64"]):
        argv = ["--weights", str(weights), "--source", str(image), "--device", "cpu", "--nosave"]
        cfg = predict_config_from_args(build_predict_parser().parse_args([*argv, *flags, "--project", str(tmp_path)]))
        caplog.clear()
        with caplog.at_level(logging.INFO):
            predict(cfg, DETECT, DistContext())
        shapes += [line.split(": ")[1].split()[0] for line in caplog.messages if line.startswith("image 1/1 ")]
    assert shapes == ["192x224", "64x64"]  # 96x128 fitted into the trained 224 px (not 640), then into --imgsz 64


def test_classes_filter_and_nosave(tmp_path: Path, det_weights: Path) -> None:
    source = make_inputs(tmp_path / "in", images=2, corrupt=False, video=False)
    save = SaveOptions(save_txt=True, save_images=False)
    everything = predict(config(det_weights, source, tmp_path / "runs", save=save), DETECT, DistContext())
    all_rows = [row for p in (everything.save_dir / "labels").glob("*.txt") for row in read_labels(p)]
    classes = {int(row[0]) for row in all_rows}
    assert len(classes) >= 2  # otherwise the filter below could not remove anything
    keep = min(classes)
    only = predict(config(det_weights, source, tmp_path / "runs", save=save, classes=(keep,)), DETECT, DistContext())
    kept_rows = [row for p in (only.save_dir / "labels").glob("*.txt") for row in read_labels(p)]
    # NMS is per class, so filtering leaves exactly the unfiltered run's boxes of that class. (torchvision's
    # batched_nms separates classes by an offset of max coordinate + 1, which lets boxes of neighbouring
    # classes meet when corners lie far below 0; the checkpoint's small boxes keep clear of that.)
    assert sorted(map(tuple, kept_rows)) == sorted(tuple(row) for row in all_rows if row[0] == keep)
    assert only.save_dir.name == "exp2" and not list(only.save_dir.glob("*.jpg"))  # --nosave: labels only
    with pytest.raises(ConfigError, match="--classes 6"):
        predict(config(det_weights, source, tmp_path / "runs", classes=(6,)), DETECT, DistContext())


def test_a_webcam_that_does_not_open_is_one_line_and_leaves_no_run_folder(tmp_path: Path, det_weights: Path) -> None:
    with pytest.raises(ConfigError, match="^--source 99: cannot open webcam 99$"):
        predict(config(det_weights, "99", tmp_path / "runs"), DETECT, DistContext())
    assert not (tmp_path / "runs").exists()


def test_segmentation_writes_polygons_and_tinted_images(tmp_path: Path, seg_weights: Path) -> None:
    source = make_inputs(tmp_path / "in", images=2, corrupt=False, video=False)
    save = SaveOptions(save_txt=True)
    result = predict(config(seg_weights, source, tmp_path / "runs", max_det=5), SEGMENT, DistContext())
    plain = result.save_dir
    result = predict(config(seg_weights, source, tmp_path / "runs", max_det=5, save=save), SEGMENT, DistContext())
    rows = [row for p in (result.save_dir / "labels").glob("*.txt") for row in read_labels(p)]
    assert len(rows) == result.total.detections > 0
    assert all(len(row) >= 7 and len(row) % 2 == 1 for row in rows)  # class + at least 3 x, y pairs
    assert all(0 <= v <= 1 for row in rows for v in row[1:])
    original, drawn = cv2.imread(str(source / "img0.jpg")), cv2.imread(str(plain / "img0.jpg"))
    assert drawn.shape == original.shape and np.abs(drawn.astype(int) - original).mean() > 5  # masks and boxes
    with pytest.raises(ConfigError, match="segment checkpoint"):
        predict(config(seg_weights, source, tmp_path / "runs"), DETECT, DistContext())


def test_segmentation_masks_lie_in_their_boxes_at_original_size(tmp_path: Path, seg_weights: Path) -> None:
    cfg = config(seg_weights, "", tmp_path, max_det=20)
    model, _, _ = load_predictor_model(cfg, SEGMENT, DistContext())
    image = cv2.imread(str(write_image(tmp_path / "wide.jpg", seed=3, hw=(80, 150))))  # letterboxed 48x64 + pad
    prediction, input_hw, _ = FramePredictor(model, SEGMENT, cfg)(image)
    assert input_hw == (64, 64) and len(prediction) > 0 and prediction.masks.shape == (len(prediction), 80, 150)
    filled = prediction.masks.any(axis=(1, 2))
    assert filled.sum() >= len(prediction) / 2  # the biased prototypes fill boxes (but a ~2 px box may cover no pixel)
    for mask, (x1, y1, x2, y2) in zip(prediction.masks[filled], prediction.boxes_xyxy[filled], strict=True):
        rows, cols = np.nonzero(mask)  # within the box, up to the resize's one-pixel blur
        assert cols.min() >= x1 - 1.5 and cols.max() <= x2 + 0.5 and rows.min() >= y1 - 1.5 and rows.max() <= y2 + 0.5


# ---- ranks ------------------------------------------------------------------------------------------


def _predict_on_rank(ctx: DistContext, weights: Path, source: Path, project: Path) -> tuple:
    save = SaveOptions(save_txt=True)
    result: PredictResult = predict(config(weights, source, project, save=save), DETECT, ctx)
    return result.save_dir, result.mine.processed, result.total.images, result.total.num_skipped


@pytest.mark.distributed
def test_two_ranks_predict_each_input_once(tmp_path: Path, det_weights: Path) -> None:
    source = make_inputs(tmp_path / "in", images=5, corrupt=True, video=False)
    results = run_distributed(_predict_on_rank, 2, tmp_path / "dist", det_weights, source, tmp_path / "runs")
    (dir0, mine0, images0, skipped0), (dir1, mine1, images1, skipped1) = results
    assert dir0 == dir1 == tmp_path / "runs" / "exp"
    assert not set(mine0) & set(mine1) and len(mine0) == 2 and len(mine1) == 3  # broken.jpg is rank 0's first item
    assert sorted(mine0 + mine1) == sorted(str(source / f"img{i}.jpg") for i in range(5))
    assert (images0, skipped0) == (images1, skipped1) == (5, 1)  # totals gathered from both ranks
    assert sorted(p.name for p in dir0.glob("*.jpg")) == [f"img{i}.jpg" for i in range(5)]
    assert len(list((dir0 / "labels").glob("*.txt"))) == 5


# ---- entry points -----------------------------------------------------------------------------------


@pytest.mark.slow
def test_detect_and_segment_predict_entry_points(tmp_path: Path, det_weights: Path, seg_weights: Path) -> None:
    source = make_inputs(tmp_path / "in", images=2, corrupt=True, video=True)
    argv = ["--source", str(source / "*.*"), "--imgsz", "64", "--device", "cpu", "--save-txt"]
    result = detect.main(["--weights", str(det_weights), *argv, "--project", str(tmp_path / "det")])
    assert (result.total.images, result.total.videos, result.total.num_skipped) == (2, 1, 1)
    assert (result.save_dir / "clip.mp4").is_file() and len(list((result.save_dir / "labels").glob("*"))) == 7
    result = segment_predict.main(["--weights", str(seg_weights), *argv, "--project", str(tmp_path / "seg")])
    assert result.save_dir == tmp_path / "seg" / "exp" and result.total.frames == 2 + VIDEO_FRAMES
