"""train.py and segment/train.py: parse the flags, set up the process group, train; train.run(**flags)."""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from utils.callbacks import Callbacks
from utils.cli import entry
from utils.distributed import DistContext
from utils.errors import ConfigError
from utils.train.config import build_train_parser, train_config_from_argv, validate
from utils.train.engine import fit
from utils.train.records import TrainingTask
from utils.train.state import FitResult


def train_run(options: dict[str, Any], training: TrainingTask, callbacks: Any = None) -> FitResult:
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
    return train_main(entry.keyword_argv(build_train_parser(training.name), options, "train.run"), training, callbacks)


def train_main(argv: list[str] | None, training: TrainingTask, callbacks: Callbacks | None = None) -> FitResult:
    """The whole of train.py / segment/train.py: parse flags, set up the process group, train `training`'s task."""
    if build_train_parser(training.name).parse_args(argv).evolve:  # YOLOv5's spelling of tune.py
        from utils.cli.tune import evolve_argv, tune_main

        return tune_main(evolve_argv(argv, training.name), training)
    cfg = train_config_from_argv(argv, training.name)

    def body(ctx: DistContext) -> FitResult:
        validate(cfg, ctx)
        result = fit(cfg, training, ctx, callbacks)
        if ctx.is_main:
            scores = " ".join(f"{key} {value:.4f}" for key, value in result.metrics.items() if "mAP" in key)
            print(f"Done: {result.describe_epochs()}. Final {scores}. Best weights: {result.best}")
        return result

    return entry.run_entry(cfg.device, body, datetime.timedelta(minutes=cfg.dist_timeout))
