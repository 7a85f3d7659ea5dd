"""Tests for utils/families.py: the Family record, how models, specs and checkpoints find their family."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from torch import nn

from models.yolo import ModelSpec, build_model, spec_from_cfg
from utils.boxes import non_max_suppression
from utils.checkpoint import RunInfo, build_checkpoint, load_checkpoint, save_checkpoint
from utils.config import DEFAULT_HYP
from utils.distributed import DistContext
from utils.errors import ConfigError
from utils.families import (
    FAMILIES,
    YOLOV5,
    checkpoint_family,
    family_of,
    spec_from_checkpoint,
)
from utils.families import (
    spec_from_cfg as family_spec_from_cfg,
)
from utils.hyp import load_hyp
from utils.tasks import DETECT
from utils.train.config import TrainConfig
from utils.train.records import DETECT_TRAINING, FAMILY_TRAINING, YOLOV5_TRAINING
from utils.train.results import EpochSummary


def _tiny_spec(num_classes: int = 3) -> ModelSpec:
    return spec_from_cfg("yolov5n", num_classes)


def test_yolov5_models_specs_and_ddp_wrappers_report_the_yolov5_family() -> None:
    spec = _tiny_spec()
    model = build_model(spec)
    assert family_of(spec) is YOLOV5 and family_of(model) is YOLOV5
    wrapper = nn.Module()
    wrapper.module = model  # what DDP exposes
    assert family_of(wrapper) is YOLOV5
    assert family_of(nn.Linear(2, 2)) is YOLOV5  # a module with no spec is taken as YOLOv5's, as old files are
    assert list(FAMILIES) == ["anchor_free", "yolov5"]  # YOLOv5 last: it claims every --cfg no other family takes


def test_cfg_resolution_through_the_families_equals_the_yolov5_resolver() -> None:
    assert family_spec_from_cfg("yolov5s-seg", 7) == spec_from_cfg("yolov5s-seg", 7)
    # Every family's names and the default, not only YOLOv5's (models/ cannot name the others).
    listed = "yolov8|yolo11|yolo26 + n|s|m|l|x; yolov5n|s|m|l|x, each optionally -seg; yolov5n6|s6|m6|l6|x6; "
    listed += "default yolov8n"
    for cfg in ("resnet50", "missing.yaml"):
        with pytest.raises(ConfigError) as error:
            family_spec_from_cfg(cfg, 7)
        assert str(error.value) == f"--cfg {cfg}: not a YAML file and not a model name ({listed})"
    # A size name's file name in a folder that does not hold it is the user's missing file, not the stock model.
    for cfg in ("models/nope/yolo11s.yaml", "/tmp/nope/yolov5s.yaml", "cfg/s.yaml"):
        with pytest.raises(ConfigError, match=re.escape(f"--cfg {cfg}: file not found")):
            family_spec_from_cfg(cfg, 7)
    assert family_spec_from_cfg("yolov5s.yaml", 7) == spec_from_cfg("yolov5s", 7)  # a name alone, as YOLOv5 reads it
    assert family_spec_from_cfg("yolov5x6.yaml", 7) == spec_from_cfg("yolov5x6", 7)  # the P6 models too


def test_checkpoints_record_the_family_and_older_files_read_as_yolov5(tmp_path: Path) -> None:
    spec = _tiny_spec()
    model = build_model(spec)
    run = RunInfo("detect", spec.to_dict(), ["a", "b", "c"], {}, {}, spec.family)
    checkpoint = build_checkpoint(
        run=run, model=model, ema=None, optimizer=None, scaler=None, epoch=0, best_fitness=0.0
    )
    assert checkpoint["model_family"] == "yolov5"
    save_checkpoint(checkpoint, tmp_path / "a.pt", DistContext())
    loaded = load_checkpoint(tmp_path / "a.pt")
    assert spec_from_checkpoint(loaded) == spec
    del loaded["model_family"]  # a file written before families were recorded
    assert checkpoint_family(loaded) is YOLOV5 and spec_from_checkpoint(loaded) == spec
    loaded["model_family"] = "yolov99"
    with pytest.raises(ConfigError, match=r"^best\.pt: unknown model family 'yolov99' \(known: anchor_free, yolov5\)$"):
        spec_from_checkpoint(loaded, "best.pt")


def test_family_loss_keys_may_be_absent_from_a_file_but_the_family_checks_its_own(tmp_path: Path) -> None:
    raw = yaml.safe_load(DEFAULT_HYP.read_text())
    del raw["anchor_t"]
    path = tmp_path / "hyp.noanchor.yaml"
    path.write_text(yaml.safe_dump(raw))
    hyp = load_hyp(path)  # which keys are needed depends on the model, not known while reading the file
    assert hyp.anchor_t is None and "anchor_t" not in hyp.to_dict() and "dfl" not in hyp.to_dict()
    with pytest.raises(ConfigError, match=r"hyp\.noanchor\.yaml: missing hyperparameter 'anchor_t', which yolov5"):
        YOLOV5_TRAINING.check_hyp(hyp, path)
    YOLOV5_TRAINING.check_hyp(load_hyp(DEFAULT_HYP), DEFAULT_HYP)  # YOLOv5's own file has every key
    # YOLOv5's file given to an anchor-free model: the error says which files fit instead.
    with pytest.raises(ConfigError) as error:
        FAMILY_TRAINING["anchor_free"].check_hyp(load_hyp(DEFAULT_HYP), DEFAULT_HYP)
    assert str(error.value) == (
        f"{DEFAULT_HYP}: missing hyperparameter 'dfl', which anchor_free models need (dfl); a hyp file made for "
        "other models (YOLOv5's fit yolov5* models) does not fit: use --hyp auto, or start from "
        "data/hyps/hyp.anchor-free.scratch.yaml or data/hyps/hyp.anchor-free.quickstart.yaml"
    )


def test_yolov5_family_builds_the_yolov5_loss_with_its_items() -> None:
    model = build_model(_tiny_spec())
    loss_fn = DETECT_TRAINING.build_loss(model, TrainConfig(hyp=load_hyp(DEFAULT_HYP), imgsz=64))
    assert loss_fn.item_names == ("box", "obj", "cls")
    outputs = model(torch.zeros(1, 3, 64, 64))
    loss, items = loss_fn(outputs, torch.tensor([[0.0, 1.0, 0.5, 0.5, 0.2, 0.3]]))
    assert torch.isfinite(loss).all() and items.shape == (3,)


def test_nms_without_objectness_takes_the_class_score_as_confidence() -> None:
    # Two overlapping boxes of class 1 and one of class 0; rows [cx, cy, w, h, p0, p1] (no objectness column).
    rows = torch.tensor(
        [
            [50.0, 50.0, 20.0, 20.0, 0.1, 0.9],
            [51.0, 50.0, 20.0, 20.0, 0.2, 0.6],
            [10.0, 10.0, 8.0, 8.0, 0.7, 0.05],
        ]
    )[None]
    [kept] = non_max_suppression(rows, conf_thres=0.25, iou_thres=0.5, objectness=False)
    assert kept[:, 5].tolist() == [1.0, 0.0]  # the weaker class-1 box is suppressed
    assert kept[:, 4].tolist() == pytest.approx([0.9, 0.7])
    assert kept[0, :4].tolist() == pytest.approx([40.0, 40.0, 60.0, 60.0])
    # The same rows read with an objectness column would have one class fewer and other scores.
    [with_obj] = non_max_suppression(rows, conf_thres=0.25, iou_thres=0.5)
    assert with_obj[:, 4].tolist() != kept[:, 4].tolist()


def test_results_rows_take_the_loss_names_of_the_run() -> None:
    summary = EpochSummary(0, np.array([1.0, 2.0, 3.0]), None, {}, [0.1], 1.0)
    row = summary.as_row(DETECT, ("box", "cls", "dfl"))
    assert row["train/dfl_loss"] == 3.0 and "train/obj_loss" not in row and np.isnan(row["val/cls_loss"])
