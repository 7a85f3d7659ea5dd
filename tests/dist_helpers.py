"""Test helpers for real processes: run a function on N gloo ranks, collect the results; a free port; a hang guard."""

from __future__ import annotations

import datetime
import os
import pickle
import random
import socket
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from utils.distributed import DistContext, cleanup

# Hang guard for one subprocess that starts Python and imports torch (val.py, a `-c` script): seconds alone,
# minutes when pytest -n 8 shares 2 cores among its workers. Never a measure of speed.
PROCESS_TIMEOUT_S = 300


def _ephemeral_ports() -> tuple[int, int]:
    """The kernel's range for ports it picks itself (bind to port 0, the source port of a connect)."""
    try:
        low, high = (int(part) for part in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def _port_block() -> range:
    """The ports this process hands out: one of 16 blocks below the ephemeral range, one per xdist worker.

    Workers gw0..gw15 get disjoint blocks, so two tests running side by side under `pytest -n`
    never pick the same port; the main process (no xdist) takes block 0.
    """
    high = _ephemeral_ports()[0]
    low = max(1024, high // 3)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    size = (high - low) // 16
    start = low + (int(worker) % 16 if worker.isdigit() else 0) * size
    return range(start, start + size)


_handed_out: set[int] = set()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now and that no other test of this run will be given.

    Launchers need the number before they bind the port (torchrun --master_port, MASTER_PORT,
    `mlflow server --port`), so it must stay free for the seconds their start takes. A port the
    kernel picked (bind to port 0) does not: it comes from the ephemeral range, where any
    outgoing connection on the machine (gloo, TCPStore clients, HTTP) may take it meanwhile as
    its source port. So the port comes from below that range, where the kernel never hands
    ports out by itself, from this xdist worker's own block (`_port_block`), never twice from
    one process; the random start and the bind check step around other programs that bind there.
    """
    block = _port_block()
    offset = random.randrange(len(block))
    for step in range(len(block)):
        port = block[(offset + step) % len(block)]
        if port in _handed_out:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue  # in use (or just released and still in TIME_WAIT): the launcher might not get it
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free port in {block.start}-{block.stop - 1}")


# What the forkserver imports once, for every rank this test process starts: third-party libraries only, so each
# rank still imports the project (and the test's module) fresh, as a spawned process would. A spawn paid the torch
# import in every rank, about 2.5 s per 2-rank job on an idle 2-core machine and several times that under load.
FORKSERVER_PRELOAD = ["torch", "torchvision", "numpy", "cv2"]


def _result_path(tmp_path: Path, rank: int) -> Path:
    return tmp_path / f"dist_result_rank{rank}.pkl"


def _child(
    rank: int,
    fn: Callable[..., Any],
    world_size: int,
    tmp_path: Path,
    timeout_s: float,
    args: tuple[Any, ...],
    environ: dict[str, str],
) -> None:
    """Body of one rank: take the test's environment, join the gloo group, call `fn(ctx, *args)`, pickle its result."""
    os.environ.clear()  # a forkserver child starts with the server's environment, not the test's
    os.environ.update(environ)
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
    start_method: str = "forkserver",
) -> list[Any]:
    """Run `fn(ctx, *args)` on `world_size` gloo processes and return each rank's result, in rank order.

    The ranks are forked from a forkserver that has imported torch (FORKSERVER_PRELOAD) and take the
    test's environment as it is at the call; `start_method="spawn"` starts fresh interpreters instead,
    as torchrun does, for a test of what a fresh process holds (objects, garbage, imports).

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
    if start_method == "forkserver":
        mp.set_forkserver_preload(FORKSERVER_PRELOAD)
    context = mp.start_processes(
        _child,
        args=(fn, world_size, tmp_path, timeout_s, args, dict(os.environ)),
        nprocs=world_size,
        join=False,
        start_method=start_method,
    )
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


def captured(check: Callable[..., Any], *args: Any) -> Any:
    """Return `check(*args)`, or {"error": traceback} when it raises, so one broken check fails one test.

    For a rank function that runs several checks in one job (each job costs seconds of process
    start and imports). A check that raises on every rank (an assertion) leaves the group in step; a check that
    breaks the group takes the rest down with it, and the job fails as a whole.
    """
    try:
        return check(*args)
    except Exception:  # noqa: BLE001 - handed to the test that owns this check
        return {"error": traceback.format_exc()}


def check_parts(rank_results: list[dict[str, Any]], name: str) -> list[Any]:
    """Each rank's result of check `name` (run through `captured`); fails the test with a rank's traceback."""
    parts = [result[name] for result in rank_results]
    for rank, part in enumerate(parts):
        if isinstance(part, dict) and "error" in part:
            pytest.fail(f"rank {rank} raised in check {name}:\n{part['error']}", pytrace=False)
    return parts
