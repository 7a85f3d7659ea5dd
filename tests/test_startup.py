"""Tests for utils/train/startup.py: the time since process start, and the first-step line logged once."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from utils.distributed import DistContext
from utils.train.startup import StartupClock, process_seconds

REPO_ROOT = Path(__file__).resolve().parent.parent


def test_process_seconds_counts_from_the_process_start_not_from_the_import() -> None:
    # The child sleeps before it imports the module: a clock started at the import would read about 0.
    code = "import time; time.sleep(1.0); from utils.train.startup import process_seconds; print(process_seconds())"
    launched = time.monotonic()
    output = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    waited = time.monotonic() - launched
    # The child cannot have lived longer than this process waited for it, however slowly a loaded machine ran it
    # (give or take /proc's resolution: one clock tick each for the start time and the uptime).
    assert 1.0 <= float(output.stdout) <= waited + 2 / os.sysconf("SC_CLK_TCK")
    assert process_seconds() > 0


def test_the_first_step_is_logged_once_on_rank_0_only(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="utils.train.startup")
    clock = StartupClock()
    clock.first_step(0.3, DistContext())
    first = clock.first_step_seconds
    clock.first_step(9.0, DistContext())
    lines = [record.getMessage() for record in caplog.records]
    assert len(lines) == 1 and lines[0].startswith("start-up: first optimizer step ")
    assert lines[0].endswith(" s after the process started (0.3 s of it waiting for the first batches)")
    assert first is not None and clock.first_step_seconds == first  # the first step's time is kept
    caplog.clear()
    StartupClock().first_step(0.25, DistContext(rank=1, world_size=2))
    assert not caplog.records  # other ranks keep quiet
