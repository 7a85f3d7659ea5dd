"""What every entry point shares: process group up and down around a run, and flags given as Python keywords."""

from __future__ import annotations

import argparse
import copy
import datetime
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from utils.config import flag_words
from utils.distributed import DEFAULT_TIMEOUT, DistContext, cleanup, init_distributed
from utils.errors import ConfigError
from utils.logs import logging_for

T = TypeVar("T")


def run_entry(device: str, body: Callable[[DistContext], T], timeout: datetime.timedelta = DEFAULT_TIMEOUT) -> T:
    """Initialise the process group for `device`, run `body(ctx)`, and always destroy the group.

    Raising inside `body` on any rank ends that rank, and its group is destroyed before the error
    propagates: the others' current or next collective fails at once ("Connection closed by peer"),
    not when this process has shut down. A rank that is stuck but alive ends theirs only at the
    process-group `timeout` (--dist-timeout), never an endless hang.
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
    """Put back `_torch_settings()`'s values; deterministic algorithms only when the run changed them.

    `torch.use_deterministic_algorithms` imports torch._inductor (about 1 s of CPU, several under
    load) in a process that has not yet, and this runs on every exit, failed runs included.
    """
    threads, deterministic, warn_only, benchmark, cudnn_deterministic = settings
    torch.set_num_threads(threads)
    if _torch_settings()[1:3] != (deterministic, warn_only):
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
        argv += flag_words(*actions[key], value, f"{entry}: {key}={value!r}")
    checker = copy.deepcopy(parser)

    def refuse(message: str) -> None:
        raise ConfigError(f"{entry}: {message}")

    checker.error = refuse  # type: ignore[method-assign]
    checker.parse_args(argv)
    return argv
