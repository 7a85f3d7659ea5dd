"""Tune a YOLO detector's hyperparameters on your data: `python tune.py --data my.yaml --cfg yolov8n --trials 30`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from utils.cli.tune import tune_main, tune_run
from utils.errors import exit_on_user_error
from utils.train.records import DETECT_TRAINING

if TYPE_CHECKING:
    from utils.tune.results import StudySummary


def main(argv: list[str] | None = None) -> StudySummary:
    """Parse the flags and run (or resume) the study; each trial is train.py in a fresh process."""
    return tune_main(argv, DETECT_TRAINING)


def run(**options: Any) -> StudySummary:
    """Tune from Python with tune.py's flags as keywords: `tune.run(data="my.yaml", cfg="yolov8n", trials=20)`."""
    return tune_run(options, DETECT_TRAINING)


if __name__ == "__main__":
    exit_on_user_error(main)
