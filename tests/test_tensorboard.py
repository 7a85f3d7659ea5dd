"""TensorBoardLogger: results.csv columns and figures as events on rank 0; a one-line hint without the package."""

from __future__ import annotations

import csv
import logging
import math
import sys
from pathlib import Path

import cv2
import numpy as np
import pytest

from utils.distributed import DistContext
from utils.train.tensorboard import INSTALL_HINT, TensorBoardLogger

ROWS = [
    {"epoch": 1, "train/box_loss": 0.5, "metrics/mAP50": float("nan"), "lr/pg0": 0.01, "time_s": 3.5},
    {"epoch": 2, "train/box_loss": 0.25, "metrics/mAP50": 0.4, "lr/pg0": 0.005, "time_s": 3.0},
]


def _events(run_dir: Path):
    """Read `run_dir`'s TensorBoard events back (skips the test when tensorboard is not installed)."""
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    events = accumulator.EventAccumulator(str(run_dir), size_guidance={"images": 0, "scalars": 0})
    events.Reload()
    return events


def _figure(path: Path) -> Path:
    image = np.zeros((24, 32, 3), np.uint8)
    image[:, :, 2] = 200  # red in BGR
    cv2.imwrite(str(path), image)
    return path


def test_logger_writes_every_column_as_a_scalar_per_epoch_and_figures(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pytest.importorskip("tensorboard")
    caplog.set_level(logging.INFO, logger="utils.train.tensorboard")
    with TensorBoardLogger(tmp_path, DistContext()) as board:
        board.add_figure(_figure(tmp_path / "train_batch0.png"))  # before the first epoch: step 0
        for row in ROWS:
            board.log_epoch(row)
        board.add_figure(_figure(tmp_path / "results.png"))
        board.add_figure(tmp_path / "missing.png")  # a warning, not an error
    assert f"tensorboard --logdir {tmp_path.parent}" in caplog.text and "could not read" in caplog.text
    events = _events(tmp_path)
    assert set(events.Tags()["scalars"]) == {"train/box_loss", "metrics/mAP50", "lr/pg0", "time_s"}
    assert [(e.step, e.value) for e in events.Scalars("train/box_loss")] == [(1, 0.5), (2, 0.25)]
    assert [e.step for e in events.Scalars("metrics/mAP50")] == [2], "the unvalidated epoch's NaN is left out"
    assert [e.value for e in events.Scalars("lr/pg0")] == pytest.approx([0.01, 0.005])
    assert set(events.Tags()["images"]) == {"train_batch0", "results"}
    image = events.Images("results")[0]
    assert image.step == 2 and (image.width, image.height) == (32, 24)
    decoded = cv2.imdecode(np.frombuffer(image.encoded_image_string, np.uint8), cv2.IMREAD_COLOR)
    assert decoded[0, 0, 2] > 150 and decoded[0, 0, 0] < 50, "stored as RGB: still red"
    assert events.Images("train_batch0")[0].step == 0


def test_writer_is_closed_and_its_events_kept_when_the_run_fails(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    with pytest.raises(FloatingPointError), TensorBoardLogger(tmp_path, DistContext()) as board:
        board.log_epoch(ROWS[0])
        raise FloatingPointError("loss is NaN")
    assert board.writer is None
    assert [e.value for e in _events(tmp_path).Scalars("train/box_loss")] == [0.5]


def test_logger_does_nothing_off_rank_0(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    board = TensorBoardLogger(tmp_path, DistContext(rank=1, world_size=2))
    board.log_epoch(ROWS[0])
    board.add_figure(_figure(tmp_path / "results.png"))
    board.close()
    assert [p.name for p in tmp_path.iterdir()] == ["results.png"] and "TensorBoard" not in caplog.text


def test_without_the_package_one_line_says_how_to_enable_it_and_nothing_else_happens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # `from torch.utils.tensorboard import` fails
    caplog.set_level(logging.DEBUG)
    with TensorBoardLogger(tmp_path, DistContext()) as board:
        for row in ROWS:
            board.log_epoch(row)
        board.add_figure(_figure(tmp_path / "results.png"))
    assert [record.getMessage() for record in caplog.records] == [INSTALL_HINT]
    assert "pip install tensorboard" in INSTALL_HINT
    assert [p.name for p in tmp_path.iterdir()] == ["results.png"], "no event files"


@pytest.mark.slow  # train.py end to end
def test_training_run_logs_results_columns_and_writes_the_new_plots(tmp_path: Path) -> None:
    import train
    from tests.conftest import make_tiny_dataset
    from utils.data.synthetic import SyntheticSpec

    data = make_tiny_dataset(tmp_path, SyntheticSpec(num_train=8, num_val=4, max_objects=3, min_object_frac=0.15))
    args = ["--cfg", "yolov5n", "--data", str(data), "--imgsz", "64", "--batch-size", "4", "--workers", "0",
            "--device", "cpu", "--project", str(tmp_path / "runs"), "--name", "tb", "--epochs", "1"]  # fmt: skip
    run_dir = train.main(args).run_dir
    for name in ("labels.jpg", "val_batch0_labels.jpg", "val_batch0_pred.jpg", "train_batch0.jpg"):
        image = cv2.imread(str(run_dir / name))
        assert image is not None and image.std() > 0, name
    events = _events(run_dir)
    with (run_dir / "results.csv").open() as file:
        row = next(csv.DictReader(file))
    finite = {key for key, value in row.items() if key != "epoch" and math.isfinite(float(value))}
    assert set(events.Tags()["scalars"]) == finite and "metrics/mAP50" in finite
    assert {"labels", "train_batch0", "val_batch0_pred", "results", "confusion_matrix"} <= set(events.Tags()["images"])
