"""Train a YOLO detector: `python train.py` (one process) or `torchrun --nproc_per_node N train.py` (DDP)."""

from __future__ import annotations

from utils.cli import exit_on_user_error, train_main
from utils.tasks import DETECT, Task
from utils.train.engine import FitResult


def main(argv: list[str] | None = None, task: Task = DETECT) -> FitResult:
    """Parse the flags, set up the process group and train; returns where the results are."""
    return train_main(argv, task)


if __name__ == "__main__":
    exit_on_user_error(main)
