"""Shared entry-point plumbing: distributed set-up, logging, one-line errors, clean shutdown, keyword calls."""

from __future__ import annotations

import argparse
import copy
import datetime
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist

from utils.callbacks import Callbacks
from utils.config import build_train_parser, build_val_parser, train_config_from_argv, val_config_from_args, validate
from utils.distributed import DEFAULT_TIMEOUT, DistContext, cleanup, init_distributed
from utils.errors import ConfigError
from utils.eval.checkpoint_val import validate_checkpoint
from utils.eval.evaluate import EvalResult
from utils.export import ExportedFile, build_export_parser, export_checkpoint, export_config_from_args
from utils.logs import logging_for
from utils.predict.config import build_predict_parser, predict_config_from_args
from utils.predict.predictor import PredictResult, predict
from utils.train.engine import fit
from utils.train.state import FitResult

if TYPE_CHECKING:
    from utils.tasks import Task

T = TypeVar("T")
LOGGER = logging.getLogger(__name__)


def run_entry(device: str, body: Callable[[DistContext], T], timeout: datetime.timedelta = DEFAULT_TIMEOUT) -> T:
    """Initialise the process group for `device`, run `body(ctx)`, and always destroy the group.

    Raising inside `body` on any rank ends that rank; the others then fail at their next
    collective within the process-group `timeout` (--dist-timeout) instead of hanging forever.
    Called from Python (train.run, ...), it leaves the process as it found it: a process group
    that existed before is kept, and the logging set-up and torch's process-wide settings (thread
    count, deterministic algorithms, cuDNN flags) are restored.
    """
    group_existed = dist.is_available() and dist.is_initialized()
    settings = _torch_settings()
    try:
        ctx = init_distributed(device, timeout)
        with logging_for(ctx):
            return body(ctx)
    finally:
        if not group_existed:
            cleanup()
        _restore_torch_settings(settings)


def _torch_settings() -> tuple[int, bool, bool, bool, bool]:
    """torch's process-wide settings a run may change: threads, deterministic algorithms (and warn-only), cuDNN."""
    cudnn = torch.backends.cudnn
    return (torch.get_num_threads(), torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(), cudnn.benchmark, cudnn.deterministic)  # fmt: skip


def _restore_torch_settings(settings: tuple[int, bool, bool, bool, bool]) -> None:
    threads, deterministic, warn_only, benchmark, cudnn_deterministic = settings
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
    torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = benchmark, cudnn_deterministic


def keyword_argv(parser: argparse.ArgumentParser, options: Mapping[str, Any], entry: str) -> list[str]:
    """Return the command line giving `parser` the keyword `options`, checked as the command line is checked.

    A keyword is a flag's name without the dashes, `-` written `_` (`batch_size=16`, `cfg="yolo11n"`,
    `img=640`); switches take True/False, list flags a list or one value, and None leaves the
    default. An unknown keyword, or a value the flag refuses, raises a ConfigError carrying the
    command line's own message, prefixed by `entry` (e.g. "train.run").
    """
    actions = {}
    for action in parser._actions:
        for option in action.option_strings:
            if option.startswith("--"):
                actions[option[2:].replace("-", "_")] = (option, action)
    argv: list[str] = []
    for key, value in options.items():
        if key not in actions or isinstance(actions[key][1], argparse._HelpAction):
            known = ", ".join(sorted(name for name, (_, action) in actions.items() if action.dest != "help"))
            raise ConfigError(f"{entry}: unknown option {key!r}; known: {known}")
        argv += _flag_argv(*actions[key], value, f"{entry}: {key}={value!r}")
    checker = copy.deepcopy(parser)

    def refuse(message: str) -> None:
        raise ConfigError(f"{entry}: {message}")

    checker.error = refuse  # type: ignore[method-assign]
    checker.parse_args(argv)
    return argv


