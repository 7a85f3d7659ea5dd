"""Validate a detection checkpoint on a dataset YAML: `python val.py --weights runs/train/exp/weights/best.pt`."""

from __future__ import annotations

from utils.cli import exit_on_user_error, val_main
from utils.eval.evaluate import EvalResult
from utils.tasks import DETECT, Task


def main(argv: list[str] | None = None, task: Task = DETECT) -> EvalResult:
    """Parse the flags and validate the checkpoint; prints the results table on rank 0."""
    return val_main(argv, task)


if __name__ == "__main__":
    exit_on_user_error(main)
