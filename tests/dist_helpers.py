"""Test helpers for real processes: run a function on N gloo ranks and collect the results; a free port."""

from __future__ import annotations

import datetime
import pickle
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from utils.distributed import DistContext, cleanup


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a subprocess's --master_port)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _result_path(tmp_path: Path, rank: int) -> Path:
    return tmp_path / f"dist_result_rank{rank}.pkl"


def _child(
    rank: int,
    fn: Callable[..., Any],
    world_size: int,
    tmp_path: Path,
    timeout_s: float,
    args: tuple[Any, ...],
) -> None:
    """Body of one spawned rank: join the gloo group, call `fn(ctx, *args)`, pickle its result."""
    torch.set_num_threads(1)  # N ranks on a 2-core runner: avoid oversubscription.
    dist.init_process_group(
        "gloo",
        init_method=f"file://{tmp_path / 'dist_init'}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    try:
        ctx = DistContext(
            rank=rank, local_rank=rank, world_size=world_size, device=torch.device("cpu"), local_world_size=world_size
        )
        result = fn(ctx, *args)
        _result_path(tmp_path, rank).write_bytes(pickle.dumps(result))
    finally:
        cleanup()  # the library's teardown: collects DDP wrappers before destroying the group


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    tmp_path: Path,
    *args: Any,
    timeout_s: float = 60.0,
    wall_limit_s: float = 600.0,
) -> list[Any]:
    """Run `fn(ctx, *args)` on `world_size` spawned gloo processes and return each rank's result, in rank order.

    `fn` must be a module-level (picklable) function; each rank gets a CPU `DistContext` with
    `local_rank == rank` and `local_world_size == world_size` (one node). Return values must be
    picklable. A failure in any rank (assertion or exception) becomes a `pytest.fail` that shows
    the failing rank and its traceback. Collectives time out after `timeout_s`, so a rank that
    skips a collective fails the test instead of hanging it; ranks still alive after `wall_limit_s`
    (a hang outside any collective, e.g. in process teardown) are killed and the test fails.
    `tmp_path` must be empty of `dist_init` (use a fresh pytest `tmp_path` or a subfolder per call).
    """
    tmp_path = Path(tmp_path)
    tmp_path.mkdir(parents=True, exist_ok=True)
    failure = None
    context = mp.spawn(_child, args=(fn, world_size, tmp_path, timeout_s, args), nprocs=world_size, join=False)
    deadline = time.monotonic() + wall_limit_s
    try:
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.kill()
                    process.join()
                failure = f"{fn.__name__} on {world_size} ranks still running after {wall_limit_s:.0f} s; killed"
                break
    except mp.ProcessRaisedException as error:
        # str(error) carries the child's full traceback; fail outside the handler so it is shown once.
        failure = f"rank {error.error_index} of {world_size} raised in {fn.__name__}:{error}"
    except mp.ProcessExitedException as error:
        failure = f"rank {error.error_index} of {world_size} exited with code {error.exit_code} in {fn.__name__}"
    if failure is not None:
        pytest.fail(failure, pytrace=False)
    return [pickle.loads(_result_path(tmp_path, rank).read_bytes()) for rank in range(world_size)]
