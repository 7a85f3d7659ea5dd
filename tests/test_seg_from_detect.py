"""segment/train.py --weights <a detection checkpoint>: the shared layers transfer; resume and val stay task-checked."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from segment.task import SEGMENT
from utils.backends import BackendRequest, load_backend
from utils.checkpoint import RunInfo, build_checkpoint, load_checkpoint, save_checkpoint
from utils.data.data_config import DataConfig
from utils.distributed import DistContext
from utils.errors import ConfigError
from utils.families import build_model, spec_from_cfg
from utils.hyp import load_hyp
from utils.tasks import DETECT, Task
from utils.train.config import TrainConfig
from utils.train.plan import RunPlan, plan_model, resolve_resume
from utils.train.records import family_training
from utils.train.setup import build_model_bundle

REPO = Path(__file__).resolve().parents[1]
NAMES = ("a", "b", "c")
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _checkpoint(path: Path, task: Task, cfg: str, resumable: bool = False) -> Path:
    """Save a randomly initialised `cfg` model of `task` with NAMES as its classes (with optimizer state: a last.pt)."""
    torch.manual_seed(1)
    spec = task.spec_from_cfg(cfg, len(NAMES))
    model = build_model(spec)
    run = RunInfo(task=task.name, model_spec=spec.to_dict(), names=list(NAMES), train_config={}, hyp={},
                  model_family=spec.family)  # fmt: skip
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01) if resumable else None
    state = build_checkpoint(run=run, model=model, ema=None, optimizer=optimizer, scaler=None, epoch=0,
                             best_fitness=0)  # fmt: skip
    save_checkpoint(state, path, DistContext())
    return path


def _cfg(**options: object) -> TrainConfig:
    hyp = load_hyp(REPO / "data" / "hyps" / "hyp.anchor-free.quickstart.yaml")
    return TrainConfig(hyp=hyp, channels_last=False, imgsz=64, **options)


def test_a_segmenter_fine_tunes_from_detection_weights(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    weights_file = _checkpoint(tmp_path / "det.pt", DETECT, "yolov8n")
    cfg = _cfg(weights=str(weights_file))
    spec, weights = plan_model(cfg, SEGMENT, NAMES, resume=None)
    assert spec == spec_from_cfg("yolov8n-seg", len(NAMES))
    data = DataConfig(yaml_file=tmp_path / "d.yaml", root=tmp_path, splits={}, names=NAMES, annotations={})
    plan = RunPlan(cfg, data, NAMES, spec, family_training(spec), weights=weights)
    state = build_model_bundle(plan, DistContext()).model.state_dict()
    detection = load_checkpoint(weights_file)["model"]
    shared = [key for key in detection if key in state]
    assert len(shared) == len(detection) == 356 and len(state) == 418  # every detection tensor; the mask branches not
    for key in shared:  # the checkpoint's, not the run's seed-0 initialisation (it was saved from seed 1)
        torch.testing.assert_close(state[key], detection[key], msg=key)
    assert {"backbone.stem.conv.weight", "head.class_branches.2.2.weight"} <= set(shared)
    assert "Transferred 356/418 tensors from" in caplog.text and "is a detection checkpoint" in caplog.text


def test_wrong_task_checkpoints_are_still_refused_for_resume_and_the_other_direction(tmp_path: Path) -> None:
    detection = _checkpoint(tmp_path / "run" / "weights" / "last.pt", DETECT, "yolov8n", resumable=True)
    with pytest.raises(ConfigError, match=r"is a detect checkpoint, not a segment one; use train.py$"):
        resolve_resume(_cfg(resume=str(detection), task="segment"), DistContext(), restart=0)
    request = BackendRequest(task="segment", script="val", device=torch.device("cpu"))  # what segment/val.py asks
    with pytest.raises(ConfigError, match=r"is a detect checkpoint, not a segment one; use val.py$"):
        load_backend(detection, request)
    segmentation = _checkpoint(tmp_path / "seg.pt", SEGMENT, "yolov8n-seg")
    with pytest.raises(ConfigError, match=r"is a segment checkpoint, not a detect one; use segment/train.py$"):
        plan_model(_cfg(weights=str(segmentation)), DETECT, NAMES, resume=None)


def test_resuming_another_tasks_checkpoint_is_refused_before_the_resuming_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    last = _checkpoint(tmp_path / "run" / "weights" / "last.pt", SEGMENT, "yolov8n-seg", resumable=True)
    with pytest.raises(ConfigError, match=r"is a segment checkpoint, not a detect one; use segment/train.py$"):
        resolve_resume(_cfg(resume=str(last), task="detect"), DistContext(), restart=0)
    assert "Resuming" not in caplog.text
