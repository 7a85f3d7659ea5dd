"""Rank-aware logging set-up and the per-epoch results CSV."""

from __future__ import annotations

import csv
import logging
import os
import sys
from pathlib import Path

from utils.distributed import DistContext

ROOT_LOGGER = "yolo"


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


def tqdm_disabled(ctx: DistContext) -> bool:
    """Progress bars are shown on rank 0 only, and never when stderr is not a terminal in CI."""
    return not ctx.is_main or os.environ.get("CI", "").lower() == "true"


class ResultsCSV:
    """Append one row per epoch to results.csv on rank 0; other ranks do nothing.

    The header is written with the first row; a resumed run appends to the existing file.
    """

    def __init__(self, path: Path, ctx: DistContext) -> None:
        self.path = path
        self.is_writer = ctx.is_main

    def append(self, row: dict[str, float | int | str]) -> None:
        """Write `row` (column -> value); columns are fixed by the first row written."""
        if not self.is_writer:
            return
        is_new = not self.path.exists() or self.path.stat().st_size == 0
        with self.path.open("a", newline="", encoding="utf-8") as file:
            writer = csv.writer(file)
            if is_new:
                writer.writerow(list(row))
            writer.writerow([f"{v:.6g}" if isinstance(v, float) else v for v in row.values()])

    def read(self) -> list[dict[str, str]]:
        """Return the rows written so far (for plots and tests)."""
        if not self.path.exists():
            return []
        with self.path.open(newline="", encoding="utf-8") as file:
            return list(csv.DictReader(file))
