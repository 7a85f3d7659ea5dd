"""Rank-aware logging set-up (INFO on rank 0, rank-tagged warnings elsewhere) and progress-bar policy."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator

from utils.distributed import DistContext


class _RankFilter(logging.Filter):
    """Prefix records from non-zero ranks with their rank, so a warning says where it came from."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        if self.rank != 0 and not getattr(record, "_rank_tagged", False):
            record.msg = f"[rank {self.rank}] {record.msg}"
            record._rank_tagged = True
        return True


def setup_logging(ctx: DistContext, verbose: bool = False) -> None:
    """Send library logs to stderr: INFO and up on rank 0, WARNING and up (rank-tagged) elsewhere.

    Configures the root logger once per process; calling it again replaces the handler.
    `YOLO_LOG_LEVEL` overrides the level (e.g. DEBUG) on every rank.
    """
    level = logging.DEBUG if verbose else (logging.INFO if ctx.is_main else logging.WARNING)
    level = getattr(logging, os.environ.get("YOLO_LOG_LEVEL", "").upper(), level)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    handler.addFilter(_RankFilter(ctx.rank))
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, "_yolo_handler", False)]:
        root.removeHandler(old)
    handler._yolo_handler = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(level)


@contextlib.contextmanager
def logging_for(ctx: DistContext, verbose: bool = False) -> Iterator[None]:
    """`setup_logging` for the duration of the block, then the root logger's handlers and level as they were."""
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    setup_logging(ctx, verbose)
    try:
        yield
    finally:
        for handler in [h for h in root.handlers if h not in handlers]:
            root.removeHandler(handler)
        for handler in handlers:
            if handler not in root.handlers:
                root.addHandler(handler)
        root.setLevel(level)


def tqdm_disabled(ctx: DistContext) -> bool:
    """Whether to hide progress bars: they show on rank 0 only, and never when the `CI` variable is "true"."""
    return not ctx.is_main or os.environ.get("CI", "").lower() == "true"
