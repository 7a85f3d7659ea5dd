"""train.py under torchrun with 2 CPU processes: a run, rank-0-only writes and logs, a batch error, --resume.

Each launch is a real `python -m torch.distributed.run` subprocess with a timeout, so a hang fails the
test instead of the suite. torchrun redirects each rank's stdout/stderr to its own file under
--log-dir, which lets the tests say which rank printed what.
"""

from __future__ import annotations

import csv
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml

from tests.conftest import make_tiny_dataset
from tests.dist_helpers import free_port
from utils.data.synthetic import SHAPE_NAMES, SyntheticSpec

REPO = Path(__file__).resolve().parents[1]
TINY = SyntheticSpec(num_train=8, num_val=4, max_objects=3, min_object_frac=0.2, min_side=64, max_side=96)
# Only a hang guard: a 2-epoch run takes about a minute alone on 2 cores and several under pytest -n 8.
LAUNCH_TIMEOUT_S = 600
NPROC = 2
pytestmark = [pytest.mark.slow, pytest.mark.distributed]  # every test launches train.py under torchrun


@dataclass
class Launch:
    """What one torchrun launch left: its exit code, and each rank's stdout and stderr."""

    returncode: int
    launcher_output: str
    rank_stdout: list[str]
    rank_stderr: list[str]


def _torchrun(log_dir: Path, *train_args: str, script: str = "train.py") -> Launch:
    """Run `torchrun --nproc_per_node 2 <script> --device cpu --workers 0 <train_args>` and collect its output."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(NPROC),
               "--master_port", str(free_port()), "--log-dir", str(log_dir), "--redirects", "3",
               script, "--device", "cpu", "--workers", "0", *train_args]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    rank_dirs = [next(log_dir.glob(f"*/attempt_0/{rank}"), None) for rank in range(NPROC)]
    if None in rank_dirs:
        pytest.fail(f"torchrun left no per-rank logs (exit {done.returncode}):\n{done.stdout}{done.stderr}")
    return Launch(
        returncode=done.returncode,
        launcher_output=done.stdout + done.stderr,
        rank_stdout=[(d / "stdout.log").read_text() for d in rank_dirs],
        rank_stderr=[(d / "stderr.log").read_text() for d in rank_dirs],
    )


def _train_args(data: Path, project: Path, name: str, *extra: str) -> list[str]:
    return ["--cfg", "yolov5n", "--data", str(data), "--imgsz", "64", "--batch-size", "4", "--project", str(project),
            "--name", name, "--seed", "3", *extra]  # fmt: skip


def _epochs_in_csv(path: Path) -> list[str]:
    with path.open() as file:
        return [row["epoch"] for row in csv.DictReader(file)]


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An 8/4-image shapes dataset (64-96 px images) and its YAML."""
    return make_tiny_dataset(tmp_path_factory.mktemp("torchrun_data"), TINY)


@pytest.fixture(scope="module")
def ddp_run(tiny_data: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Launch, Path]:
    """Two epochs of train.py on 2 processes, saving epoch1.pt so --resume can be tested; (launch, project)."""
    root = tmp_path_factory.mktemp("torchrun")
    project = root / "runs"
    launch = _torchrun(root / "logs", *_train_args(tiny_data, project, "ddp", "--epochs", "2", "--save-period", "1"))
    assert launch.returncode == 0, launch.launcher_output + "\n".join(launch.rank_stderr)
    return launch, project


def test_run_succeeds_with_one_csv_row_per_epoch_and_loadable_weights(ddp_run) -> None:
    _, project = ddp_run
    run_dir = project / "ddp"
    assert _epochs_in_csv(run_dir / "results.csv") == ["1", "2"]
    for name in ("best.pt", "last.pt"):
        checkpoint = torch.load(run_dir / "weights" / name, map_location="cpu", weights_only=True)
        assert checkpoint["train_config"]["batch_size"] == 4
        assert checkpoint["names"] == list(SHAPE_NAMES)
    assert torch.load(run_dir / "weights" / "last.pt", weights_only=True)["epoch"] == 1


