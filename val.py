"""Validate a detection checkpoint on a dataset YAML: `python val.py --weights runs/train/exp/weights/best.pt`."""

from __future__ import annotations

from typing import Any

from utils.cli.val import val_main, val_run
from utils.errors import exit_on_user_error
from utils.eval.evaluate import EvalResult
from utils.tasks import DETECT, Task


def main(argv: list[str] | None = None, task: Task = DETECT) -> EvalResult:
    """Parse the flags and validate the checkpoint; prints the results table on rank 0."""
    return val_main(argv, task)


def run(**options: Any) -> EvalResult:
    """Validate from Python with val.py's flags as keywords: `val.run(weights="best.pt", data="coco.yaml")`.

    Returns the EvalResult (`as_dict()`: P, R, mAP50, mAP50-95, fitness); errors raise ConfigError.
    """
    return val_run(options, DETECT)


if __name__ == "__main__":
    exit_on_user_error(main)
