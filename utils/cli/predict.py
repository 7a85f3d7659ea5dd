"""detect.py and segment/predict.py: parse the flags and predict on --source over the ranks; detect.run(**flags)."""

from __future__ import annotations

from typing import Any

from utils.cli import entry
from utils.predict.config import build_predict_parser, predict_config_from_args
from utils.predict.predictor import PredictResult, predict
from utils.tasks import Task


def predict_run(options: dict[str, Any], task: Task) -> PredictResult:
    """detect.run(**options): detect.py's checks and prediction, in this process."""
    return predict_main(entry.keyword_argv(build_predict_parser(task.name), options, "detect.run"), task)


def predict_main(argv: list[str] | None, task: Task) -> PredictResult:
    """The whole of detect.py / segment/predict.py: parse flags and predict `task` on --source, sharded over ranks."""
    cfg = predict_config_from_args(build_predict_parser(task.name).parse_args(argv))
    return entry.run_entry(cfg.device, lambda ctx: predict(cfg, task, ctx))
