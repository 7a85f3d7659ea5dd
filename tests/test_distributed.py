"""Tests for utils/distributed.py: launch variables, device choice, and collectives on 2 gloo processes."""

from __future__ import annotations

import gc
import re
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.dist_helpers import captured, check_parts, run_distributed
from utils.distributed import (
    DistContext,
    average_bn_stats,
    broadcast_object,
    cleanup,
    main_first,
    read_launch_env,
    run_on_main,
    select_device,
    smart_ddp,
)
from utils.errors import ConfigError

LAUNCH_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "SLURM_PROCID",
    "SLURM_LOCALID",
    "SLURM_NTASKS",
    "SLURM_NTASKS_PER_NODE",
    "SLURM_TASKS_PER_NODE",
    "SLURM_STEP_TASKS_PER_NODE",
    "SLURM_NODEID",
)
GROUP_TIMEOUT_S = 60.0  # the 2-rank jobs' collective timeout


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_launch_env_defaults_to_single_process(clean_env: pytest.MonkeyPatch) -> None:
    assert read_launch_env() == (0, 0, 1, 1)


def test_torchrun_variables_win_over_slurm(clean_env: pytest.MonkeyPatch) -> None:
    for name, value in {
        "RANK": "5",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "8",
        "LOCAL_WORLD_SIZE": "4",
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": "2",
    }.items():
        clean_env.setenv(name, value)
    assert read_launch_env() == (5, 1, 8, 4)


def test_slurm_variables_used_without_torchrun(clean_env: pytest.MonkeyPatch) -> None:
    for name, value in {
        "SLURM_PROCID": "3",
        "SLURM_LOCALID": "1",
        "SLURM_NTASKS": "4",
        "SLURM_NTASKS_PER_NODE": "2",
    }.items():
        clean_env.setenv(name, value)
    assert read_launch_env() == (3, 1, 4, 2)


@pytest.mark.parametrize(
    ("tasks_per_node", "node", "local_world_size"),
    [("1(x2)", "1", 1), ("4(x2),2", "0", 4), ("4(x2),2", "2", 2), ("3", "0", 3)],
)
def test_slurm_ranks_per_node_come_from_its_task_list_without_ntasks_per_node(
    clean_env: pytest.MonkeyPatch, tasks_per_node: str, node: str, local_world_size: int
) -> None:
    # SLURM sets SLURM_TASKS_PER_NODE and SLURM_NODEID always, SLURM_NTASKS_PER_NODE only with --ntasks-per-node.
    for name, value in {"SLURM_PROCID": "1", "SLURM_LOCALID": "0", "SLURM_NTASKS": "10",
                        "SLURM_TASKS_PER_NODE": tasks_per_node, "SLURM_NODEID": node}.items():  # fmt: skip
        clean_env.setenv(name, value)
    assert read_launch_env() == (1, 0, 10, local_world_size)
    clean_env.setenv("SLURM_STEP_TASKS_PER_NODE", "5")  # a step on part of the allocation: its own list
    clean_env.setenv("SLURM_NODEID", "0")
    assert read_launch_env()[3] == 5
    clean_env.setenv("SLURM_TASKS_PER_NODE", "two")
    clean_env.delenv("SLURM_STEP_TASKS_PER_NODE")
    with pytest.raises(ValueError, match="SLURM_TASKS_PER_NODE='two' is not a SLURM task list"):
        read_launch_env()


def test_select_device_cpu_and_missing_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    assert select_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert select_device("") == torch.device("cpu")
    # A user error (ConfigError), which entry points print as one `error:` line, not a traceback.
    message = "--device 0 asks for CUDA but no CUDA device is available; use --device cpu"
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        select_device("0")
    with pytest.raises(ConfigError, match=r"^--device mps: Apple's MPS is not supported; use --device cpu"):
        select_device("mps")


def test_more_gpus_listed_than_processes_is_one_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # `python train.py --device 0,1` runs one process, on GPU 0: YOLOv5 users expect both (DataParallel).
    from utils.distributed import _warn_unused_gpus

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    _warn_unused_gpus("0,1", 0, 1)
    _warn_unused_gpus("0,1", 0, 2)  # torchrun --nproc_per_node 2: both used
    _warn_unused_gpus("0", 0, 1)
    messages = [record.getMessage() for record in caplog.records]
    assert messages == [
        "--device 0,1 lists 2 GPUs but this node runs 1 process(es), one GPU each: launch with torchrun "
        "--nproc_per_node 2 to train on all of them"
    ]


