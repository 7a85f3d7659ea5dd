"""Tests for utils/runs.py: YOLOv5's run-folder numbering, shared by train.py and val.py."""

from __future__ import annotations

from pathlib import Path

from utils.distributed import DistContext
from utils.runs import create_run_dir, next_run_dir


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
