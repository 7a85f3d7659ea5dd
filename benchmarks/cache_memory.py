"""Benchmark the image caches' memory cost in a 2-rank CPU run: peak PSS with --cache none, ram and shm.

Usage (from the repository root):

    python benchmarks/cache_memory.py                    # ~2000 images at 640 (>= 1.5 GB resized), 3 runs
    python benchmarks/cache_memory.py --dry-run          # build/scan the dataset, print the commands only
    python benchmarks/cache_memory.py --max-images 64 --imgsz 320   # quick smoke check (small, noisy)

Generates (or reuses) a synthetic dataset under `--root` whose images, resized to long side
`--imgsz`, total at least `--min-gb`, then launches the same torchrun training once per
`--modes` entry (default none, ram, shm). Every `--interval` seconds it sums the PSS
(proportional set size, /proc/<pid>/smaps_rollup) over every process of the run: the torchrun
launcher, the ranks and their DataLoader workers. PSS splits each shared page among the
processes that map it, so a cache buffer shared by a rank and its forked workers counts once,
while pages copied into a worker count again. The shm segment's pages are counted once in
full: PSS covers only the pages a process has touched, so the segment's part of the PSS is
replaced by the segment file's allocated size (the node holds all of it from the start).
The figure of merit, per cached mode, is

    (peak with the cache - peak with --cache none) / bytes of every resized image

with targets TARGETS (ram <= 1.10, shm <= 1.05): the cache should cost little more than the
pixels themselves, however many ranks and workers read it. A run with a per-rank copy of the
shm data would show about `--nproc` times that.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as `python benchmarks/cache_memory.py`
    sys.path.insert(0, str(ROOT))

from utils.data.cache import available_memory_bytes, resized_hw  # noqa: E402  (needs the sys.path line above)
from utils.data.image_files import list_image_files  # noqa: E402
from utils.data.scan import scan_labels  # noqa: E402
from utils.data.shm_cache import segment_path  # noqa: E402
from utils.data.synthetic import SyntheticSpec, ensure_synthetic_dataset  # noqa: E402
from utils.distributed import DistContext  # noqa: E402

GB = 1 << 30
MB = 1 << 20
TARGETS = {"ram": 1.10, "shm": 1.05}  # ratio targets per cached mode (issue 14)
BASELINE_ALLOWANCE = 6 * GB  # memory the run needs besides the cache (ranks, workers, model): refuse below this
IMAGES_PER_GB_AT_640 = 1100  # synthetic images (256-480 px sides) resized to 640: ~0.9 MB each


def default_root() -> Path:
    """Return /dev/shm/yolo-cache-bench when /dev/shm exists (no disk reads to add noise), else /tmp/..."""
    return Path("/dev/shm/yolo-cache-bench") if Path("/dev/shm").is_dir() else Path("/tmp/yolo-cache-bench")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the benchmark's flags; arguments after `--` are passed on to train.py."""
    parser = argparse.ArgumentParser(description="Peak PSS of a 2-rank CPU training run per --cache mode")
    parser.add_argument("--root", type=Path, default=default_root(), help="folder for the dataset and the run folders")
    parser.add_argument("--imgsz", type=int, default=640, help="training image size (pixels)")
    parser.add_argument("--num-train", type=int, default=2000, help="train images to generate (default ~1.8 GB at 640)")
    parser.add_argument("--num-val", type=int, default=16, help="val images (kept small: validation is not measured)")
    parser.add_argument("--min-gb", type=float, default=1.5, help="refuse datasets whose resized images total less")
    parser.add_argument("--max-images", type=int, default=0, help="smoke check: use only this many train images")
    parser.add_argument("--nproc", type=int, default=2, help="ranks (torchrun --nproc_per_node)")
    parser.add_argument("--workers", type=int, default=2, help="train.py --workers")
    parser.add_argument("--batch-size", type=int, default=8, help="train.py --batch-size (global)")
    parser.add_argument("--interval", type=float, default=0.5, help="seconds between PSS samples")
    parser.add_argument("--timeout", type=float, default=1200, help="kill a run after this many seconds")
    parser.add_argument("--modes", default="none,ram,shm", help="comma-separated --cache modes to run, in order")
    parser.add_argument("--dry-run", action="store_true", help="prepare and scan the dataset, print commands, stop")
    parser.add_argument("train_args", nargs="*", help="extra train.py flags, after `--`")
    return parser.parse_args(argv)


