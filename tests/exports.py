"""Random-init checkpoints of the named models and their exports, written once per test session.

tests/test_export_matrix.py, tests/test_backends.py, tests/test_openvino.py and tests/test_export_anchor_free.py
read the same files (the same checkpoint, format and options): an OpenVINO conversion alone takes seconds, so
each is done once (per xdist worker) and kept with what its export_checkpoint call logged and traced.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

import utils.export as export
from segment.task import SEGMENT
from tests.conftest import MessageRecorder
from utils.checkpoint import RunInfo, build_checkpoint, save_checkpoint
from utils.data.synthetic import SHAPE_NAMES
from utils.distributed import DistContext
from utils.export import ExportConfig, ExportedFile, export_checkpoint
from utils.families import build_model, spec_from_cfg
from utils.tasks import DETECT, Task

TASKS = {DETECT.name: DETECT, SEGMENT.name: SEGMENT}
IMGSZ = 64
# The models whose --dynamic export of every CPU format the matrix checks and tests/test_backends.py,
# tests/test_openvino.py and tests/test_export_anchor_free.py run at other batches and sizes.
DYNAMIC = ("yolov5n", "yolov8n", "yolov8n-seg", "yolo11n-seg")


def save_random_checkpoint(name: str, task: Task, path: Path) -> Path:
    """A random-init `name` model for the six shape classes, saved as training saves it (trained at 64 px).

    The head's weights get noise: a fresh head starts at one prior for all classes, and scores tied
    across classes would be ranked in whatever order each runtime likes.
    """
    torch.manual_seed(0)
    spec = spec_from_cfg(name, len(SHAPE_NAMES))
    model = build_model(spec)
    with torch.no_grad():
        for parameter in model.head.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    run = RunInfo(
        task=task.name, model_spec=spec.to_dict(), names=list(SHAPE_NAMES), train_config={"imgsz": IMGSZ}, hyp={},
        model_family=spec.family,
    )  # fmt: skip
    state = build_checkpoint(run=run, model=model, ema=None, optimizer=None, scaler=None, epoch=0,
                             best_fitness=0.0)  # fmt: skip
    save_checkpoint(state, path, DistContext())
    return path


def cpu_formats() -> tuple[str, ...]:
    """TorchScript, and ONNX and OpenVINO where their runtimes are installed: every format a CPU runs."""
    formats = ["torchscript"]
    for package, file_format in (("onnxruntime", "onnx"), ("openvino", "openvino")):
        try:
            __import__(package)
        except ImportError:
            continue
        formats.append(file_format)
    return tuple(formats)


def task_of(name: str) -> Task:
    return SEGMENT if name.endswith("-seg") else DETECT


@dataclass(frozen=True)
class Export:
    """One export_checkpoint call of a random checkpoint: its files and what the call logged and traced."""

    weights: Path
    exported: list[ExportedFile]
    messages: list[str] = field(repr=False)  # utils.export's INFO lines during the call
    traces: int  # trace_export_graph calls during the call

    @property
    def files(self) -> dict[str, Path]:
        """{"pt": best.pt, format: its file or folder} in export order."""
        return {"pt": self.weights, **{item.file_format: item.path for item in self.exported}}


class Exports:
    """Exports of random checkpoints, one per (model, formats, options); the files must be treated as read-only."""

    def __init__(self, factory: pytest.TempPathFactory) -> None:
        self._factory = factory
        self._done: dict[tuple[object, ...], Export] = {}

    def get(self, name: str, formats: tuple[str, ...], *, dynamic: bool = False, nms: bool = False) -> Export:
        key = (name, formats, dynamic, nms)
        if key not in self._done:
            folder = self._factory.mktemp(f"{name}-{'-'.join(formats)}{'-dynamic' if dynamic else ''}"
                                          f"{'-nms' if nms else ''}")  # fmt: skip
            weights = save_random_checkpoint(name, task_of(name), folder / "best.pt")
            self._done[key] = _export(ExportConfig(weights, formats, dynamic=dynamic, nms=nms))
        return self._done[key]


def _export(cfg: ExportConfig) -> Export:
    traced = []
    trace = export.trace_export_graph
    logger = logging.getLogger("utils.export")
    handler, level = MessageRecorder(), logger.level
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(export, "trace_export_graph", lambda *args: traced.append(1) or trace(*args))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        try:
            exported = export_checkpoint(cfg, TASKS, DistContext())
        finally:
            logger.removeHandler(handler)
            logger.setLevel(level)
    return Export(cfg.weights, exported, handler.messages, len(traced))
