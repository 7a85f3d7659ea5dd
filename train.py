"""Train a YOLO detector: `python train.py` (one process) or `torchrun --nproc_per_node N train.py` (DDP)."""

from __future__ import annotations

from utils.cli import exit_on_user_error, run_entry
from utils.config import build_train_parser, config_from_args, validate
from utils.engine import FitResult, fit
from utils.tasks import DETECT, Task


def main(argv: list[str] | None = None, task: Task = DETECT) -> FitResult:
    """Parse the flags, set up the process group and train; returns where the results are."""
    args = build_train_parser(task.name).parse_args(argv)
    cfg = config_from_args(args, task.name)

    def body(ctx):
        validate(cfg, ctx)
        result = fit(cfg, task, ctx)
        if ctx.is_main:
            print(
                f"Done: {result.epochs_run} epochs. Final mAP50 {result.metrics['mAP50']:.4f} "
                f"mAP50-95 {result.metrics['mAP50-95']:.4f}. Best weights: {result.best}"
            )
        return result

    return run_entry(cfg.device, body)


if __name__ == "__main__":
    exit_on_user_error(main)
