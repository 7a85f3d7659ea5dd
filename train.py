"""Train a YOLO detector: `python train.py` (one process) or `torchrun --nproc_per_node N train.py` (DDP)."""

from __future__ import annotations

from typing import Any

from utils.cli.train import train_main, train_run
from utils.errors import exit_on_user_error
from utils.train.records import DETECT_TRAINING, TrainingTask
from utils.train.state import FitResult


def main(argv: list[str] | None = None, task: TrainingTask = DETECT_TRAINING) -> FitResult:
    """Parse the flags, set up the process group and train; returns where the results are."""
    return train_main(argv, task)


def run(callbacks: Any = None, **options: Any) -> FitResult:
    """Train from Python with train.py's flags as keywords: `train.run(data="coco128.yaml", epochs=3, cfg="yolo11n")`.

    Same names (`batch_size` for --batch-size), defaults and checks as the command line; a bad
    option raises ConfigError with the message the command line prints. `callbacks` maps event
    names to functions (docs/python-api.md). Under torchrun every rank calls it, as train.py.
    """
    return train_run(options, DETECT_TRAINING, callbacks)


if __name__ == "__main__":
    exit_on_user_error(main)
