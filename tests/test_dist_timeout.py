"""--dist-timeout: parsed and checked on train/val, passed by the entry points to the process group it bounds."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import utils.cli.entry
import utils.cli.train
import utils.cli.val
from tests.dist_helpers import PROCESS_TIMEOUT_S, free_port
from utils.errors import ConfigError
from utils.eval.config import build_val_parser, val_config_from_args
from utils.tasks import DETECT
from utils.train.config import build_train_parser, config_from_args
from utils.train.records import DETECT_TRAINING


def test_dist_timeout_defaults_to_30_minutes_and_parses_minutes() -> None:
    assert config_from_args(build_train_parser().parse_args([])).dist_timeout == 30.0
    assert val_config_from_args(build_val_parser().parse_args(["--weights", "w.pt"])).dist_timeout == 30.0
    assert config_from_args(build_train_parser().parse_args(["--dist-timeout", "90"])).dist_timeout == 90.0
    val = val_config_from_args(build_val_parser().parse_args(["--weights", "w.pt", "--dist-timeout", "0.5"]))
    assert val.dist_timeout == 0.5


@pytest.mark.parametrize("value", ["0", "-5", "nan", "inf"])
def test_dist_timeout_must_be_a_positive_number_of_minutes(value: str) -> None:
    with pytest.raises(ConfigError, match=r"^--dist-timeout \S+ must be a positive number of minutes") as train:
        config_from_args(build_train_parser().parse_args(["--dist-timeout", value]))
    with pytest.raises(ConfigError, match=r"^--dist-timeout") as val:
        val_config_from_args(build_val_parser().parse_args(["--weights", "w.pt", "--dist-timeout", value]))
    assert "\n" not in str(train.value) and str(train.value) == str(val.value)


def test_train_and_val_entry_points_hand_the_timeout_to_run_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    # Only the hand-over is checked here (nothing runs); the test below checks that run_entry's group obeys it.
    received: list[datetime.timedelta] = []

    def recording_run_entry(device: str, body: Any, timeout: datetime.timedelta) -> None:
        received.append(timeout)

    monkeypatch.setattr(utils.cli.entry, "run_entry", recording_run_entry)
    utils.cli.train.train_main(["--dist-timeout", "0.5"], DETECT_TRAINING)
    utils.cli.val.val_main(["--weights", "w.pt", "--dist-timeout", "7"], DETECT)
    utils.cli.val.val_main(["--weights", "w.pt"], DETECT)
    assert received == [datetime.timedelta(seconds=30), datetime.timedelta(minutes=7), datetime.timedelta(minutes=30)]


# One rank of a torchrun-like job: rank 1 is alive but late, so only the group's timeout can end rank 0's wait.
# Each rank enters run_entry (which creates the group with the timeout under test) only once both have started
# (a file per rank in argv[3]): a slow interpreter start must not make the group's set-up time out instead of
# the barrier. The barrier alone is timed, so a loaded machine's slow start-up and teardown do not count.
LATE_RANK_SCRIPT = """
import datetime, os, pathlib, sys, time
import torch
from utils.cli.entry import run_entry
from utils.distributed import barrier

def body(ctx):
    if ctx.rank == 1:
        time.sleep(float(sys.argv[2]))
    start = time.monotonic()
    try:
        barrier(ctx)
    finally:
        print(f"seconds in the barrier: {time.monotonic() - start:.2f}", flush=True)

torch.set_num_threads(1)
started = pathlib.Path(sys.argv[3])
(started / os.environ["RANK"]).touch()
while len(list(started.iterdir())) < 2:
    time.sleep(0.01)
run_entry("cpu", body, datetime.timedelta(seconds=float(sys.argv[1])))
"""


@pytest.mark.slow
@pytest.mark.distributed
def test_run_entry_gives_the_process_group_its_timeout(tmp_path: Path) -> None:
    timeout_s, late_s = 5.0, 60.0  # rank 1 is killed once rank 0 is done: its lateness costs no time
    script = tmp_path / "late_rank.py"
    script.write_text(LATE_RANK_SCRIPT)
    (tmp_path / "started").mkdir()
    port, repo = free_port(), Path(__file__).resolve().parents[1]
    processes = []
    for rank in range(2):
        env = {**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1"}
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_PORT=str(port))
        command = [sys.executable, str(script), str(timeout_s), str(late_s), str(tmp_path / "started")]
        processes.append(subprocess.Popen(command, cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    try:
        stdout, stderr = processes[0].communicate(timeout=late_s + PROCESS_TIMEOUT_S)  # start-up under load
    finally:
        for process in processes:
            process.kill()  # rank 1 is still asleep: it has served its purpose
            process.wait()
    assert processes[0].returncode != 0, "rank 0's barrier should have timed out"
    assert "timed out" in stderr.decode().lower(), stderr.decode()  # gloo: "Timed out waiting 5000ms for recv"
    assert "seconds in the barrier" in stdout.decode(), f"rank 0 never reached the barrier:\n{stderr.decode()}"
    seconds = float(stdout.decode().rsplit(":", 1)[1])
    assert timeout_s <= seconds < late_s / 2, f"rank 0 waited {seconds:.1f} s with a {timeout_s:.0f} s timeout"
