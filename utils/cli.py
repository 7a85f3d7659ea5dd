"""Shared entry-point plumbing: distributed set-up, logging, one-line errors and clean shutdown."""

from __future__ import annotations

import datetime
import logging
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from utils.config import build_val_parser, train_config_from_argv, val_config_from_args, validate
from utils.distributed import DEFAULT_TIMEOUT, DistContext, cleanup, init_distributed
from utils.errors import ConfigError
from utils.logs import setup_logging

if TYPE_CHECKING:
    from utils.eval.evaluate import EvalResult
    from utils.export import ExportedFile
    from utils.predict.predictor import PredictResult
    from utils.tasks import Task
    from utils.train.engine import FitResult

T = TypeVar("T")
LOGGER = logging.getLogger(__name__)


def run_entry(device: str, body: Callable[[DistContext], T], timeout: datetime.timedelta = DEFAULT_TIMEOUT) -> T:
    """Initialise the process group for `device`, run `body(ctx)`, and always destroy the group.

    Raising inside `body` on any rank ends that rank; the others then fail at their next
    collective within the process-group `timeout` (--dist-timeout) instead of hanging forever.
    """
    ctx = init_distributed(device, timeout)
    setup_logging(ctx)
    try:
        return body(ctx)
    finally:
        cleanup()


def exit_on_user_error(main: Callable[[], object]) -> None:
    """Run an entry point's main(); a user mistake (bad flag, missing file) prints one line and exits 2."""
    from utils.train.faults import REQUEUE_EXIT_CODE, Preempted

    try:
        main()
    except (ConfigError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    except Preempted as stopped:  # the checkpoint is written: tell the job script to requeue
        print(f"preempted: {stopped}", file=sys.stderr)
        sys.exit(REQUEUE_EXIT_CODE)


def train_main(argv: list[str] | None, task: Task) -> FitResult:
    """The whole of train.py / segment/train.py: parse flags, set up the process group, train `task`."""
    from utils.train.engine import fit

    cfg = train_config_from_argv(argv, task.name)

    def body(ctx: DistContext) -> FitResult:
        validate(cfg, ctx)
        result = fit(cfg, task, ctx)
        if ctx.is_main:
            scores = " ".join(f"{key} {value:.4f}" for key, value in result.metrics.items() if "mAP" in key)
            print(f"Done: {result.epochs_run} epochs. Final {scores}. Best weights: {result.best}")
        return result

    return run_entry(cfg.device, body, datetime.timedelta(minutes=cfg.dist_timeout))


def val_main(argv: list[str] | None, task: Task) -> EvalResult:
    """The whole of val.py / segment/val.py: parse flags and validate a `task` checkpoint on every rank."""
    from utils.eval.checkpoint_val import validate_checkpoint

    cfg = val_config_from_args(build_val_parser(task.name).parse_args(argv))
    timeout = datetime.timedelta(minutes=cfg.dist_timeout)
    return run_entry(cfg.device, lambda ctx: validate_checkpoint(cfg, task, ctx), timeout)


def predict_main(argv: list[str] | None, task: Task) -> PredictResult:
    """The whole of detect.py / segment/predict.py: parse flags and predict `task` on --source, sharded over ranks."""
    from utils.predict.config import build_predict_parser, predict_config_from_args
    from utils.predict.predictor import predict

    cfg = predict_config_from_args(build_predict_parser(task.name).parse_args(argv))
    return run_entry(cfg.device, lambda ctx: predict(cfg, task, ctx))


def export_main(argv: list[str] | None, tasks: dict[str, Task]) -> list[ExportedFile]:
    """The whole of export.py: parse flags and export the checkpoint on rank 0 (other ranks do nothing).

    `tasks` maps a checkpoint's `task` field to its Task; export.py passes DETECT and SEGMENT.
    """
    from utils.export import build_export_parser, export_checkpoint, export_config_from_args

    cfg = export_config_from_args(build_export_parser().parse_args(argv))
    return run_entry(cfg.device, lambda ctx: export_checkpoint(cfg, tasks, ctx))
