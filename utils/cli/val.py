"""val.py and segment/val.py: parse the flags and validate a checkpoint on every rank; val.run(**flags)."""

from __future__ import annotations

import datetime
from typing import Any

from utils.cli import entry
from utils.eval.checkpoint_val import validate_checkpoint
from utils.eval.config import build_val_parser, val_config_from_args
from utils.eval.evaluate import EvalResult
from utils.tasks import Task


def val_run(options: dict[str, Any], task: Task) -> EvalResult:
    """val.run(**options): val.py's checks and validation, in this process."""
    return val_main(entry.keyword_argv(build_val_parser(task.name), options, "val.run"), task)


def val_main(argv: list[str] | None, task: Task) -> EvalResult:
    """The whole of val.py / segment/val.py: parse flags and validate a `task` checkpoint on every rank."""
    cfg = val_config_from_args(build_val_parser(task.name).parse_args(argv))
    timeout = datetime.timedelta(minutes=cfg.dist_timeout)
    return entry.run_entry(cfg.device, lambda ctx: validate_checkpoint(cfg, task, ctx), timeout)
