"""Benchmark the quick start: run `python train.py` as a user would and report wall time and final accuracy.

Usage (from the repository root):

    python benchmarks/quickstart.py                     # exactly `python train.py`
    python benchmarks/quickstart.py --task segment      # exactly `python segment/train.py`
    python benchmarks/quickstart.py -- --epochs 5       # extra flags are passed on to the script

The script's own output streams through unchanged. At the end this prints the wall time (process
start to exit, dataset generation on first use included), the final box (and mask) mAP50 and
mAP50-95 and the path of best.pt, parsed from the "Done: ..." line the script prints, and checks
them against the targets on 2 CPU cores: detection <= 15 minutes and mAP50 >= 0.5; segmentation
<= 20 minutes and mask mAP50 >= 0.5.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# task -> (script, minutes allowed, the mAP50 key that must reach TARGET_MAP50)
TASKS = {"detect": ("train.py", 15.0, "mAP50"), "segment": ("segment/train.py", 20.0, "mask_mAP50")}
TARGET_MAP50 = 0.5
DONE_LINE = re.compile(
    r"Done: (?P<epochs>\d+) epochs(?: \([^)]*\))?\. Final (?P<scores>.+?)\. Best weights: (?P<best>.+)$"
)


@dataclass(frozen=True)
class QuickstartResult:
    """What one quick-start run produced; `scores` is empty when no "Done:" line was printed."""

    seconds: float
    returncode: int
    epochs: int | None = None
    scores: dict[str, float] = field(default_factory=dict)
    best: str | None = None


def parse_done_line(lines: list[str]) -> dict[str, str] | None:
    """Return the fields of the last "Done: ..." line the script printed, or None if there is none."""
    for line in reversed(lines):
        match = DONE_LINE.search(line.strip())
        if match:
            return match.groupdict()
    return None


def parse_scores(text: str) -> dict[str, float]:
    """Turn "mAP50 0.59 mAP50-95 0.43 ..." into {"mAP50": 0.59, "mAP50-95": 0.43, ...}."""
    words = text.split()
    return {key: float(value) for key, value in zip(words[::2], words[1::2], strict=True)}


def run_train(script: str, train_args: list[str]) -> QuickstartResult:
    """Run `python <script> *train_args` from the repository root, echo its stdout, time it to exit.

    stderr (logs, progress bars) goes straight to the terminal; stdout is read line by line so
    the "Done:" line can be parsed.
    """
    command = [sys.executable, script, *train_args]
    print(f"$ {' '.join(command)}", flush=True)
    lines: list[str] = []
    start = time.perf_counter()
    with subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, text=True, bufsize=1) as proc:
        assert proc.stdout is not None  # stdout=PIPE
        for line in proc.stdout:
            sys.stdout.write(line)
            lines.append(line)
    seconds = time.perf_counter() - start
    done = parse_done_line(lines)
    if done is None:
        return QuickstartResult(seconds, proc.returncode)
    return QuickstartResult(
        seconds, proc.returncode, int(done["epochs"]), parse_scores(done["scores"]), done["best"].strip()
    )


def report(result: QuickstartResult, task: str) -> bool:
    """Print the figures and the target check; return whether both targets were met."""
    script, minutes, target_key = TASKS[task]
    cpus = len(os.sched_getaffinity(0))
    print(f"\n{script} on {cpus} CPU core(s): wall time {result.seconds:.1f}s ({result.seconds / 60:.2f} min)")
    if not result.scores:
        print(f"{script} exited with code {result.returncode} without a 'Done:' line; no metrics")
        return False
    print(f"epochs {result.epochs} | final " + " | ".join(f"{k} {v:.4f}" for k, v in result.scores.items()))
    print(f"best.pt: {result.best}")
    time_ok = result.seconds <= minutes * 60
    map_ok = result.scores.get(target_key, 0.0) >= TARGET_MAP50
    print(
        f"targets: wall time <= {minutes:.0f} min: {'PASS' if time_ok else 'FAIL'} | "
        f"{target_key} >= {TARGET_MAP50}: {'PASS' if map_ok else 'FAIL'}"
    )
    return time_ok and map_ok and result.returncode == 0


def main(argv: list[str] | None = None) -> None:
    """Run the quick start, print its figures; exit 1 when a target is missed or training failed."""
    parser = argparse.ArgumentParser(description="Time `python train.py` (or segment/train.py) and report accuracy")
    parser.add_argument("--task", choices=tuple(TASKS), default="detect", help="detect: train.py; segment: segment/")
    parser.add_argument("train_args", nargs="*", help="extra flags for the training script, after `--`")
    args = parser.parse_args(argv)
    sys.exit(0 if report(run_train(TASKS[args.task][0], args.train_args), args.task) else 1)


if __name__ == "__main__":
    main()
