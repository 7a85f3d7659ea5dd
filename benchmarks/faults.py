"""Fault benchmark: 2-rank CPU training runs killed at random times must finish, lose little and end bit-identical.

Usage (from the repository root):

    python benchmarks/faults.py                  # 6 faulted runs
    python benchmarks/faults.py --runs 10 --seed 1

Builds a small built-in-style dataset in a temporary folder, trains it once without a fault under
`torchrun --nproc_per_node 2` (gloo, `--deterministic`, `--save-period-steps 2`, one optimizer step per
batch) as the reference, then runs it `--runs` times with one fault each at a random moment of the
reference's training time, alternating:

- SIGKILL of rank 1 under `--max-restarts 1`: torchrun restarts the workers, which must resume in
  the same run folder from their newest checkpoint;
- SIGTERM to torchrun (what SLURM / Kubernetes send): the ranks must save mid-epoch and exit, and
  a second launch with `--resume` continues.

Per run it prints whether the run completed, the global batch the fault hit (read from rank 0's
progress bar, which redraws at most every 0.1 s, so it can lag by a few batches), the batch the run
resumed from, the batches lost (hit - from, at least 0; a lower bound for that reason; target: at most
the save period, 2), checkpoint load failures (target 0), results.csv rows (one per epoch) and
whether the final weights (model and EMA) equal the reference's bit for bit (target: all equal).
"""

from __future__ import annotations

import argparse
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import torch
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from utils.data.synthetic import SHAPE_NAMES, SyntheticSpec, ensure_synthetic_dataset  # noqa: E402

EPOCHS, BATCHES, SAVE_STEPS = 4, 8, 2
SPEC = SyntheticSpec(num_train=128, num_val=8, max_objects=3, min_object_frac=0.2, min_side=64, max_side=96)
PROGRESS = re.compile(r"epoch (\d+)/\d+:\s+\d+%\|[^|]*\|\s*(\d+)/(\d+)")
RESUMED = re.compile(r"from epoch (\d+)(?: batch (\d+))?")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(data: Path, project: Path, log: Path, *extra: str, restarts: int = 0) -> subprocess.Popen:
    """Start a 2-rank torchrun of train.py writing everything to `log`."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--max-restarts", str(restarts),
        "--master_port", str(free_port()), "train.py", "--device", "cpu", "--workers", "0", "--data", str(data),
        "--imgsz", "64", "--batch-size", "16", "--epochs", str(EPOCHS), "--project", str(project), "--name", "run",
        "--seed", "7", "--deterministic", "--noplots", "--save-period-steps", str(SAVE_STEPS), *extra,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)


def progress_batches(log: Path) -> int:
    """Rank 0's latest progress (global batch count) in `log`, 0 before the first step."""
    found = PROGRESS.findall(log.read_text(errors="replace"))
    if not found:
        return 0
    epoch, batch, total = (int(v) for v in found[-1])
    return (epoch - 1) * total + batch


def resumed_batches(text: str) -> int | None:
    """Global batch count of the checkpoint the last resume started from ("from epoch E batch B")."""
    found = RESUMED.findall(text)
    if not found:
        return None
    epoch, batch = found[-1]
    return (int(epoch) - 1) * BATCHES + (int(batch) - 1 if batch else 0)


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    checkpoint = torch.load(run_dir / "weights" / "last.pt", map_location="cpu", weights_only=True)
    return {f"{part}.{key}": value for part in ("model", "ema") for key, value in checkpoint[part].items()}


def rank1(process: subprocess.Popen) -> psutil.Process | None:
    for child in psutil.Process(process.pid).children(recursive=True):
        try:
            if child.environ().get("RANK") == "1":
                return child
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return None


def faulted_run(data: Path, folder: Path, kind: str, delay: float) -> dict[str, object]:
    """One run with one fault `delay` s after the first step; returns the figures of the table."""
    project, log = folder / "runs", folder / "attempt.log"
    job = launch(data, project, log, restarts=1 if kind == "sigkill" else 0)
    while progress_batches(log) == 0 and job.poll() is None:
        time.sleep(0.05)
    time.sleep(delay)
    hit = progress_batches(log)
    if kind == "sigkill" and (target := rank1(job)) is not None:
        target.send_signal(signal.SIGKILL)
    elif kind == "sigterm":
        job.send_signal(signal.SIGTERM)
    job.wait(timeout=600)
    text = log.read_text(errors="replace")
    if kind == "sigterm":
        again = folder / "resume.log"
        resume = launch(data, project, again, "--resume", str(project / "run" / "weights" / "last.pt"))
        resume.wait(timeout=600)
        text += again.read_text(errors="replace")
        completed = resume.returncode == 0
    else:
        completed = job.returncode == 0
    start = resumed_batches(text)
    rows = (project / "run" / "results.csv").read_text().splitlines()[1:] if completed else []
    return {
        "kind": kind,
        "completed": completed,
        "hit": hit,
        "resumed_from": start,
        "lost": None if start is None else max(0, hit - start),
        "load_failures": text.count("cannot be read") + text.count("instead"),
        "rows": len(rows),
        "run_dir": project / "run",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--runs", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        ensure_synthetic_dataset(root / "shapes", SPEC)
        data = root / "data.yaml"
        data.write_text(yaml.safe_dump({"path": "shapes", "train": "images/train", "val": "images/val",
                                        "names": list(SHAPE_NAMES)}))  # fmt: skip
        (root / "ref").mkdir()
        start = time.monotonic()
        reference = launch(data, root / "ref" / "runs", root / "ref" / "log")
        reference.wait(timeout=900)
        seconds = time.monotonic() - start
        if reference.returncode != 0:
            sys.exit(f"reference run failed:\n{(root / 'ref' / 'log').read_text()[-3000:]}")
        expected = final_weights(root / "ref" / "runs" / "run")
        print(f"reference: {EPOCHS} epochs x {BATCHES} batches, 2 ranks, {seconds:.0f} s wall")
        header = ("run", "fault", "done", "hit", "from", "lost", "loadfail", "rows", "bit-equal")
        print(" ".join(f"{name:>{width}}" for name, width in zip(header, (3, 7, 5, 4, 5, 5, 8, 4, 9), strict=True)))
        results = []
        for index in range(args.runs):
            kind = ("sigkill", "sigterm")[index % 2]
            folder = root / f"run{index}"
            folder.mkdir()
            result = faulted_run(data, folder, kind, delay=rng.uniform(0.05, 0.6) * seconds * 0.6)
            same = None
            if result["completed"]:
                weights = final_weights(result["run_dir"])
                same = weights.keys() == expected.keys() and all(torch.equal(weights[k], expected[k]) for k in weights)
            result["same"] = same
            results.append(result)
            print(f"{index:>3} {kind:>7} {result['completed']!s:>5} {result['hit']:>4} {result['resumed_from']!s:>5} "
                  f"{result['lost']!s:>5} {result['load_failures']:>8} {result['rows']:>4} {same!s:>9}")  # fmt: skip
        done = sum(bool(r["completed"]) for r in results)
        lost = [r["lost"] for r in results if r["lost"] is not None]
        print(f"completed {done}/{len(results)}; batches lost per fault: max {max(lost, default=0)}, "
              f"mean {sum(lost) / max(len(lost), 1):.1f} (save period {SAVE_STEPS}); checkpoint load failures "
              f"{sum(int(r['load_failures']) for r in results)}; final weights bit-equal to the reference in "
              f"{sum(r['same'] is True for r in results)}/{done} completed runs")  # fmt: skip


if __name__ == "__main__":
    main()
