"""Shared entry-point plumbing: distributed set-up, logging, one-line errors and clean shutdown."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import TypeVar

from utils.config import ConfigError
from utils.distributed import DistContext, cleanup, init_distributed
from utils.logging import setup_logging

T = TypeVar("T")
LOGGER = logging.getLogger(__name__)


def run_entry(device: str, body: Callable[[DistContext], T]) -> T:
    """Initialise the process group for `device`, run `body(ctx)`, and always destroy the group.

    Raising inside `body` on any rank ends that rank; the others then fail at their next
    collective within the process-group timeout instead of hanging forever.
    """
    ctx = init_distributed(device)
    setup_logging(ctx)
    try:
        return body(ctx)
    finally:
        cleanup()


def exit_on_user_error(main: Callable[[], object]) -> None:
    """Run an entry point's main(); a user mistake (bad flag, missing file) prints one line and exits 2."""
    try:
        main()
    except (ConfigError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
