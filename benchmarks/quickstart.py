"""Benchmark the quick start: run `python train.py` as a user would and report wall time and final accuracy.

Usage (from the repository root):

    python benchmarks/quickstart.py                     # exactly `python train.py`
    python benchmarks/quickstart.py -- --epochs 5       # extra flags are passed on to train.py

train.py's own output streams through unchanged. At the end this prints the wall time (process
start to exit, dataset generation on first use included), the final mAP50 and mAP50-95 and the
path of best.pt, parsed from the "Done: ..." line train.py prints, and checks them against the
targets: at most 15 minutes and mAP50 >= 0.5 on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGET_MINUTES = 15.0
TARGET_MAP50 = 0.5
DONE_LINE = re.compile(
    r"Done: (?P<epochs>\d+) epochs\. Final mAP50 (?P<map50>[\d.]+) mAP50-95 (?P<map>[\d.]+)\. "
    r"Best weights: (?P<best>.+)$"
)


@dataclass(frozen=True)
class QuickstartResult:
    """What one quick-start run produced; the metric fields are None when no "Done:" line was printed."""

    seconds: float
    returncode: int
    epochs: int | None = None
    map50: float | None = None
    map50_95: float | None = None
    best: str | None = None


def parse_done_line(lines: list[str]) -> dict[str, str] | None:
    """Return the fields of the last "Done: ..." line train.py printed, or None if there is none."""
    for line in reversed(lines):
        match = DONE_LINE.search(line.strip())
        if match:
            return match.groupdict()
    return None


def run_train(train_args: list[str]) -> QuickstartResult:
    """Run `python train.py *train_args` from the repository root, echo its stdout, time it to exit.

    stderr (logs, progress bars) goes straight to the terminal; stdout is read line by line so
    the "Done:" line can be parsed.
    """
    command = [sys.executable, "train.py", *train_args]
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
        seconds, proc.returncode, int(done["epochs"]), float(done["map50"]), float(done["map"]), done["best"].strip()
    )


def report(result: QuickstartResult) -> bool:
    """Print the figures and the target check; return whether both targets were met."""
    cpus = len(os.sched_getaffinity(0))
    print(f"\nquickstart on {cpus} CPU core(s): wall time {result.seconds:.1f}s ({result.seconds / 60:.2f} min)")
    if result.map50 is None:
        print(f"train.py exited with code {result.returncode} without a 'Done:' line; no metrics")
        return False
    print(f"epochs {result.epochs} | final mAP50 {result.map50:.4f} | mAP50-95 {result.map50_95:.4f}")
    print(f"best.pt: {result.best}")
    time_ok = result.seconds <= TARGET_MINUTES * 60
    map_ok = result.map50 >= TARGET_MAP50
    print(
        f"targets: wall time <= {TARGET_MINUTES:.0f} min: {'PASS' if time_ok else 'FAIL'} | "
        f"mAP50 >= {TARGET_MAP50}: {'PASS' if map_ok else 'FAIL'}"
    )
    return time_ok and map_ok and result.returncode == 0


def main(argv: list[str] | None = None) -> None:
    """Run the quick start, print its figures; exit 1 when a target is missed or training failed."""
    parser = argparse.ArgumentParser(description="Time `python train.py` and report its final accuracy")
    parser.add_argument("train_args", nargs="*", help="extra train.py flags, after `--`")
    args = parser.parse_args(argv)
    sys.exit(0 if report(run_train(args.train_args)) else 1)


if __name__ == "__main__":
    main()