def _flag_argv(option: str, action: argparse.Action, value: Any, where: str) -> list[str]:
    """The command-line words giving flag `option` (of `action`) the Python `value`."""
    if value is None:
        return []
    if isinstance(action, argparse.BooleanOptionalAction):
        if not isinstance(value, bool):
            raise ConfigError(f"{where} must be True or False")
        return [option if value else "--no-" + option[2:]]
    if action.nargs == 0:  # store_true
        if not isinstance(value, bool):
            raise ConfigError(f"{where} must be True or False")
        return [option] if value else []
    if action.nargs in ("+", "*"):
        values = list(value) if isinstance(value, list | tuple) else [value]
        return [option, *map(str, values)] if values else []
    if action.nargs == "?" and isinstance(value, bool):  # --cache / --resume alone
        return [option] if value else []
    return [option, str(value)]


def train_run(options: dict[str, Any], task: Task, callbacks: Any = None) -> FitResult:
    """train.run(**options): the command line's checks and training, in this process.

    `callbacks` is {event: function or functions} or a `Callbacks`; module names (the
    --callbacks flag) may be given as a string or list of strings instead.
    """
    if isinstance(callbacks, str | Path | list | tuple):
        options, callbacks = {**options, "callbacks": callbacks}, None
    if callbacks is not None and not isinstance(callbacks, Callbacks):
        if not isinstance(callbacks, Mapping):
            raise ConfigError(
                f"train.run: callbacks must be a dict of event -> function, not {type(callbacks).__name__}"
            )
        callbacks = Callbacks.from_mapping(callbacks)
    return train_main(keyword_argv(build_train_parser(task.name), options, "train.run"), task, callbacks)


def val_run(options: dict[str, Any], task: Task) -> EvalResult:
    """val.run(**options): val.py's checks and validation, in this process."""
    return val_main(keyword_argv(build_val_parser(task.name), options, "val.run"), task)


def predict_run(options: dict[str, Any], task: Task) -> PredictResult:
    """detect.run(**options): detect.py's checks and prediction, in this process."""
    return predict_main(keyword_argv(build_predict_parser(task.name), options, "detect.run"), task)


def export_run(options: dict[str, Any], tasks: dict[str, Task]) -> list[ExportedFile]:
    """export.run(**options): export.py's checks and export, in this process."""
    return export_main(keyword_argv(build_export_parser(), options, "export.run"), tasks)


def train_main(argv: list[str] | None, task: Task, callbacks: Callbacks | None = None) -> FitResult:
    """The whole of train.py / segment/train.py: parse flags, set up the process group, train `task`."""
    cfg = train_config_from_argv(argv, task.name)

    def body(ctx: DistContext) -> FitResult:
        validate(cfg, ctx)
        result = fit(cfg, task, ctx, callbacks)
        if ctx.is_main:
            scores = " ".join(f"{key} {value:.4f}" for key, value in result.metrics.items() if "mAP" in key)
            print(f"Done: {result.epochs_run} epochs. Final {scores}. Best weights: {result.best}")
        return result

    return run_entry(cfg.device, body, datetime.timedelta(minutes=cfg.dist_timeout))


def val_main(argv: list[str] | None, task: Task) -> EvalResult:
    """The whole of val.py / segment/val.py: parse flags and validate a `task` checkpoint on every rank."""
    cfg = val_config_from_args(build_val_parser(task.name).parse_args(argv))
    timeout = datetime.timedelta(minutes=cfg.dist_timeout)
    return run_entry(cfg.device, lambda ctx: validate_checkpoint(cfg, task, ctx), timeout)


def predict_main(argv: list[str] | None, task: Task) -> PredictResult:
    """The whole of detect.py / segment/predict.py: parse flags and predict `task` on --source, sharded over ranks."""
    cfg = predict_config_from_args(build_predict_parser(task.name).parse_args(argv))
    return run_entry(cfg.device, lambda ctx: predict(cfg, task, ctx))


def export_main(argv: list[str] | None, tasks: dict[str, Task]) -> list[ExportedFile]:
    """The whole of export.py: parse flags and export the checkpoint on rank 0 (other ranks do nothing).

    `tasks` maps a checkpoint's `task` field to its Task; export.py passes DETECT and SEGMENT.
    """
    cfg = export_config_from_args(build_export_parser().parse_args(argv))
    return run_entry(cfg.device, lambda ctx: export_checkpoint(cfg, tasks, ctx))