def prepare_dataset(root: Path, num_train: int, num_val: int) -> Path:
    """Generate (or reuse) a synthetic dataset with `num_train` train images under `root`; return its YAML.

    The YAML names the folders directly (no `builtin:` key), since the built-in name always
    means the default 1000-image spec.
    """
    spec = SyntheticSpec(num_train=num_train, num_val=num_val)
    data_dir = ensure_synthetic_dataset(root / f"synthetic-{num_train}-{num_val}", spec)
    yaml_path = root / f"synthetic-{num_train}-{num_val}.yaml"
    names = "".join(f"  - {name}\n" for name in spec.class_names)
    yaml_path.write_text(
        f"path: {data_dir}\ntrain: images/train\nval: images/val\n"
        f"val_annotations: annotations/instances_val.json\nnames:\n{names}"
    )
    return yaml_path


def resized_dataset_bytes(train_dir: Path, imgsz: int, num_classes: int) -> tuple[list[str], int]:
    """Return (the train image paths in dataset order, bytes of every one resized to long side `imgsz` as HxWx3 uint8).

    Sizes come from the label scan's (w, h) shapes through `utils.data.cache.resized_hw`, exactly as
    the caches size their buffers. The scan also writes the label cache the runs then reuse.
    """
    index = scan_labels(list_image_files(train_dir), num_classes, DistContext(), num_workers=4)
    sizes = [resized_hw(int(h), int(w), imgsz) for w, h in index.shapes]
    return list(index.im_files), int(sum(h * w * 3 for h, w in sizes))


def train_command(yaml_path: Path, mode: str, args: argparse.Namespace) -> list[str]:
    """Return the torchrun command line of one measured run (`--cache mode`)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",  # free rendezvous port, so a second job on this machine cannot collide
        f"--nproc_per_node={args.nproc}",
        "train.py",
        "--device=cpu",
        "--epochs=1",
        f"--workers={args.workers}",
        f"--imgsz={args.imgsz}",
        f"--batch-size={args.batch_size}",
        "--noval",
        "--nosave",
        f"--cache={mode}",
        f"--data={yaml_path}",
        f"--project={args.root / 'runs'}",
        f"--name=cache-{mode}",
        "--exist-ok",
        *args.train_args,
    ]


def child_pids() -> dict[int, list[int]]:
    """Return parent pid -> child pids for every process visible in /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", encoding="ascii", errors="replace") as file:
                stat = file.read()
        except OSError:  # exited while we looked
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])  # the command name may hold spaces and ')'
        children.setdefault(parent, []).append(int(entry.name))
    return children


def process_tree(root_pid: int) -> list[tuple[int, int]]:
    """Return (pid, depth) for `root_pid` and all its descendants; depth 0 is the root."""
    children = child_pids()
    tree, frontier = [], [(root_pid, 0)]
    while frontier:
        pid, depth = frontier.pop()
        tree.append((pid, depth))
        frontier += [(child, depth + 1) for child in children.get(pid, [])]
    return tree


