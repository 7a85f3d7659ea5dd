"""Tests for utils/train/recipe.py: what --optimizer auto / --hyp auto resolve to, and where the choice is recorded."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest
import torch
import yaml

from models.yolo import build_model, spec_from_cfg
from utils.config import AUTO, DEFAULT_HYP, QUICKSTART_HYP
from utils.data.data_config import DataConfig
from utils.distributed import DistContext
from utils.hyp import load_hyp
from utils.train.config import TrainConfig, config_from_dict, save_run_config, train_config_from_argv
from utils.train.optim import accumulate_steps
from utils.train.plan import resolve_run_recipe
from utils.train.recipe import (
    AUTO_SGD_MIN_STEPS,
    LONG_RUN,
    LONG_RUN_NBS,
    SGD_MIN_LR0,
    SHORT_RUN,
    YOLOV5_RECIPES,
    auto_recipe,
    needs_image_count,
    optimizer_steps,
    resolve_recipe,
)
from utils.train.records import DETECT_TRAINING
from utils.train.setup import ModelBundle
from utils.train.state import build_train_state

OPTIMIZER_KEYS = {"lr0", "momentum", "warmup_epochs", "nbs"}  # what the two recipe files may differ in


def test_optimizer_steps_count_batches_per_accumulation_times_epochs() -> None:
    assert optimizer_steps(400, 16, 16, 60) == 25 * 60  # one step per batch
    assert optimizer_steps(400, 16, 64, 60) == 7 * 60  # 25 batches, every 4th steps, and the epoch's last
    assert optimizer_steps(1000, 128, 64, 10) == 8 * 10  # a batch above nbs never accumulates
    with pytest.raises(ValueError, match="positive sizes"):
        optimizer_steps(0, 16, 64, 1)


@pytest.mark.parametrize(
    ("images", "batch", "epochs", "expected"),
    [
        (1000, 16, 20, SHORT_RUN),  # the quick start on the built-in set: 320 steps at nbs 64
        (400, 16, 60, SHORT_RUN),  # issue 16's own-data run: 420 steps at nbs 64
        # The README's measured sizes, each to the recipe that scored best there (AdamW in all, or tied).
        (100, 16, 60, SHORT_RUN),
        (2000, 16, 20, SHORT_RUN),
        (2000, 16, 60, SHORT_RUN),
        (2000, 16, 150, SHORT_RUN),  # 4,800 steps: tied
        (2000, 16, 190, SHORT_RUN),  # 6,080 steps: AdamW still ahead
        (118_287, 64, 300, LONG_RUN),  # COCO as YOLOv5 trains it: 554,700 steps
    ],
)
def test_auto_picks_adamw_for_short_runs_and_sgd_for_long_ones(
    images: int, batch: int, epochs: int, expected: object
) -> None:
    recipe, steps = auto_recipe(images, batch, epochs)
    assert recipe == expected and steps == optimizer_steps(images, batch, LONG_RUN_NBS, epochs)


def test_auto_threshold_is_the_sgd_step_count() -> None:
    # 64 images at batch 64: one optimizer step per epoch, so epochs count steps.
    assert auto_recipe(64, 64, AUTO_SGD_MIN_STEPS) == (LONG_RUN, AUTO_SGD_MIN_STEPS)
    assert auto_recipe(64, 64, AUTO_SGD_MIN_STEPS - 1) == (SHORT_RUN, AUTO_SGD_MIN_STEPS - 1)
    # The same images and epochs at a smaller global batch accumulate to 64: the same step count.
    assert auto_recipe(6400, 16, 10) == auto_recipe(6400, 64, 10)


def test_recipe_files_match_the_rule_and_differ_only_in_optimizer_settings() -> None:
    short, long = load_hyp(SHORT_RUN.hyp_path), load_hyp(LONG_RUN.hyp_path)
    assert long.nbs == LONG_RUN_NBS and (SHORT_RUN.optimizer, LONG_RUN.optimizer) == ("AdamW", "SGD")
    assert short.lr0 < SGD_MIN_LR0 <= long.lr0  # each file's lr0 names its own optimizer
    differing = {key for key, value in short.to_dict().items() if long.to_dict()[key] != value}
    assert differing == OPTIMIZER_KEYS  # augmentation and loss gains are the same whichever auto picks


def _resolved(argv: list[str], images: int | None = None) -> tuple[TrainConfig, str]:
    return resolve_recipe(train_config_from_argv(argv), YOLOV5_RECIPES, images)


def test_defaults_resolve_from_the_run_size_with_one_line() -> None:
    cfg = train_config_from_argv(["--epochs", "60"])
    assert cfg.optimizer == AUTO and cfg.hyp is None and needs_image_count(cfg)
    short, line = resolve_recipe(cfg, YOLOV5_RECIPES, 400)
    assert (short.optimizer, short.hyp_path, short.hyp) == ("AdamW", QUICKSTART_HYP, load_hyp(QUICKSTART_HYP))
    assert line == (
        "optimizer auto -> AdamW lr0 0.001 nbs 16 (data/hyps/hyp.quickstart.yaml): 1,500 optimizer steps "
        f"(400 images / batch 16 x 60 epochs); SGD at nominal batch 64 would get 420 < {AUTO_SGD_MIN_STEPS:,} "
        "(AUTO_SGD_MIN_STEPS)"
    )
    long, line = _resolved(["--epochs", "300", "--batch-size", "64"], 118_287)
    assert (long.optimizer, long.hyp_path, long.hyp.nbs) == ("SGD", DEFAULT_HYP, 64)
    assert line.startswith("optimizer auto -> SGD lr0 0.01 nbs 64 (data/hyps/hyp.scratch-low.yaml): 554,700 ")
    assert resolve_recipe(long, YOLOV5_RECIPES)[0] == long  # a resolved config has nothing left to choose
    with pytest.raises(ValueError, match="need the number of train images"):
        resolve_recipe(cfg, YOLOV5_RECIPES)


def test_explicit_optimizer_wins_and_brings_its_recipe_file() -> None:
    for optimizer, path in (("AdamW", QUICKSTART_HYP), ("Adam", QUICKSTART_HYP), ("SGD", DEFAULT_HYP)):
        cfg, line = _resolved(["--optimizer", optimizer, "--epochs", "300"], None)  # no count needed
        assert (cfg.optimizer, cfg.hyp_path, cfg.hyp) == (optimizer, path, load_hyp(path))
        assert line.startswith("hyp auto -> ") and line.endswith(f"the recipe file for --optimizer {optimizer}")
    given = ["--optimizer", "Adam", "--hyp", str(DEFAULT_HYP)]
    cfg, line = _resolved(given)
    assert cfg == train_config_from_argv(given) and "--optimizer and --hyp given" in line


def test_explicit_hyp_wins_and_picks_the_optimizer_its_lr0_was_tuned_for(tmp_path: Path) -> None:
    sgd, line = _resolved(["--hyp", str(DEFAULT_HYP)])  # a tiny run would pick AdamW by size
    assert (sgd.optimizer, sgd.hyp_path, sgd.hyp) == ("SGD", DEFAULT_HYP, load_hyp(DEFAULT_HYP))
    assert line.startswith("optimizer auto -> SGD lr0 0.01 nbs 64") and "SGD learning rate" in line
    adamw, _ = _resolved(["--hyp", str(QUICKSTART_HYP), "--epochs", "100000"])  # a huge run would pick SGD
    assert (adamw.optimizer, adamw.hyp.lr0) == ("AdamW", 0.001)


def _yolov5_hyp_file(tmp_path: Path) -> Path:
    """YOLOv5's hyp.scratch-low.yaml as YOLOv5 ships it: no nbs, label_smoothing or fl_gamma."""
    raw = yaml.safe_load(DEFAULT_HYP.read_text())
    for key in ("nbs", "label_smoothing", "fl_gamma"):
        del raw[key]
    path = tmp_path / "hyp.scratch-low.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_a_yolov5_hyp_file_trains_with_sgd_whatever_its_lr0(tmp_path: Path) -> None:
    # hyp.Objects365.yaml's lr0 is 0.00258, below SGD_MIN_LR0, but it was evolved under YOLOv5's default SGD.
    path = _yolov5_hyp_file(tmp_path)
    path.write_text(path.read_text().replace("lr0: 0.01", "lr0: 0.00258"))
    cfg, line = _resolved(["--hyp", str(path)])
    assert (cfg.optimizer, cfg.hyp.lr0) == ("SGD", 0.00258)
    assert "a YOLOv5 hyp file (no nbs) trains with YOLOv5's default optimizer" in line
    ours = tmp_path / "ours.yaml"  # a file naming its nbs keeps the lr0 rule
    ours.write_text(DEFAULT_HYP.read_text().replace("lr0: 0.01", "lr0: 0.00258"))
    assert _resolved(["--hyp", str(ours)])[0].optimizer == "AdamW"