def test_only_rank0_writes_files_and_info_logs(ddp_run, tiny_data: Path) -> None:
    launch, project = ddp_run
    assert [p.name for p in project.iterdir()] == ["ddp"], "exactly one run folder (no ddp2 from rank 1)"
    assert not [p for p in project.rglob("*") if ".tmp" in p.name], "no temporary files left behind"
    assert len(list(tiny_data.parent.rglob("*.cache"))) == 2, "one label cache per split, written once"
    rank0, rank1 = launch.rank_stderr
    infos = (
        "world size 2 | global batch 4 | per-rank batch 2",
        "optimizer auto -> AdamW",
        "optimizer:",
        "val: P",
        "Final (",
    )
    for info in infos:
        assert info in rank0, f"rank 0 should log {info!r}"
        assert info not in rank1, f"rank 1 must not log {info!r}"
    # Rank 1 logs warnings only, tagged with its rank; indented lines belong to Python warnings.
    untagged = [line for line in rank1.splitlines() if line.strip() and not line.startswith(("[rank 1]", " "))]
    assert not [line for line in untagged if "Warning" not in line], rank1
    assert "Done: 2 epochs" in launch.rank_stdout[0] and "Done" not in launch.rank_stdout[1]


def test_batch_size_not_divisible_by_processes_fails_fast_with_one_line(tiny_data: Path, tmp_path: Path) -> None:
    launch = _torchrun(tmp_path / "logs", *_train_args(tiny_data, tmp_path / "runs", "bad", "--batch-size", "3"))
    assert launch.returncode != 0
    for stderr in launch.rank_stderr:
        lines = stderr.strip().splitlines()
        assert len(lines) == 1, stderr
        assert lines[0].startswith("error: --batch-size 3 is not divisible by 2 processes"), stderr
    assert not (tmp_path / "runs").exists(), "nothing is written before the options are validated"
    # Fast: every rank refused the options itself (the line above) and the job ended on that refusal, a rank's exit
    # code 2. A rank waiting for a peer would have printed no line of its own or sat out the group's 30-minute
    # timeout, far past LAUNCH_TIMEOUT_S. The wall time is not asserted: a loaded machine takes minutes to start torch.
    root_cause = launch.launcher_output.partition("Root Cause (first observed failure):")[2]
    assert re.search(r"exitcode\s*:\s*2 ", root_cause), launch.launcher_output


