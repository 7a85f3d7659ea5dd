"""Faults under torchrun with 2 CPU ranks: a SIGKILLed rank is restarted and the run continues in its own folder
(and on its node's --cache shm segment); SIGTERM to the job saves mid-epoch and a new start resumes there. Real
processes, killed for real."""

from __future__ import annotations

import csv
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from tests.conftest import make_tiny_dataset
from tests.dist_helpers import free_port
from utils.data.synthetic import SyntheticSpec

REPO = Path(__file__).resolve().parents[1]
TINY = SyntheticSpec(num_train=32, num_val=4, max_objects=3, min_object_frac=0.2, min_side=64, max_side=96)
TIMEOUT_S = 600  # only a hang guard: under pytest -n 8 a 3-epoch run with a restart takes minutes
pytestmark = [pytest.mark.slow, pytest.mark.distributed]


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_dataset(tmp_path_factory.mktemp("elastic"), TINY)


def _launch(
    project: Path, data: Path, *extra: str, restarts: int = 0, launcher: tuple[str, ...] = ()
) -> subprocess.Popen:
    """Start torchrun; its output goes to a file (a pipe nobody reads fills up and blocks the launcher).

    `launcher`: torchrun's own flags; by default one agent with 2 processes on a free port.
    """
    launcher = launcher or ("--nproc_per_node", "2", "--master_port", str(free_port()))
    command = [
        sys.executable, "-m", "torch.distributed.run", *launcher, "--max-restarts", str(restarts),
        "train.py", "--cfg", "yolov5n", "--device", "cpu", "--workers", "0", "--data", str(data),
        "--imgsz", "64", "--batch-size", "4", "--project", str(project), "--seed", "3", "--noplots", *extra,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    log = open(project.parent / f"torchrun-{time.monotonic_ns()}.log", "w+")  # noqa: SIM115 (closed by _finish)
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    process.log = log  # type: ignore[attr-defined]
    return process


def _finish(process: subprocess.Popen) -> str:
    """Wait for torchrun to end and return everything it and the ranks printed."""
    try:
        process.wait(timeout=TIMEOUT_S)
    finally:
        process.kill()
    process.log.seek(0)  # type: ignore[attr-defined]
    output = process.log.read()  # type: ignore[attr-defined]
    process.log.close()  # type: ignore[attr-defined]
    return output


def _rows(run_dir: Path) -> list[str]:
    path = run_dir / "results.csv"
    if not path.is_file():
        return []
    with path.open(newline="") as file:
        return [row["epoch"] for row in csv.DictReader(file)]


def _epoch_saved(run_dir: Path) -> bool:
    """Epoch 1 is in results.csv and last.pt exists: the row is written just before the checkpoint, so a
    kill between the two finds no checkpoint and trains again from the start (right, but not what is tested)."""
    return len(_rows(run_dir)) >= 1 and (run_dir / "weights" / "last.pt").is_file()


def _wait_for(condition, process: subprocess.Popen, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not condition():
        if process.poll() is not None:
            pytest.fail(f"torchrun ended (exit {process.returncode}) before {what}:\n{_finish(process)}")
        if time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)


def _worker(process: subprocess.Popen, rank: int) -> psutil.Process:
    for child in psutil.Process(process.pid).children(recursive=True):
        try:
            if child.environ().get("RANK") == str(rank):
                return child
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    pytest.fail(f"no worker process of rank {rank}")


def test_a_killed_rank_is_restarted_and_the_run_continues_in_its_folder_on_its_shm_cache(
    tiny_data: Path, tmp_path: Path
) -> None:
    """The restarted ranks resume the job's own folder and read the node's --cache shm segment the first
    attempt filled (kept for the restart, no refill); the finished run removes it."""
    project = tmp_path / "runs"
    project.mkdir()
    # Restarts to spare: on a loaded 2-core machine gloo's connect at a restart can itself time out once.
    job = _launch(project, tiny_data, "--epochs", "3", "--name", "job", "--cache", "shm", restarts=3)
    run_dir = project / "job"
    _wait_for(lambda: _epoch_saved(run_dir), job, "epoch 1 was saved")
    _worker(job, rank=1).send_signal(signal.SIGKILL)  # during epoch 2 (or its checkpoint)
    output = _finish(job)
    segments = set(re.findall(r"in (/\S*yolo-shm-cache-\S+),", output))
    try:
        assert job.returncode == 0, output
        assert re.search(r"torchrun restart \d: resuming .*job from .*last\.pt", output), output
        assert sorted(p.name for p in project.iterdir()) == ["job"]  # no job2
        assert _rows(run_dir) == ["1", "2", "3"]
        assert torch.load(run_dir / "weights" / "last.pt", weights_only=True)["epoch"] == 2
        assert len(segments) == 1, output  # the same segment before and after the restart
        assert "filled by its 2 rank(s)" in output and "keeping" in output, output
        assert "reused from an earlier start, no refill" in output, output
        assert not Path(next(iter(segments))).exists()  # the run ended: removed
    finally:
        for segment in segments:
            Path(segment).unlink(missing_ok=True)


def test_two_agents_restart_together_after_a_rank_of_one_is_killed(tiny_data: Path, tmp_path: Path) -> None:
    """`--nnodes 1:2` on loopback: the agent whose worker was killed counts a restart, the other does not.

    Both restarted workers must still meet in a key space of the agent store that the failed attempt
    never wrote to (utils/rendezvous.py); in a store keyed by restart count they waited for each other
    in the process group's set-up until the timeout, about 1 run in 4.
    """
    project = tmp_path / "runs"
    project.mkdir()
    launcher = (
        "--nnodes", "1:2", "--nproc_per_node", "1", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", f"two-agents-{os.getpid()}",
    )  # fmt: skip
    extra = ("--epochs", "3", "--name", "job", "--dist-timeout", "2")
    agents = [_launch(project, tiny_data, *extra, restarts=2, launcher=launcher) for _ in range(2)]
    run_dir = project / "job"
    _wait_for(lambda: _epoch_saved(run_dir), agents[1], "epoch 1 was saved")
    victim = next(
        child
        for child in psutil.Process(agents[1].pid).children(recursive=True)
        if "train.py" in " ".join(child.cmdline())
    )
    victim.send_signal(signal.SIGKILL)
    outputs = [_finish(agent) for agent in agents]
    assert [agent.returncode for agent in agents] == [0, 0], "\n".join(outputs)
    assert re.search(r"torchrun restart \d: resuming .*job from .*last\.pt", "".join(outputs)), outputs
    assert sorted(p.name for p in project.iterdir()) == ["job"]
    assert _rows(run_dir) == ["1", "2", "3"]


def test_sigterm_to_the_job_saves_mid_epoch_and_a_new_start_resumes_there(tiny_data: Path, tmp_path: Path) -> None:
    project = tmp_path / "runs"
    project.mkdir()
    job = _launch(project, tiny_data, "--epochs", "2", "--name", "job")
    run_dir = project / "job"
    _wait_for(lambda: len(_rows(run_dir)) >= 1, job, "epoch 1 was written")
    job.send_signal(signal.SIGTERM)  # to torchrun, which passes it on to both ranks
    output = _finish(job)
    assert job.returncode != 0
    assert output.count("preempted: stopped by") == 1, output  # rank 0 says it, for the job
    checkpoint = torch.load(run_dir / "weights" / "last.pt", weights_only=True)
    assert checkpoint["epoch"] == 0 and 0 < checkpoint["batches_done"] <= 8, output  # inside epoch 2 of 8 batches
    assert len(checkpoint["rank_states"]) == 2
    resumed = _launch(project, tiny_data, "--resume", str(run_dir / "weights" / "last.pt"))
    output = _finish(resumed)
    assert resumed.returncode == 0, output
    assert f"in epoch 2, after its batch {checkpoint['batches_done']}" in output  # the "Resuming ..." line
    assert _rows(run_dir) == ["1", "2"]