@pytest.mark.parametrize("global_batch", [8, 16, 32, 64, 128])
def test_yolov5_hyp_file_trains_with_yolov5s_accumulation(tmp_path: Path, global_batch: int) -> None:
    argv = ["--hyp", str(_yolov5_hyp_file(tmp_path)), "--batch-size", str(global_batch), "--imgsz", "64"]
    cfg, _ = _resolved(argv)
    assert cfg.optimizer == "SGD" and cfg.hyp.nbs == 64
    spec = spec_from_cfg("yolov5n", 2)
    torch.manual_seed(0)
    bundle = ModelBundle(build_model(spec), spec, ("a", "b"))
    state = build_train_state(bundle, cfg, DETECT_TRAINING, DistContext(), batches=4)
    assert state.accumulate == max(round(64 / global_batch), 1) == accumulate_steps(global_batch, 64)
    assert isinstance(state.optimizer, torch.optim.SGD)
    decay = state.optimizer.param_groups[1]["weight_decay"]
    assert decay == pytest.approx(cfg.hyp.weight_decay * global_batch * state.accumulate / 64)


def test_label_smoothing_flag_applies_to_the_file_auto_picks() -> None:
    cfg = train_config_from_argv(["--label-smoothing", "0.1"])
    assert cfg.hyp is None and cfg.label_smoothing == 0.1
    assert resolve_recipe(cfg, YOLOV5_RECIPES, 1000)[0].hyp.label_smoothing == pytest.approx(0.1)
    assert resolve_recipe(train_config_from_argv([]), YOLOV5_RECIPES, 1000)[0].hyp.label_smoothing == 0.0


