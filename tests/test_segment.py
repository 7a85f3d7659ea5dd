"""End-to-end segmentation: segment/train.py on a tiny dataset, segment/val.py on its best.pt, task checks, torchrun."""

from __future__ import annotations

import csv
import math
import subprocess
import sys
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch
import yaml

import train
import val
from segment import train as seg_train
from segment import val as seg_val
from tests.conftest import make_tiny_dataset, tiny_val_argv
from tests.dist_helpers import PROCESS_TIMEOUT_S
from tests.test_torchrun import _torchrun
from utils.config import QUICKSTART_HYP
from utils.data.synthetic import SyntheticSpec
from utils.errors import ConfigError
from utils.hyp import load_hyp

REPO = Path(__file__).resolve().parents[1]
TINY = SyntheticSpec(num_train=16, num_val=8, max_objects=4, min_object_frac=0.15)
MASK_COLUMNS = ("metrics/mask_precision", "metrics/mask_recall", "metrics/mask_mAP50", "metrics/mask_mAP50-95")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 16/8-image shapes dataset with polygon labels, and its YAML."""
    return make_tiny_dataset(tmp_path_factory.mktemp("seg_data"), TINY)


def _args(data: Path, project: Path, name: str, *extra: str, model: str = "yolov5n-seg") -> list[str]:
    return ["--data", str(data), "--cfg", model, "--imgsz", "64", "--batch-size", "8", "--workers", "0",
            "--device", "cpu", "--project", str(project), "--name", name, "--seed", "5", *extra]  # fmt: skip


def _rows(path: Path) -> list[dict[str, str]]:
    with path.open() as file:
        return list(csv.DictReader(file))


@pytest.fixture(scope="module")
def seg_run(tiny_data: Path, tmp_path_factory: pytest.TempPathFactory):
    """Two epochs of segment/train.py."""
    return seg_train.main(_args(tiny_data, tmp_path_factory.mktemp("seg_runs"), "seg", "--epochs", "2"))


def test_segment_train_writes_box_and_mask_results(seg_run) -> None:
    rows = _rows(seg_run.run_dir / "results.csv")
    assert [row["epoch"] for row in rows] == ["1", "2"]
    for row in rows:
        for key in (
            "train/box_loss",
            "train/seg_loss",
            "train/obj_loss",
            "val/seg_loss",
            "metrics/mAP50",
            *MASK_COLUMNS,
        ):
            assert math.isfinite(float(row[key])), key
        assert float(row["train/seg_loss"]) > 0
    assert {"mAP50", "mAP50-95", "mask_mAP50", "mask_mAP50-95", "fitness"} <= set(seg_run.metrics)
    checkpoint = torch.load(seg_run.best, map_location="cpu", weights_only=True)
    assert checkpoint["task"] == "segment" and checkpoint["model_spec"]["num_masks"] == 32


def test_segment_train_chooses_its_recipe_by_the_detection_rule(seg_run) -> None:
    # No --optimizer or --hyp: the same auto rule as train.py (16 images x 2 epochs: a short run, AdamW).
    options = yaml.safe_load((seg_run.run_dir / "opt.yaml").read_text())
    assert (options["optimizer"], options["hyp_path"]) == ("AdamW", str(QUICKSTART_HYP))
    assert yaml.safe_load((seg_run.run_dir / "hyp.yaml").read_text()) == load_hyp(QUICKSTART_HYP).to_dict()


def test_segment_val_on_best_reproduces_the_final_metrics(seg_run, tiny_data: Path, tmp_path: Path) -> None:
    result = seg_val.main(tiny_val_argv(seg_run.best, tiny_data, tmp_path))
    assert result.mask_metrics is not None
    scores = result.as_dict()
    for key in ("mAP50", "mAP50-95", "mask_mAP50", "mask_mAP50-95"):
        assert scores[key] == pytest.approx(seg_run.metrics[key], abs=1e-6), key


@pytest.mark.distributed  # also runs val.py in a subprocess
def test_detection_validator_refuses_a_segmentation_checkpoint_in_one_line(seg_run, tiny_data: Path) -> None:
    with pytest.raises(ConfigError, match="segment checkpoint.*segment/val.py"):
        val.main(["--weights", str(seg_run.best), "--data", str(tiny_data), "--device", "cpu"])
    done = subprocess.run(
        [sys.executable, "val.py", "--weights", str(seg_run.best), "--data", str(tiny_data), "--device", "cpu"],
        cwd=REPO, capture_output=True, text=True, timeout=PROCESS_TIMEOUT_S,
    )  # fmt: skip
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_segmentation_trains_from_detection_weights_but_does_not_validate_them(tiny_data: Path, tmp_path: Path) -> None:
    detect = train.main(_args(tiny_data, tmp_path, "det", "--epochs", "1", "--noval", "--noplots", model="yolov5n"))
    with pytest.raises(ConfigError, match="detect checkpoint"):
        seg_val.main(["--weights", str(detect.best), "--data", str(tiny_data), "--device", "cpu"])
    argv = _args(
        tiny_data, tmp_path, "seg_from_det", "--epochs", "1", "--noval", "--noplots", "--weights", str(detect.best)
    )
    segmenter = seg_train.main(argv)  # the backbone, neck and box head transfer (tests/test_seg_from_detect.py)
    checkpoint = torch.load(segmenter.best, map_location="cpu", weights_only=True)
    assert checkpoint["task"] == "segment" and checkpoint["model_spec"]["num_masks"] == 32


def test_overlap_masks_train(tiny_data: Path, tmp_path: Path) -> None:
    result = seg_train.main(_args(tiny_data, tmp_path, "overlap", "--epochs", "1", "--overlap-mask", "--noplots"))
    row = _rows(result.run_dir / "results.csv")[0]
    assert math.isfinite(float(row["train/seg_loss"])) and float(row["train/seg_loss"]) > 0
    assert not [p.name for p in result.run_dir.iterdir() if p.suffix in (".png", ".jpg")], "--noplots"


def test_segment_train_plots_box_and_mask_curves(seg_run) -> None:
    curves = [f"{prefix}{kind}_curve.png" for prefix in ("", "mask_") for kind in ("PR", "F1", "P", "R")]
    figures = {name: cv2.imread(str(seg_run.run_dir / name)) for name in ("train_batch0.jpg", "results.png", *curves)}
    assert all(figure is not None for figure in figures.values()), [n for n, f in figures.items() if f is None]
    # results.png: one 3 x 2.6 inch panel at 120 dpi per results.csv column (seg and mask ones too), five a row.
    columns = len(_rows(seg_run.run_dir / "results.csv")[0]) - 1  # all but the epoch
    assert figures["results.png"].shape[:2] == (312 * math.ceil(columns / 5), 1800)
    # The mask curves are drawn from the mask metrics: this run scores boxes and masks differently
    # (seed 5), so each mask figure differs from its box figure.
    assert seg_run.metrics["mAP50"] != seg_run.metrics["mask_mAP50"]
    for name in curves[:4]:
        box_figure, mask_figure = figures[name], figures[f"mask_{name}"]
        assert box_figure.shape == mask_figure.shape == (750, 1050, 3), name  # 7 x 5 inches at 150 dpi
        assert not np.array_equal(box_figure, mask_figure), name


@pytest.mark.distributed
def test_torchrun_two_ranks_segment_train(tiny_data: Path, tmp_path: Path) -> None:
    launch = _torchrun(
        tmp_path / "logs",
        *["--data", str(tiny_data), "--imgsz", "64", "--batch-size", "4", "--project", str(tmp_path / "runs"),
          "--name", "ddp", "--epochs", "1"],
        script="segment/train.py",
    )  # fmt: skip
    assert launch.returncode == 0, launch.launcher_output + "\n".join(launch.rank_stderr)
    rows = _rows(tmp_path / "runs" / "ddp" / "results.csv")
    assert [row["epoch"] for row in rows] == ["1"] and all(math.isfinite(float(rows[0][k])) for k in MASK_COLUMNS)
    assert "world size 2" in launch.rank_stderr[0] and "mask_mAP50" in launch.rank_stdout[0]
    assert torch.load(tmp_path / "runs" / "ddp" / "weights" / "last.pt", weights_only=True)["task"] == "segment"