def pss_bytes(pid: int) -> int:
    """Return the PSS of process `pid` in bytes from /proc/<pid>/smaps_rollup (0 if it has exited)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", encoding="ascii") as file:
            for line in file:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def mapping_pss_bytes(pid: int, path: Path) -> int:
    """Return the PSS of process `pid`'s mappings of file `path` (also once unlinked), from /proc/<pid>/smaps."""
    total, inside = 0, False
    names = (str(path), f"{path} (deleted)")
    try:
        with open(f"/proc/{pid}/smaps", encoding="ascii", errors="replace") as file:
            for line in file:
                fields = line.split(maxsplit=5)
                if "-" in fields[0] and not fields[0].endswith(":"):  # a mapping's header line
                    inside = len(fields) == 6 and fields[5].rstrip("\n") in names
                elif inside and fields[0] == "Pss:":
                    total += int(fields[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return total


@dataclass
class RunResult:
    """What one measured run produced: its peak summed PSS, when, the split by role, and how it ended."""

    mode: str
    peak_bytes: int = 0
    peak_at_s: float = 0.0
    peak_by_role: dict[str, list[int]] = field(default_factory=dict)
    seconds: float = 0.0
    returncode: int | None = None
    stopped: str = ""  # "" when the run ended by itself, else why it was killed
    timeline: list[tuple[float, dict[str, list[int]]]] = field(default_factory=list)  # (seconds, PSS by role)


def sample_once(root_pid: int, segment: Path | None = None) -> tuple[int, dict[str, list[int]]]:
    """Return (summed PSS, PSS per process grouped as launcher / rank / worker) of the run's process tree.

    With `segment` (--cache shm), the processes' PSS of that file is taken out and the file's
    allocated bytes are counted once instead, under "shm segment".
    """
    roles = {0: "launcher", 1: "ranks", 2: "workers"}
    by_role: dict[str, list[int]] = {}
    segment_pss = 0
    for pid, depth in process_tree(root_pid):
        in_segment = mapping_pss_bytes(pid, segment) if segment is not None else 0
        segment_pss += in_segment
        by_role.setdefault(roles.get(depth, "deeper"), []).append(pss_bytes(pid) - in_segment)
    if segment is not None:
        try:
            allocated = os.stat(segment).st_blocks * 512
        except FileNotFoundError:  # not created yet, or removed at the end: what is still mapped counts
            allocated = 0
        by_role["shm segment"] = [max(allocated, segment_pss)]
    return sum(sum(values) for values in by_role.values()), by_role


def stop_group(proc: subprocess.Popen) -> None:
    """End the run we started: SIGTERM to its process group, SIGKILL after 30 s."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


def run_and_sample(
    command: list[str], mode: str, log_path: Path, args: argparse.Namespace, segment: Path | None = None
) -> RunResult:
    """Run `command` in its own process group, sampling its tree's PSS until it exits, times out or grows too big.

    `segment`: the shm cache file of an --cache shm run (see `sample_once`). The run is killed
    when it exceeds `args.timeout` or when its PSS reaches 85% of the memory that was available
    at launch (this machine must stay usable).
    """
    result = RunResult(mode)
    memory_limit = int(0.85 * available_memory_bytes())
    start = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            while proc.poll() is None:
                total, by_role = sample_once(proc.pid, segment)
                elapsed = time.perf_counter() - start
                result.timeline.append((elapsed, by_role))
                if total > result.peak_bytes:
                    result.peak_bytes, result.peak_at_s, result.peak_by_role = total, elapsed, by_role
                if total > memory_limit or elapsed > args.timeout:
                    result.stopped = f"PSS {total / GB:.2f} GiB" if total > memory_limit else f"timeout {args.timeout}s"
                    stop_group(proc)
                    break
                time.sleep(args.interval)
        finally:
            if proc.poll() is None:  # interrupted (Ctrl-C): do not leave the ranks running
                stop_group(proc)
    result.seconds = time.perf_counter() - start
    result.returncode = proc.returncode
    return result


def describe(result: RunResult) -> str:
    """One line: peak PSS, when it happened, and its split over launcher / ranks / workers."""
    parts = [
        f"{role} " + "+".join(f"{value / MB:.0f}" for value in values) for role, values in result.peak_by_role.items()
    ]
    status = f"exit {result.returncode}" + (f", killed: {result.stopped}" if result.stopped else "")
    return (
        f"--cache {result.mode:<4}: peak PSS {result.peak_bytes / GB:6.3f} GiB at {result.peak_at_s:5.0f}s of "
        f"{result.seconds:.0f}s ({status}; {len(result.timeline)} samples) | MB at peak: {', '.join(parts)}"
    )


def write_timeline(result: RunResult, path: Path) -> None:
    """Write the run's samples as CSV: seconds, total PSS MB, then launcher/ranks/workers MB and process count."""
    lines = ["seconds,total_mb,launcher_mb,ranks_mb,workers_mb,processes"]
    for elapsed, by_role in result.timeline:
        role_mb = [sum(by_role.get(role, [])) / MB for role in ("launcher", "ranks", "workers")]
        total_mb = sum(sum(values) for values in by_role.values()) / MB
        count = sum(len(values) for values in by_role.values())
        lines.append(f"{elapsed:.2f},{total_mb:.1f}," + ",".join(f"{mb:.1f}" for mb in role_mb) + f",{count}")
    path.write_text("\n".join(lines) + "\n")


def check_size(args: argparse.Namespace, dataset_bytes: int) -> None:
    """Refuse a dataset too small to measure (unless --max-images) or too big for this machine's memory."""
    if not args.max_images and dataset_bytes < args.min_gb * GB:
        need = int(np.ceil(args.min_gb * IMAGES_PER_GB_AT_640 * (640 / args.imgsz) ** 2))
        raise SystemExit(
            f"error: resized images total {dataset_bytes / GB:.2f} GiB < --min-gb {args.min_gb}; "
            f"use --num-train {need} or more"
        )
    available = available_memory_bytes()
    if dataset_bytes + BASELINE_ALLOWANCE > available:
        raise SystemExit(
            f"error: the cache needs {dataset_bytes / GB:.2f} GiB + ~{BASELINE_ALLOWANCE / GB:.0f} GiB for training "
            f"but only {available / GB:.2f} GiB is available; use fewer --num-train images"
        )


def print_comparison(results: dict[str, RunResult], dataset_bytes: int) -> None:
    """Print, for each cached mode, its peak against --cache none's and the ratio to the resized dataset."""
    baseline = results["none"]
    print(
        f"resized dataset {dataset_bytes / GB:.3f} GiB | peak PSS with --cache none {baseline.peak_bytes / GB:.3f} GiB"
    )
    for mode, result in results.items():
        if mode == "none":
            continue
        extra = result.peak_bytes - baseline.peak_bytes
        ratio = extra / dataset_bytes
        target = TARGETS.get(mode)
        verdict = "" if target is None else f" (target <= {target:.2f}): {'PASS' if ratio <= target else 'FAIL'}"
        print(
            f"--cache {mode:<4}: peak PSS {result.peak_bytes / GB:.3f} GiB, {extra / GB:+.3f} GiB over none; "
            f"ratio (with - without) / dataset = {ratio:.3f}{verdict}"
        )


def main(argv: list[str] | None = None) -> None:
    """Prepare the dataset, run training with each cache mode while sampling PSS, print the comparison."""
    args = parse_args(argv)
    args.root.mkdir(parents=True, exist_ok=True)
    num_train = args.max_images or args.num_train
    yaml_path = prepare_dataset(args.root, num_train, args.num_val)
    train_dir = args.root / f"synthetic-{num_train}-{args.num_val}" / "images" / "train"
    image_files, dataset_bytes = resized_dataset_bytes(train_dir, args.imgsz, len(SyntheticSpec().class_names))
    print(f"dataset: {yaml_path} | {len(image_files)} train images resized to {args.imgsz}: {dataset_bytes:,} bytes")
    check_size(args, dataset_bytes)
    modes = [mode.strip() for mode in args.modes.split(",") if mode.strip()]
    results: dict[str, RunResult] = {}
    for mode in modes:
        command = train_command(yaml_path, mode, args)
        log_path = args.root / f"train-cache-{mode}.log"
        print(f"$ {' '.join(command)}   > {log_path}", flush=True)
        if args.dry_run:
            continue
        # The segment train.py's ranks will share: same files in the same order, at the training resize.
        segment = segment_path(image_files, args.imgsz, augment=True) if mode == "shm" else None
        results[mode] = run_and_sample(command, mode, log_path, args, segment)
        write_timeline(results[mode], args.root / f"pss-cache-{mode}.csv")
        print(describe(results[mode]), flush=True)
        if results[mode].returncode != 0 and not results[mode].stopped:
            print(f"warning: --cache {mode} run failed; see the end of {log_path}")
        if segment is not None:
            seen = any(by_role.get("shm segment", [0])[0] > 0 for _, by_role in results[mode].timeline)
            after = "still exists" if segment.exists() else "is gone"
            print(f"--cache shm: segment {segment} {'seen' if seen else 'NOT seen'} during the run, {after} after it")
    if "none" in results and len(results) > 1:
        print_comparison(results, dataset_bytes)


if __name__ == "__main__":
    main()
