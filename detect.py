"""Predict with a detection checkpoint: `python detect.py --weights best.pt --source images/` (or under torchrun)."""

from __future__ import annotations

from typing import Any

from utils.cli.predict import predict_main, predict_run
from utils.errors import exit_on_user_error
from utils.predict.predictor import PredictResult
from utils.tasks import DETECT, Task


def main(argv: list[str] | None = None, task: Task = DETECT) -> PredictResult:
    """Parse the flags and predict on --source; annotated images, videos and labels go to runs/detect/exp."""
    return predict_main(argv, task)


def run(**options: Any) -> PredictResult:
    """Predict from Python with detect.py's flags as keywords: `detect.run(weights="best.pt", source="images/")`.

    Returns the PredictResult (what was written where); for detections as data in memory, load
    the model with torch.hub (hubconf.py). Errors raise ConfigError.
    """
    return predict_run(options, DETECT)


if __name__ == "__main__":
    exit_on_user_error(main)
