"""Start-up time: seconds from this process's start to the run's first optimizer step, logged once on rank 0."""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # not imported at run time: a process can time itself before it imports torch
    from utils.distributed import DistContext

LOGGER = logging.getLogger(__name__)

_IMPORTED = time.monotonic()  # the fallback origin where the process's own start time cannot be read


def process_seconds() -> float:
    """Seconds since this process started (Linux: its start time in /proc), else since this module was imported.

    Counts interpreter start-up and imports, which a timer started in `main` would miss: the
    figure a user comparing trainers sees from launch.
    """
    try:
        with open("/proc/self/stat") as stat, open("/proc/uptime") as uptime:
            # Field 22: the start in clock ticks after boot; the name (field 2) may hold spaces: split after it.
            start_ticks = int(stat.read().rsplit(")", 1)[1].split()[19])
            since_boot = float(uptime.read().split()[0])
        return since_boot - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.monotonic() - _IMPORTED


class StartupClock:
    """Logs, at the first optimizer step of a run, how long after process start it came (`first_step`)."""

    def __init__(self) -> None:
        self.first_step_seconds: float | None = None

    def first_step(self, data_wait_seconds: float, ctx: DistContext) -> None:
        """Call after every optimizer step; the first call logs the start-up line on rank 0, later ones do nothing.

        `data_wait_seconds`: how long the loop had waited for batches by then (the first batches' share).
        """
        if self.first_step_seconds is not None:
            return
        self.first_step_seconds = process_seconds()
        if ctx.is_main:
            LOGGER.info(
                f"start-up: first optimizer step {self.first_step_seconds:.1f} s after the process started "
                f"({data_wait_seconds:.1f} s of it waiting for the first batches)"
            )
