"""Unit tests for engine/run-setup pieces that need no training run: freezing, early stop, augment params."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from models.yolo import build_model, spec_from_cfg
from utils.config import DEFAULT_HYP
from utils.errors import ConfigError
from utils.hyp import load_hyp
from utils.train.results import EarlyStopper, EpochSummary, ResultsCSV
from utils.train.setup import augment_params, epoch_batches_line, freeze_layers

YOLOV5_LOSS_NAMES = ("box", "obj", "cls")  # the items of the YOLOv5 family's detection loss


def test_freeze_first_ten_layers_freezes_exactly_the_backbone() -> None:
    model = build_model(spec_from_cfg("yolov5n", 3))
    freeze_layers(model, (10,))
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert frozen and all(name.startswith("backbone.") for name in frozen)
    assert not any(name.startswith("backbone.") for name in trainable)
    assert any(name.startswith("head.") for name in trainable)


def test_freeze_list_of_indices() -> None:
    model = build_model(spec_from_cfg("yolov5n", 3))
    freeze_layers(model, (0, 24))  # the stem and the head
    frozen = [name for name, p in model.named_parameters() if not p.requires_grad]
    assert all(name.startswith(("backbone.stem.", "head.")) for name in frozen)
    assert any(name.startswith("backbone.stem.") for name in frozen)
    assert any(name.startswith("head.") for name in frozen)
    assert all(p.requires_grad for name, p in model.named_parameters() if name.startswith(("backbone.stage", "neck.")))


@pytest.mark.parametrize(
    ("freeze", "message"),
    [
        ((25,), "freezes every trainable layer of this model (layers 0-24), so nothing is left to train"),
        ((1000,), "--freeze 1000: this model has 25 layers (0-24) and one value N freezes the first N, so N must"),
        ((-1,), "--freeze -1: this model has 25 layers (0-24)"),
        ((5, 500), "--freeze 5 500: no layer 500 in this model; its layers are 0-24"),
        ((-2, 3), "--freeze -2 3: no layer -2 in this model"),
        (tuple(range(25)), "nothing is left to train"),
    ],
)
def test_freeze_refuses_bad_indices_before_freezing_anything(freeze: tuple[int, ...], message: str) -> None:
    model = build_model(spec_from_cfg("yolov5n", 3))
    with pytest.raises(ConfigError, match=re.escape(message)):
        freeze_layers(model, freeze)
    assert all(p.requires_grad for p in model.parameters())


def test_freeze_all_but_the_head_is_allowed_and_zero_freezes_nothing() -> None:
    model = build_model(spec_from_cfg("yolov5n", 3))
    freeze_layers(model, (0,))
    assert all(p.requires_grad for p in model.parameters())
    freeze_layers(model, (24,))  # the first 24 layers: everything but the head
    assert {name.split(".")[0] for name, p in model.named_parameters() if p.requires_grad} == {"head"}


def test_start_up_line_says_where_a_resumed_epoch_goes_on() -> None:
    from tests.test_loader import FakeDataset
    from utils.data.loader import build_train_loader
    from utils.distributed import DistContext

    ctx = DistContext()
    loader = build_train_loader(FakeDataset(10, ctx), 4, 0, ctx, seed=0)  # 3 batches of 4, 4, 2
    loader.start(15, 0)
    assert epoch_batches_line(loader, epochs=20) == "3 batches/epoch"
    loader.start(15, 1)
    assert epoch_batches_line(loader, epochs=20) == "3 batches/epoch (resumed epoch 16 goes on at batch 2, 2 left)"
    loader.start(15, 3)  # stopped at the epoch's last (short) batch: nothing of epoch 16 is left to train
    assert epoch_batches_line(loader, epochs=20) == (
        "3 batches/epoch (resumed epoch 16 has no batch left: it is validated and saved, then epoch 17 starts)"
    )
    assert epoch_batches_line(loader, epochs=16).endswith("it is validated and saved, which ends the run)")
    assert epoch_batches_line(loader, epochs=20, noval=True).endswith("it is saved, then epoch 17 starts)")
    assert epoch_batches_line(loader, epochs=16, noval=True).endswith("validated and saved, which ends the run)")
    loader.close()


def test_early_stopper_waits_patience_epochs_after_best() -> None:
    stopper = EarlyStopper(patience=2)
    decisions = [stopper.should_stop(epoch, fitness) for epoch, fitness in enumerate([0.1, 0.3, 0.2, 0.25, 0.1])]
    assert decisions == [False, False, False, True, True]
    assert stopper.best_epoch == 1
    never = EarlyStopper(patience=0)
    assert not any(never.should_stop(epoch, 0.0 if epoch else 1.0) for epoch in range(50))


@pytest.mark.parametrize("rect", [False, True])
def test_augment_params_take_hyp_values_and_rect_disables_mosaic(rect: bool) -> None:
    hyp = load_hyp(DEFAULT_HYP)
    params = augment_params(hyp, rect)
    assert params.hsv_s == hyp.hsv_s and params.fliplr == hyp.fliplr and params.scale == hyp.scale
    assert params.mosaic == (0.0 if rect else hyp.mosaic)


def test_epoch_summary_row_names_every_column_and_fills_unvalidated_epochs_with_nan(tmp_path) -> None:
    from utils.distributed import DistContext
    from utils.tasks import DETECT

    summary = EpochSummary(2, np.array([0.1, 0.2, 0.3]), None, {}, [0.01, 0.02, 0.03], 12.345)
    row = summary.as_row(DETECT, YOLOV5_LOSS_NAMES)
    assert row["epoch"] == 3 and row["train/obj_loss"] == pytest.approx(0.2) and row["time_s"] == 12.35
    assert np.isnan(row["metrics/mAP50-95"]) and np.isnan(row["val/cls_loss"]) and summary.fitness == 0.0
    assert [key for key in row if key.startswith("lr/")] == ["lr/pg0", "lr/pg1", "lr/pg2"]
    csv = ResultsCSV(tmp_path / "results.csv", DistContext())
    csv.append(row)
    csv.append(
        EpochSummary(3, np.zeros(3), np.ones(3), {"fitness": 0.5, "mAP50": 0.7}, [0.0] * 3, 1.0).as_row(
            DETECT, YOLOV5_LOSS_NAMES
        )
    )
    rows = csv.read()
    assert list(rows[0]) == list(row) and rows[1]["metrics/mAP50"] == "0.7" and rows[1]["val/box_loss"] == "1"
    ResultsCSV(tmp_path / "other.csv", DistContext(rank=1, world_size=2)).append(row)
    assert not (tmp_path / "other.csv").exists()  # only rank 0 writes


def test_amp_modes_map_to_autocast_dtypes() -> None:
    from utils.train.config import autocast_dtype

    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert autocast_dtype("auto", cpu) is None and autocast_dtype("auto", cuda) is torch.float16
    assert autocast_dtype("bf16", cpu) is torch.bfloat16 and autocast_dtype("fp16", cpu) is torch.float16
    assert autocast_dtype("off", cuda) is None


def test_the_done_line_counts_the_runs_epochs_and_says_how_many_came_after_a_resume() -> None:
    from utils.train.state import FitResult

    fresh = FitResult(Path("r"), Path("b"), Path("l"), {}, epochs_run=3, epochs_done=3)
    resumed = FitResult(Path("r"), Path("b"), Path("l"), {}, epochs_run=1, epochs_done=3)
    assert fresh.describe_epochs() == "3 epochs" and resumed.describe_epochs() == "3 epochs (1 after the resume)"


def test_callback_state_that_is_not_plain_data_is_left_out_and_warned_about_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from utils.train.saving import _callback_state

    warned: set[str] = set()
    state = {"seen": 2, "handle": object()}
    with caplog.at_level("WARNING"):
        for _ in range(3):  # three saves
            assert _callback_state(state, warned) == {"seen": 2}
    assert caplog.messages == [
        "callback state 'handle' not saved in checkpoints: cannot store a value of type object in a checkpoint; "
        "convert it to plain data"
    ]


def test_where_a_resume_starts_depends_on_what_the_checkpoint_was_trained_with(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from utils.train.saving import resume_point

    geometry = {"world_size": 2, "per_rank_batch": 4, "shared_order": False, "dataset_len": 40, "dataset": "abc"}
    checkpoint = {"epoch": 3, "batches_done": 2, "epoch_geometry": dict(geometry), "epoch_seen": torch.arange(16)}
    assert resume_point(None, geometry).epoch == 0
    same = resume_point(checkpoint, geometry)  # the next batch of the same order
    assert (same.epoch, same.batch, same.seen) == (4, 2, None)
    older = resume_point({key: checkpoint[key] for key in ("epoch", "batches_done")}, geometry)
    assert (older.epoch, older.batch, older.seen) == (4, 2, None)  # no geometry recorded: as before
    in_plan = resume_point({**checkpoint, "plan_seen": torch.arange(8)}, geometry)  # stopped in a remainder plan
    assert (in_plan.batch, in_plan.seen.tolist()) == (2, list(range(8)))
    with caplog.at_level("INFO"):
        other = resume_point(checkpoint, {**geometry, "world_size": 1})
        assert (other.epoch, other.batch, other.seen.tolist()) == (4, 0, list(range(16)))
        for changed in ({"dataset": "abd"}, {"dataset_len": 41}):  # other files: the indices mean other images
            restarted = resume_point(checkpoint, {**geometry, "world_size": 1, **changed})
            assert (restarted.epoch, restarted.batch, restarted.seen) == (4, 0, None)
    assert "goes on with the 24 of its 40 images it had not trained" in caplog.text
    assert caplog.text.count("epoch restarts from its first batch") == 2
    # At an epoch's end: another world size or batch is nothing to say, other files are said and trained on.
    caplog.clear()
    at_end = {**checkpoint, "batches_done": 0}
    with caplog.at_level("INFO"):
        for changed in ({"world_size": 1, "per_rank_batch": 8}, {"dataset_len": 41, "dataset": "abd"}):
            point = resume_point(at_end, {**geometry, **changed})
            assert (point.epoch, point.batch, point.seen) == (4, 0, None)
    assert caplog.messages == [
        "The train set is not the one the checkpoint trained on (40 images then, 41 now, or other files): the run "
        "goes on with the train set as it is now"
    ]
