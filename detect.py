"""Predict with a detection checkpoint: `python detect.py --weights best.pt --source images/` (or under torchrun)."""

from __future__ import annotations

from utils.cli import exit_on_user_error, predict_main
from utils.predict.predictor import PredictResult
from utils.tasks import DETECT, Task


def main(argv: list[str] | None = None, task: Task = DETECT) -> PredictResult:
    """Parse the flags and predict on --source; annotated images, videos and labels go to runs/detect/exp."""
    return predict_main(argv, task)


if __name__ == "__main__":
    exit_on_user_error(main)
