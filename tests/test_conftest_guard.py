"""The marker guards of tests/conftest.py: unmarked tests may not start a process group or run an entry point."""

from __future__ import annotations

import datetime

import pytest
import torch.distributed

import train
import val
from segment import train as seg_train
from segment import val as seg_val
from utils.distributed import init_distributed
from utils.errors import ConfigError

GUARD_ERROR = pytest.fail.Exception  # pytest.fail's exception: a BaseException that `except Exception` cannot swallow


def test_init_process_group_fails_a_test_not_marked_distributed(tmp_path) -> None:
    # Without the guard this would raise a different error (no peer ever joins the file store within 1 s).
    with pytest.raises(GUARD_ERROR, match=r"not marked distributed.*@pytest\.mark\.distributed"):
        torch.distributed.init_process_group(
            "gloo",
            init_method=f"file://{tmp_path / 'init'}",
            rank=0,
            world_size=2,
            timeout=datetime.timedelta(seconds=1),
        )
    assert not torch.distributed.is_initialized()


def test_library_dist_calls_are_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    # utils.distributed calls `dist.init_process_group` through `import torch.distributed as dist`.
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")  # never reached: the guard fails first
    with pytest.raises(GUARD_ERROR, match="test_library_dist_calls_are_caught called torch.distributed"):
        init_distributed("cpu", timeout=datetime.timedelta(seconds=1))
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize("main", [train.main, val.main, seg_train.main, seg_val.main], ids=lambda m: m.__module__)
def test_entry_points_fail_a_test_not_marked_slow(main, tmp_path) -> None:
    # Flags parse before the entry point's run_entry; the guard stops it before any data or weights are read.
    argv = ["--data", str(tmp_path / "none.yaml"), "--weights", str(tmp_path / "none.pt"), "--device", "cpu"]
    with pytest.raises(GUARD_ERROR, match=r"not marked slow.*@pytest\.mark\.slow"):
        main(argv)


@pytest.mark.slow
def test_slow_tests_reach_the_real_entry_point(tmp_path) -> None:
    # Marked slow, the real run_entry runs and the missing weights give the library's own error.
    with pytest.raises(ConfigError, match=r"none\.pt: file not found"):
        val.main(["--weights", str(tmp_path / "none.pt"), "--device", "cpu"])


@pytest.mark.distributed
def test_distributed_tests_keep_the_real_init_process_group() -> None:
    assert torch.distributed.init_process_group is torch.distributed.distributed_c10d.init_process_group
