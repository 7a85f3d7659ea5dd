"""Benchmark what a forked loader worker copies of the dataset's image paths: a list of str against PackedStrings.

Usage (from the repository root, Linux):

    python benchmarks/path_memory.py                  # 1,000,000 paths of 60 characters
    python benchmarks/path_memory.py --paths 100000

For each form, a forked child reads every path once in random order, as the workers of a
training run do over an epoch, and reports the private memory it gained (smaps_rollup:
Private_Clean + Private_Dirty, i.e. pages it no longer shares with its parent) and the time per
path. The order array is made before the fork and read as NumPy integers, so the harness itself
copies nothing. Target: the packed form copies under 1 MB whatever the number of paths.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from utils.data.packed_strings import PackedStrings  # noqa: E402  # after the path is set

TARGET_PACKED_MB = 1.0


def private_mb() -> float:
    """This process's pages that no other process shares, in MB."""
    with open("/proc/self/smaps_rollup") as rollup:
        kb = sum(int(line.split()[1]) for line in rollup if line.startswith(("Private_Dirty", "Private_Clean")))
    return kb / 1024


def read_in_child(paths: list[str] | PackedStrings, order: np.ndarray) -> tuple[float, float]:
    """Fork; the child reads paths[i] for every i in `order`. Returns (MB it copied, microseconds per path)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            before, start = private_mb(), time.perf_counter()
            for i in order:
                len(paths[i])
            seconds = time.perf_counter() - start
            os.write(write_end, f"{private_mb() - before} {seconds * 1e6 / len(order)}".encode())
        finally:
            os._exit(0)
    os.close(write_end)
    os.waitpid(pid, 0)
    with os.fdopen(read_end) as answer:
        copied, per_path = map(float, answer.read().split())
    return copied, per_path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--paths", type=int, default=1_000_000, help="how many image paths")
    args = parser.parse_args()
    paths = [f"/datasets/objects365/images/train/obj365_{i:012d}.jpg" for i in range(args.paths)]
    order = np.random.default_rng(0).permutation(len(paths))
    start = time.perf_counter()
    packed = PackedStrings.pack(paths)
    pack_seconds = time.perf_counter() - start
    print(f"{len(paths):,} paths of {len(paths[0])} characters; packing took {pack_seconds:.2f} s")
    print(f"{'form':<16}{'copied by the child (MB)':>26}{'us per path':>14}")
    results = {}
    for name, form in (("list of str", paths), ("PackedStrings", packed)):
        results[name] = read_in_child(form, order)
        print(f"{name:<16}{results[name][0]:>26.1f}{results[name][1]:>14.2f}")
    met = results["PackedStrings"][0] < TARGET_PACKED_MB
    print(f"target: PackedStrings copies < {TARGET_PACKED_MB} MB: {'met' if met else 'MISSED'}")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