def test_resolved_choice_is_written_to_the_run_folder_and_restores_unchanged(tmp_path: Path) -> None:
    cfg, _ = _resolved(["--epochs", "7"], 1000)
    save_run_config(cfg, tmp_path, DistContext())
    options = yaml.safe_load((tmp_path / "opt.yaml").read_text())
    hyp = yaml.safe_load((tmp_path / "hyp.yaml").read_text())
    assert options["optimizer"] == "AdamW" and options["hyp_path"] == str(QUICKSTART_HYP)
    assert hyp == load_hyp(QUICKSTART_HYP).to_dict()
    restored = config_from_dict({**options, "hyp": hyp})  # what a checkpoint's train_config holds
    assert restored == dataclasses.replace(cfg, explicit=frozenset()) and not needs_image_count(restored)
    # --resume: the stored choice stands, on any world size, whatever the train set or the step count now is.
    assert (
        resolve_run_recipe(restored, _no_data(tmp_path), DistContext(world_size=2), resumed=True, files=YOLOV5_RECIPES)
        == restored
    )
    with pytest.raises(AssertionError, match="resolve the recipe first"):
        save_run_config(train_config_from_argv([]), tmp_path, DistContext())


def _no_data(tmp_path: Path) -> DataConfig:
    """A dataset without splits: resolving a resumed or explicit recipe must not look at the images."""
    return DataConfig(yaml_file=tmp_path / "d.yaml", root=tmp_path, splits={}, names=("a",), annotations={})


def test_run_recipe_counts_the_train_split_only_when_both_are_auto(tmp_path: Path, caplog) -> None:
    images = tmp_path / "images"
    images.mkdir()
    for index in range(5):
        (images / f"{index}.jpg").write_bytes(b"")  # listed, not read: the rule counts the split's files
    data = DataConfig(tmp_path / "d.yaml", tmp_path, {"train": (images,)}, ("a",), {})
    with caplog.at_level(logging.INFO, logger="utils.train.plan"):
        cfg = resolve_run_recipe(
            train_config_from_argv(["--batch-size", "2"]), data, DistContext(), resumed=False, files=YOLOV5_RECIPES
        )
    assert cfg.optimizer == "AdamW" and "(5 images / batch 2 x 20 epochs)" in caplog.text
    explicit = train_config_from_argv(["--optimizer", "SGD"])
    assert (
        resolve_run_recipe(explicit, _no_data(tmp_path), DistContext(), resumed=False, files=YOLOV5_RECIPES).hyp_path
        == DEFAULT_HYP
    )
