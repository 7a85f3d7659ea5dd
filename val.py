"""Validate a detection checkpoint on a dataset YAML: `python val.py --weights runs/train/exp/weights/best.pt`."""

from __future__ import annotations

from utils.cli import exit_on_user_error, run_entry
from utils.config import build_val_parser, val_config_from_args
from utils.evaluate import EvalResult
from utils.tasks import DETECT, Task
from utils.val_run import validate_checkpoint


def main(argv: list[str] | None = None, task: Task = DETECT) -> EvalResult:
    """Parse the flags and validate the checkpoint; prints the results table on rank 0."""
    cfg = val_config_from_args(build_val_parser(task.name).parse_args(argv))
    return run_entry(cfg.device, lambda ctx: validate_checkpoint(cfg, task, ctx))


if __name__ == "__main__":
    exit_on_user_error(main)