@pytest.mark.parametrize(
    ("device", "local_rank", "message"),
    [
        ("2", 0, "--device 2: no GPU 2 on this machine; it has 2 (0-1)"),
        ("gpu0", 0, "--device gpu0: expected cpu, cuda or GPU numbers such as 0 or 0,1"),
        ("0", 1, "--device 0 lists 1 GPU(s) but local rank 1 needs one"),
    ],
)
def test_select_device_refuses_gpus_this_machine_lacks(
    monkeypatch: pytest.MonkeyPatch, device: str, local_rank: int, message: str
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert select_device("cuda:1,0", local_rank=1) == torch.device("cuda", 0)
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        select_device(device, local_rank)


def test_context_properties() -> None:
    ctx = DistContext(rank=3, local_rank=1, world_size=4)
    assert not ctx.is_main and not ctx.is_local_main and ctx.is_distributed
    assert DistContext().is_main and not DistContext().is_distributed


def _bn_average(ctx: DistContext) -> list[float]:
    bn = nn.BatchNorm1d(2)
    bn.running_mean.fill_(float(ctx.rank))  # ranks hold 0 and 1
    bn.running_var.fill_(1.0 + 2 * ctx.rank)  # 1 and 3
    average_bn_stats(bn, ctx)
    return bn.running_mean.tolist() + bn.running_var.tolist()


@pytest.mark.distributed
def test_average_bn_stats_over_two_ranks(rank_results: RankResults) -> None:
    results = check_parts(rank_results.results, "bn_average")
    assert results[0] == results[1] == [0.5, 0.5, 2.0, 2.0]


def _ordered(ctx: DistContext, log_file: str) -> str:
    with main_first(ctx):
        if ctx.rank == 0:
            time.sleep(0.5)  # give rank 1 every chance to run early if the barrier were missing
        with open(log_file, "a") as file:
            file.write(str(ctx.rank))
    return broadcast_object(f"from{ctx.rank}", ctx)


@pytest.mark.distributed
def test_main_first_runs_local_main_first_and_broadcast(rank_results: RankResults) -> None:
    results = check_parts(rank_results.results, "ordered")
    assert rank_results.order_file.read_text() == "01"
    assert results == ["from0", "from0"]


def _ddp_steps(ctx: DistContext) -> list[float]:
    torch.manual_seed(100 + ctx.rank)  # different initial weights per rank on purpose
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    ddp = smart_ddp(model, ctx)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    for _ in range(3):
        x = torch.randn(6, 4)  # different data per rank
        loss = ddp(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()


@pytest.mark.distributed
def test_smart_ddp_keeps_ranks_identical(rank_results: RankResults) -> None:
    first, second = check_parts(rank_results.results, "ddp_steps")
    assert first == second


def _ddp_alive_around_cleanup(ctx: DistContext) -> tuple[bool, bool]:
    """Build and step a DDP model in a function that returns; is the wrapper alive before / after cleanup()?"""

    def build_and_step() -> weakref.ref:
        ddp = smart_ddp(nn.Linear(3, 1), ctx)
        ddp(torch.ones(2, 3)).sum().backward()
        return weakref.ref(ddp)

    gc.disable()  # keep the automatic collector from running at a random point in between
    try:
        ref = build_and_step()
        alive_before = ref() is not None
        cleanup()
        return alive_before, ref() is not None
    finally:
        gc.enable()


@pytest.mark.distributed
def test_cleanup_frees_ddp_before_destroying_the_group(tmp_path: Path) -> None:
    # The wrapper outlives its builder (reference cycles); left to interpreter shutdown, its reducer's
    # hold on the gloo group aborted ~1 process in 20 with SIGABRT. cleanup() must free it first.
    # In fresh interpreters, as torchrun starts ranks: forked from a forkserver the wrapper was freed at once.
    for alive_before, alive_after in run_distributed(_ddp_alive_around_cleanup, 2, tmp_path, start_method="spawn"):
        assert alive_before, "the DDP wrapper no longer survives its builder; this test checks nothing"
        assert not alive_after


def _rank0_fails(ctx: DistContext, kind: str) -> tuple[str, str, float]:
    """Call run_on_main with a function that raises on rank 0; return (error type, message, seconds) here."""
    from utils.errors import ConfigError

    def fail() -> None:
        raise ConfigError("data.yaml: bad annotations") if kind == "config" else OSError("disk full")

    start = time.monotonic()
    try:
        run_on_main(fail, ctx, "writing results")
    except Exception as error:  # every rank must get here
        return type(error).__name__, str(error), time.monotonic() - start
    return "none", "", time.monotonic() - start


@pytest.mark.distributed
def test_run_on_main_raises_rank0_failure_on_every_rank(rank_results: RankResults) -> None:
    config = check_parts(rank_results.results, "rank0_fails_config")
    assert [(kind, message) for kind, message, _ in config] == [("ConfigError", "data.yaml: bad annotations")] * 2
    other = check_parts(rank_results.results, "rank0_fails_os")
    assert other[0][:2] == ("OSError", "disk full")
    assert other[1][:2] == ("RuntimeError", "writing results failed on rank 0: disk full")
    # The group's timeout (GROUP_TIMEOUT_S): a rank 1 that waited for rank 0 would sit it out.
    assert max(seconds for *_, seconds in config + other) < GROUP_TIMEOUT_S, "rank 1 waited instead of failing"


def _rank_checks(ctx: DistContext, order_file: str) -> dict[str, Any]:
    """Every check above that leaves the 2-rank group healthy, in the same order on both ranks: one spawned job."""
    return {
        "bn_average": captured(_bn_average, ctx),
        "ordered": captured(_ordered, ctx, order_file),
        "ddp_steps": captured(_ddp_steps, ctx),
        "rank0_fails_config": captured(_rank0_fails, ctx, "config"),
        "rank0_fails_os": captured(_rank0_fails, ctx, "os"),
    }


@dataclass(frozen=True)
class RankResults:
    """Both ranks' results of _rank_checks, and the file _ordered's ranks wrote in turn."""

    results: list[dict[str, Any]]
    order_file: Path


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory: pytest.TempPathFactory) -> RankResults:
    """One spawned 2-rank job for the checks that keep the group healthy: each spawn costs seconds of torch imports.

    cleanup() (test_cleanup_frees_ddp_before_destroying_the_group) destroys the group, so it runs in its own job.
    """
    root = tmp_path_factory.mktemp("distributed")
    order_file = root / "order.txt"
    results = run_distributed(_rank_checks, 2, root / "dist", str(order_file), timeout_s=GROUP_TIMEOUT_S)
    return RankResults(results, order_file)
