"""End to end with an anchor-free model: train.py, val.py (NMS-free and --nms), detect.py, export, resume, refusals."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest
import torch

import detect
import train
import val
from tests.conftest import make_tiny_dataset, tiny_val_argv
from utils.checkpoint import load_checkpoint
from utils.data.synthetic import SyntheticSpec
from utils.errors import ConfigError

TINY = SyntheticSpec(num_train=16, num_val=8, max_objects=4, min_object_frac=0.15)
pytestmark = pytest.mark.slow  # train.main / val.main / detect.main


def _train_args(data: Path, project: Path, name: str, *extra: str) -> list[str]:
    return ["--data", str(data), "--imgsz", "64", "--batch-size", "8", "--workers", "0", "--device", "cpu",
            "--project", str(project), "--name", name, "--seed", "3", *extra]  # fmt: skip


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_dataset(tmp_path_factory.mktemp("tiny-af"), TINY)


@pytest.fixture(scope="module")
def yolo26_run(tiny_data: Path, tmp_path_factory: pytest.TempPathFactory):
    """Two epochs of yolo26n (end-to-end, reg_max 1) from scratch on the tiny set."""
    project = tmp_path_factory.mktemp("runs-af")
    return train.main(_train_args(tiny_data, project, "yolo26", "--cfg", "yolo26n", "--epochs", "2", "--noplots"))


def test_training_records_the_family_its_recipe_and_its_loss_columns(yolo26_run) -> None:
    checkpoint = load_checkpoint(yolo26_run.last, for_resume=True)
    assert checkpoint["model_family"] == "anchor_free" and checkpoint["model_spec"]["layout"] == "yolo26"
    assert checkpoint["hyp"]["dfl"] == 1.5 and "obj" not in checkpoint["hyp"]  # the anchor-free recipe file
    with (yolo26_run.run_dir / "results.csv").open() as file:
        rows = list(csv.DictReader(file))
    assert len(rows) == 2 and {"train/box_loss", "train/cls_loss", "train/l1_loss", "val/l1_loss"} <= set(rows[0])
    assert all(float(rows[-1][key]) == float(rows[-1][key]) for key in rows[-1])  # no NaN anywhere


def test_val_scores_the_nms_free_head_and_with_nms_the_other(yolo26_run, tiny_data: Path, tmp_path: Path) -> None:
    weights = yolo26_run.run_dir / "weights" / "best.pt"
    nms_free = val.main(tiny_val_argv(weights, tiny_data, tmp_path, "--name", "a", "--save-txt"))
    with_nms = val.main(tiny_val_argv(weights, tiny_data, tmp_path, "--name", "b", "--save-txt", "--nms"))
    assert nms_free.num_images == with_nms.num_images == TINY.num_val
    free_rows = {image.path: image.detections for image in nms_free.predictions}
    nms_rows = {image.path: image.detections for image in with_nms.predictions}
    assert free_rows.keys() == nms_rows.keys() and all(len(rows) for rows in [*free_rows.values(), *nms_rows.values()])
    # Two heads, two selections (top scores vs NMS): every image's detections differ. An ignored --nms, or an
    # end-to-end model that never decodes its one-to-one head, would give the same rows twice.
    assert all(not np.array_equal(free_rows[path], nms_rows[path]) for path in free_rows)


def test_detect_writes_labels_with_at_most_max_det_rows(yolo26_run, tiny_data: Path, tmp_path: Path) -> None:
    images = tiny_data.parent / "shapes" / "images" / "val"
    weights = yolo26_run.run_dir / "weights" / "best.pt"
    args = ["--weights", str(weights), "--source", str(images), "--imgsz", "64", "--conf-thres", "0.0"]
    result = detect.main([*args, "--max-det", "5", "--save-txt", "--project", str(tmp_path), "--device", "cpu"])
    labels = list((result.save_dir / "labels").glob("*.txt"))
    assert labels and all(len(path.read_text().splitlines()) <= 5 for path in labels)


def test_resume_continues_the_anchor_free_run(yolo26_run, tmp_path: Path) -> None:
    last = yolo26_run.last
    resumed = train.main(["--resume", str(last), "--epochs", "3"])
    assert resumed.epochs_run == 1
    checkpoint = load_checkpoint(resumed.run_dir / "weights" / "last.pt", for_resume=True)
    assert checkpoint["epoch"] == 2 and checkpoint["model_family"] == "anchor_free"


def test_weights_of_one_family_with_a_cfg_of_another_is_one_line(yolo26_run, tiny_data: Path, tmp_path: Path) -> None:
    weights = yolo26_run.run_dir / "weights" / "best.pt"
    args = _train_args(tiny_data, tmp_path, "x", "--weights", str(weights), "--cfg", "yolov5n", "--epochs", "1")
    with pytest.raises(
        ConfigError, match=r"holds a model of the anchor_free family but --cfg yolov5n is of the yolov5 family"
    ):
        train.main(args)
    # One family, another network: also refused, where it used to train the checkpoint's under --cfg's name.
    args = _train_args(tiny_data, tmp_path, "x", "--weights", str(weights), "--cfg", "yolov8n", "--epochs", "1")
    with pytest.raises(ConfigError, match=r"holds another network than --cfg yolov8n \(layout yolo26 against yolov8"):
        train.main(args)
    args = _train_args(tiny_data, tmp_path, "x", "--weights", str(weights), "--cfg", "yolo26s", "--epochs", "1")
    with pytest.raises(ConfigError, match=r"--cfg yolo26s \(width_multiple 0.25 against 0.5\)"):
        train.main(args)


def test_fine_tuning_keeps_the_checkpoint_family(yolo26_run, tiny_data: Path, tmp_path: Path) -> None:
    weights = yolo26_run.run_dir / "weights" / "best.pt"
    result = train.main(_train_args(tiny_data, tmp_path, "ft", "--weights", str(weights), "--epochs", "1", "--noplots"))
    checkpoint = load_checkpoint(result.last, for_resume=True)
    assert checkpoint["model_family"] == "anchor_free"  # what val, detect, export and a resume build from
    assert checkpoint["model_spec"] == load_checkpoint(weights)["model_spec"]  # yolo26n as trained, not a default
    assert checkpoint["hyp"]["dfl"] == 1.5 and "obj" not in checkpoint["hyp"]  # the family's recipe, not YOLOv5's
    assert torch.isfinite(torch.tensor([float(v) for v in checkpoint["hyp"].values()])).all()
