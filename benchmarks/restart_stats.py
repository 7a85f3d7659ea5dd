"""Benchmark the file digest a restart computes to trust its label cache: stat calls per rank, and seconds.

Usage (from the repository root):

    python benchmarks/restart_stats.py                      # 200,000 images + labels, 1, 2 and 4 ranks
    python benchmarks/restart_stats.py --images 1000000 --ranks 8

Every start of a run (and every elastic restart) digests the size and modification time of each
image and label file to decide whether the label cache is current (utils/data/file_digest.py).
The script makes empty image and label files under a temporary folder, then runs the digest on
N gloo ranks of this machine (one node) two ways, alternating, each run in fresh processes:

- `each rank`: every rank stats every file itself (what a node of N ranks did before the split;
  the same as N separate nodes);
- `split`: the node's ranks stat an interleaved share of the chunks each and pool the digests.

It prints the stat calls on the files per rank, the node's total, and the slowest rank's seconds
for the digest (median of `--repeats`). Files are in the page cache after the first run, so the
seconds are those of a local disk's cached metadata: on a network file system each call is a
round trip and the calls per node are what the wait scales with. Target: the node's calls equal
the number of files whatever N (split), against N x the files (each rank).
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import utils.data.file_digest as file_digest  # noqa: E402  # after the path is set
from utils.distributed import DistContext  # noqa: E402


def make_files(root: Path, num_images: int) -> tuple[list[str], list[str]]:
    """Create `num_images` empty .jpg files and their .txt labels under root/images and root/labels."""
    images, labels = [], []
    for folder, suffix, paths in (("images", ".jpg", images), ("labels", ".txt", labels)):
        (root / folder).mkdir(parents=True, exist_ok=True)
        for i in range(num_images):
            path = root / folder / f"{i:08d}{suffix}"
            path.touch()
            paths.append(str(path))
    return images, labels


def _rank(rank: int, world_size: int, root: str, init: str, mode: str, out: str) -> None:
    """One rank: digest the files, count this rank's stat calls on them, write 'digest calls seconds'."""
    dist.init_process_group(
        "gloo", init_method=f"file://{init}", rank=rank, world_size=world_size, timeout=datetime.timedelta(minutes=10)
    )
    if mode == "each rank":
        file_digest.mount_identity = lambda folder: f"rank-{rank}"  # every rank a node of its own
    images = sorted(str(p) for p in Path(root, "images").iterdir())
    labels = sorted(str(p) for p in Path(root, "labels").iterdir())
    calls = 0
    real_stat = os.stat
    files = (str(Path(root, "images")) + os.sep, str(Path(root, "labels")) + os.sep)

    def counting_stat(path: object, *args: object, **kwargs: object) -> os.stat_result:
        nonlocal calls
        calls += str(path).startswith(files)  # the files' own calls, not mount_identity's
        return real_stat(path, *args, **kwargs)  # type: ignore[arg-type]

    ctx = DistContext(rank=rank, local_rank=rank, world_size=world_size, local_world_size=world_size)
    dist.barrier()
    os.stat = counting_stat  # type: ignore[assignment]
    start = time.perf_counter()
    digest = file_digest.stat_digest([images, labels], b"bench", ctx)
    seconds = time.perf_counter() - start
    os.stat = real_stat  # type: ignore[assignment]
    Path(out, f"{rank}").write_text(f"{digest.hex()} {calls} {seconds}")
    dist.destroy_process_group()


def run(world_size: int, root: Path, mode: str) -> tuple[str, list[int], float]:
    """Digest on `world_size` fresh ranks; return (digest, stat calls per rank, slowest rank's seconds)."""
    with tempfile.TemporaryDirectory() as scratch:
        init, out = Path(scratch, "init"), Path(scratch, "out")
        out.mkdir()
        mp.spawn(_rank, args=(world_size, str(root), str(init), mode, str(out)), nprocs=world_size)
        rows = [Path(out, f"{rank}").read_text().split() for rank in range(world_size)]
    digests = {row[0] for row in rows}
    assert len(digests) == 1, f"ranks disagree: {digests}"
    return rows[0][0], [int(row[1]) for row in rows], max(float(row[2]) for row in rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=200_000, help="images (each with a label file)")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4], help="ranks of the one node")
    parser.add_argument("--repeats", type=int, default=3, help="runs per row; the median seconds is printed")
    parser.add_argument("--dir", type=Path, default=None, help="where to make the files (default: a temp folder)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        root = Path(folder)
        start = time.perf_counter()
        make_files(root, args.images)
        print(f"made {args.images} images and {args.images} labels in {time.perf_counter() - start:.1f} s")
        print(f"{'ranks':>5}  {'mode':<9}  {'stat calls per rank':>20}  {'node total':>10}  {'seconds':>7}")
        digests = set()
        for world_size in args.ranks:
            seconds: dict[str, list[float]] = {"each rank": [], "split": []}
            calls: dict[str, list[int]] = {}
            for _ in range(args.repeats):
                for mode in seconds:  # alternating, so both see the same machine state
                    digest, calls[mode], took = run(world_size, root, mode)
                    seconds[mode].append(took)
                    digests.add(digest)
            for mode, times in seconds.items():
                per_rank = f"{min(calls[mode])}-{max(calls[mode])}"
                print(
                    f"{world_size:>5}  {mode:<9}  {per_rank:>20}  {sum(calls[mode]):>10}  "
                    f"{statistics.median(times):>7.2f}"
                )
        print(f"one digest for every row and rank count: {len(digests) == 1}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