def test_resume_under_torchrun_continues_from_saved_epoch(ddp_run, tmp_path: Path) -> None:
    # Resume epoch1.pt in a copy of the run folder: it must run exactly epoch 2 and end like the original.
    _, project = ddp_run
    copy = tmp_path / "runs" / "ddp"
    shutil.copytree(project / "ddp", copy)
    with (copy / "results.csv").open() as file:
        first_row = next(csv.DictReader(file))
    with (copy / "results.csv").open("w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=list(first_row))
        writer.writeheader()
        writer.writerow(first_row)
    launch = _torchrun(tmp_path / "logs", "--resume", str(copy / "weights" / "epoch1.pt"))
    assert launch.returncode == 0, launch.launcher_output + "\n".join(launch.rank_stderr)
    assert "Done: 2 epochs (1 after the resume). Final mAP50" in launch.rank_stdout[0]
    assert str(copy) in launch.rank_stdout[0]
    assert [p.name for p in (tmp_path / "runs").iterdir()] == ["ddp"], "resume writes into the copied folder"
    assert _epochs_in_csv(copy / "results.csv") == ["1", "2"]
    resumed = torch.load(copy / "weights" / "last.pt", weights_only=True)
    original = torch.load(project / "ddp" / "weights" / "last.pt", weights_only=True)
    assert resumed["epoch"] == original["epoch"] == 1
    for key, tensor in original["model"].items():
        torch.testing.assert_close(resumed["model"][key], tensor, rtol=1e-4, atol=1e-5, msg=key)


def test_resume_in_one_process_keeps_the_recipe_chosen_on_two(ddp_run, tmp_path: Path) -> None:
    # The 2-rank run chose its recipe with --optimizer auto; resumed by one process (another world size,
    # per-rank batch 4 instead of 2) it must train on with the same optimizer and hyp, not choose again.
    import train

    _, project = ddp_run
    copy = tmp_path / "ddp"
    shutil.copytree(project / "ddp", copy)

    def recipe() -> tuple[str, str, dict]:
        """(optimizer, hyp file) from opt.yaml and the values of hyp.yaml: what the run folder records."""
        options = yaml.safe_load((copy / "opt.yaml").read_text())
        return options["optimizer"], options["hyp_path"], yaml.safe_load((copy / "hyp.yaml").read_text())

    chosen = recipe()
    assert chosen[0] == "AdamW" and Path(chosen[1]).name == "hyp.quickstart.yaml"
    argv = ["--resume", str(copy / "weights" / "epoch1.pt"), "--device", "cpu", "--workers", "0", "--noplots"]
    result = train.main(argv)
    assert result.run_dir == copy and result.epochs_run == 1
    assert recipe() == chosen  # opt.yaml and hyp.yaml are written again by the resumed run
    resumed = torch.load(copy / "weights" / "last.pt", map_location="cpu", weights_only=True)
    assert (resumed["train_config"]["optimizer"], resumed["train_config"]["hyp_path"], resumed["hyp"]) == chosen


def test_train_run_from_a_script_under_torchrun_trains_as_train_py_does(
    ddp_run, tiny_data: Path, tmp_path: Path
) -> None:
    # A user's script calling train.run under torchrun: every rank calls it, callbacks fire on rank 0 only, and the
    # run is the one train.py gives with the same flags (same seed, same per-epoch figures). A second train.run in
    # the same processes trains its own run (each new process group is not a torchrun restart).
    script = tmp_path / "my_training.py"
    script.write_text(
        "import os, sys\n"
        "import train\n"
        "def mark(event):\n"
        "    (event.run_dir / f\"ended-on-rank{os.environ['RANK']}\").write_text(str(event.epoch))\n"
        "words = iter(sys.argv[1:])  # --flag value pairs, as keywords\n"
        "args = {flag.lstrip('-').replace('-', '_'): value for flag, value in zip(words, words)}\n"
        "result = train.run(callbacks={'on_fit_epoch_end': mark}, epochs=2, save_period=1, **args)\n"
        "print('RESULT', result.epochs_run, result.best.name)\n"
        "args['name'] += '-second'  # a second training in the same processes: a new run, not a torchrun restart\n"
        "again = train.run(epochs=1, **args)\n"
        "print('SECOND', again.run_dir.name, again.epochs_run)\n"
    )
    _, reference = ddp_run
    launch = _torchrun(tmp_path / "logs", *_train_args(tiny_data, tmp_path / "runs", "api"), script=str(script))
    assert launch.returncode == 0, launch.launcher_output + "\n".join(launch.rank_stderr)
    assert "RESULT 2 best.pt" in launch.rank_stdout[0] and "RESULT 2 best.pt" in launch.rank_stdout[1]
    run_dir = tmp_path / "runs" / "api"
    assert [p.name for p in run_dir.glob("ended-on-rank*")] == ["ended-on-rank0"]
    assert "SECOND api-second 1" in launch.rank_stdout[0] and "SECOND api-second 1" in launch.rank_stdout[1]
    with (run_dir / "results.csv").open() as mine, (reference / "ddp" / "results.csv").open() as theirs:
        ours, script_py = list(csv.DictReader(mine)), list(csv.DictReader(theirs))
    for key in ("train/box_loss", "train/cls_loss", "metrics/mAP50-95", "val/box_loss"):
        assert [row[key] for row in ours] == [row[key] for row in script_py], key
