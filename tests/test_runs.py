"""Tests for utils/runs.py: YOLOv5's run-folder numbering, shared by train.py and val.py, and the folder lock."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import train
from tests.conftest import make_tiny_dataset
from tests.dist_helpers import PROCESS_TIMEOUT_S
from utils import runs
from utils.data.synthetic import SyntheticSpec
from utils.distributed import DistContext
from utils.errors import ConfigError
from utils.runs import create_run_dir, lock_run_dir, next_run_dir

ROOT = Path(__file__).resolve().parent.parent


def test_run_folders_increment_unless_exist_ok(tmp_path: Path) -> None:
    made = [create_run_dir(tmp_path, "exp", False, DistContext()) for _ in range(3)]
    assert made == [tmp_path / "exp", tmp_path / "exp2", tmp_path / "exp3"]
    assert all(path.is_dir() for path in made)
    assert create_run_dir(tmp_path, "exp", True, DistContext()) == tmp_path / "exp"


def test_next_run_dir_creates_nothing_and_fills_the_first_gap(tmp_path: Path) -> None:
    (tmp_path / "exp").mkdir()
    (tmp_path / "exp3").mkdir()
    assert next_run_dir(tmp_path, "exp", exist_ok=False) == tmp_path / "exp2"
    assert not (tmp_path / "exp2").exists()
    assert next_run_dir(tmp_path, "other", exist_ok=False) == tmp_path / "other"


def test_subfolders_are_created_with_the_run(tmp_path: Path) -> None:
    run = create_run_dir(tmp_path / "runs" / "train", "exp", False, DistContext(), subdirs=("weights",))
    assert (run / "weights").is_dir()


def test_a_locked_run_folder_refuses_a_second_holder_until_released(tmp_path: Path) -> None:
    held = lock_run_dir(tmp_path)
    assert held is not None
    with pytest.raises(ConfigError, match=f"is in use by process {os.getpid()} on "):
        lock_run_dir(tmp_path)
    held.release()
    held.release()  # a second release does nothing
    again = lock_run_dir(tmp_path)
    assert again is not None
    again.release()


def test_a_killed_holder_leaves_no_stale_lock(tmp_path: Path) -> None:
    code = "import sys, time; from pathlib import Path; from utils.runs import lock_run_dir; "
    code += "lock = lock_run_dir(Path(sys.argv[1])); print('held', flush=True); time.sleep(60)"
    holder = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(ConfigError, match=f"in use by process {holder.pid} "):
            lock_run_dir(tmp_path)
    finally:
        holder.kill()
        holder.wait(PROCESS_TIMEOUT_S)
    lock = lock_run_dir(tmp_path)  # the kernel dropped the dead process's flock
    assert lock is not None
    lock.release()


def test_a_file_where_the_run_folder_goes_is_one_line_not_a_loop(tmp_path: Path) -> None:
    (tmp_path / "exp").write_text("not a folder")
    with pytest.raises(ConfigError, match="exists and is not a folder"):
        create_run_dir(tmp_path, "exp", True, DistContext())
    assert create_run_dir(tmp_path, "exp", False, DistContext()) == tmp_path / "exp2"  # numbering goes past it


def _wait_after_starting(started: Any) -> None:
    started.set()
    time.sleep(30)


def test_a_forked_child_does_not_keep_the_lock_after_its_parent_releases_it(tmp_path: Path) -> None:
    held = lock_run_dir(tmp_path)
    assert held is not None
    fork = multiprocessing.get_context("fork")
    started = fork.Event()
    child = fork.Process(target=_wait_after_starting, args=(started,))  # as a loader worker is forked
    child.start()
    try:
        assert started.wait(PROCESS_TIMEOUT_S)  # its fork handlers have run
        held.release()
        again = lock_run_dir(tmp_path)  # the child's inherited descriptor was closed at the fork
        assert again is not None
        again.release()
    finally:
        child.kill()
        child.join(PROCESS_TIMEOUT_S)


def test_a_restarted_job_waits_for_its_last_attempts_lock_then_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # On NFS a lost node's lock outlives it until the server's lease ends: the restart must not fail on it.
    monkeypatch.setattr(runs, "RESTART_LOCK_WAIT_S", 0.0)
    held = lock_run_dir(tmp_path, job="job42")
    assert held is not None
    try:
        with pytest.raises(ConfigError, match="job job42"):  # not a restart: refused like any other holder
            lock_run_dir(tmp_path, job="job42")
        with pytest.raises(ConfigError, match="in use by"):  # another job's restart: refused
            lock_run_dir(tmp_path, job="job7", restarted=True)
        assert lock_run_dir(tmp_path, job="job42", restarted=True) is None
        assert "still locked by this job's last attempt" in caplog.text
    finally:
        held.release()


@pytest.mark.slow
def test_training_into_a_folder_another_run_holds_is_refused_before_writing(tmp_path: Path) -> None:
    data = make_tiny_dataset(tmp_path / "data", SyntheticSpec(num_train=4, num_val=2, max_objects=2))
    run_dir = tmp_path / "runs" / "held"
    run_dir.mkdir(parents=True)
    held = lock_run_dir(run_dir)
    args = ["--data", str(data), "--cfg", "yolov8n", "--imgsz", "64", "--epochs", "1", "--batch-size", "2"]
    args += ["--device", "cpu", "--workers", "2", "--project", str(tmp_path / "runs"), "--name", "held"]
    try:
        with pytest.raises(ConfigError, match="in use by process"):
            train.main([*args, "--exist-ok", "--noplots"])
        assert not (run_dir / "opt.yaml").exists() and not any((run_dir / "weights").iterdir())
    finally:
        assert held is not None
        held.release()
    result = train.main([*args, "--exist-ok", "--noplots"])  # free again: the same command trains
    assert result.last.is_file() and lock_run_dir(run_dir) is not None
