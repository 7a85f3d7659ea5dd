"""Benchmark the training data pipeline: images/s of augmented items, in one process and through the loader.

Usage (from the repository root):

    python benchmarks/data_pipeline.py                       # imgsz 640, loader with 0, 1, 2 workers, RAM cache
    python benchmarks/data_pipeline.py --imgsz 320 --workers 0 4 --batches 40 --cache none

Builds the training dataset as `train.py` does on one rank (augment on, strengths from `--hyp`,
by default YOLOv5's hyp.scratch-low.yaml rather than the quick start's; the chosen cache mode),
then measures (a) `__getitem__` called in this process, twice: as a CPU run builds it (HSV jitter
in the item) and as a CUDA run does (HSV gains drawn, the jitter left to the GPU), and the floor of
one mosaic sample (one cv2.warpAffine of the 2x canvas); (b) batches drawn through
`utils.data.loader.build_train_loader` with each `--workers` count, each after a warm-up that is not
timed, from the dataset of `--hsv` (default: as on CUDA). Prints images/s and ms/image, then the
ratios issue 14 targets: __getitem__ / warp floor, and loader W workers / 0 workers.

This process runs OpenCV on `--cv-threads` threads (default 1), as every loader worker does: the
single-process figures are then one core's, the unit the worker counts are compared to. (With
OpenCV's own pool the 0-worker loader also uses every core; that is what `train.py --workers 0`
gets, and `--cv-threads 0` shows it.)
Then (c) the label scan of the train images without a label cache, in this process and in worker
processes (start-up included), and the re-read of an unchanged dataset's label cache, and (d) the
RAM cache fill of this rank's shard (decode + resize, with the dataset's thread count). The files
are in the page cache by then (the dataset build read them), so (c) and (d) measure CPU, not disk.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import cv2
import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as `python benchmarks/data_pipeline.py`
    sys.path.insert(0, str(ROOT))

from utils.config import DEFAULT_DATA, DEFAULT_HYP  # noqa: E402  (needs the sys.path line above)
from utils.data.cache import ImageCache  # noqa: E402
from utils.data.data_config import load_data_config  # noqa: E402
from utils.data.dataset import DatasetOptions, LoadImagesAndLabels  # noqa: E402
from utils.data.loader import build_train_loader  # noqa: E402
from utils.data.scan import VerifierPool, scan_labels, scan_pool_size, scan_workers  # noqa: E402
from utils.distributed import DistContext  # noqa: E402
from utils.hyp import load_hyp  # noqa: E402  (needs the sys.path line above)
from utils.logs import setup_logging  # noqa: E402
from utils.train.setup import augment_params  # noqa: E402

LOGGER = logging.getLogger("benchmarks.data_pipeline")
MODEL_STRIDE = 32  # largest stride of every YOLOv5 size; only used for rect shapes, which are off here
SCAN_REPEATS = 2  # label scans are short (about a second): the best of two is less noisy than one


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the benchmark's flags."""
    parser = argparse.ArgumentParser(description="Measure images/s of the augmented training data pipeline")
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="dataset YAML (default: built-in synthetic)")
    parser.add_argument("--hyp", type=Path, default=DEFAULT_HYP, help="hyp YAML with the augmentation strengths")
    parser.add_argument("--imgsz", type=int, default=640, help="training image size (pixels)")
    parser.add_argument(
        "--workers", type=int, nargs="+", default=[0, 1, 2], help="DataLoader worker counts timed in part (b)"
    )
    parser.add_argument("--batches", type=int, default=20, help="timed batches in part (b)")
    parser.add_argument("--batch-size", type=int, default=16, help="images per batch (one rank's batch)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed batches before timing (a) and (b)")
    parser.add_argument("--cache", default="ram", choices=("ram", "disk", "none"), help="image cache mode")
    parser.add_argument(
        "--hsv", default="device", choices=("device", "worker"), help="where the loader's items get their HSV jitter"
    )
    parser.add_argument("--cv-threads", type=int, default=1, help="OpenCV threads here (0: OpenCV's default pool)")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def build_dataset(args: argparse.Namespace, ctx: DistContext) -> LoadImagesAndLabels:
    """Build the single-rank training dataset the way `utils.train.setup.build_datasets` does."""
    data = load_data_config(args.data, ctx)
    options = DatasetOptions(
        img_size=args.imgsz,
        batch_size=args.batch_size,
        augment=True,
        aug=augment_params(load_hyp(args.hyp), rect=False),
        rect=False,
        stride=MODEL_STRIDE,
        cache_mode=args.cache,
        num_classes=len(data.names),
        seed=args.seed,
        workers=max(1, max(args.workers)),
        hsv_on_device=args.hsv == "device",
    )
    return LoadImagesAndLabels(data.split("train"), options, ctx)


def time_getitem(dataset: LoadImagesAndLabels, num_items: int, num_warmup: int, seed: int) -> float:
    """Return seconds per item of `dataset[(index, epoch)]` in this process, over `num_items` random keys.

    Keys are (index, epoch) pairs as the train sampler sends them; the first `num_warmup` are
    not timed (first-touch of cache pages, OpenCV thread pools).
    """
    order = np.random.default_rng(seed).permutation(np.resize(dataset.shard, num_items + num_warmup))
    for index in order[:num_warmup]:
        dataset[(int(index), 0)]
    start = time.perf_counter()
    for index in order[num_warmup:]:
        dataset[(int(index), 0)]
    return (time.perf_counter() - start) / num_items


def time_warp_floor(img_size: int, repeats: int = 50) -> float:
    """Seconds of one cv2.warpAffine of a (2 imgsz)^2 x 3 mosaic canvas to imgsz^2: the floor of a mosaic sample.

    Every mosaic item does this warp (random_perspective); the rest of __getitem__ is overhead
    to compare against it.
    """
    canvas = np.random.default_rng(0).integers(0, 256, (2 * img_size, 2 * img_size, 3), dtype=np.uint8)
    matrix = np.array([[0.9, 0.05, -img_size / 2], [-0.04, 0.95, -img_size / 2]], dtype=np.float64)
    cv2.warpAffine(canvas, matrix, (img_size, img_size), borderValue=(114, 114, 114))
    start = time.perf_counter()
    for _ in range(repeats):
        cv2.warpAffine(canvas, matrix, (img_size, img_size), borderValue=(114, 114, 114))
    return (time.perf_counter() - start) / repeats


def time_loader(
    dataset: LoadImagesAndLabels, args: argparse.Namespace, ctx: DistContext, num_workers: int
) -> tuple[float, int, int]:
    """Return (seconds per image, images timed, workers used) for batches drawn through the train loader.

    Worker start-up and the first `args.warmup` batches are not timed. When an epoch has fewer
    batches than needed the loader moves on to the next epoch (workers are persistent).
    """
    loader = build_train_loader(dataset, args.batch_size, num_workers, ctx, args.seed)
    epoch, images, start = 0, 0, 0.0
    batches_seen = 0
    while batches_seen < args.warmup + args.batches:
        loader.set_epoch(epoch)
        for batch in loader.lent():  # as train_one_epoch draws them: images read in place, not copied
            batches_seen += 1
            if batches_seen == args.warmup:
                start = time.perf_counter()
            elif batches_seen > args.warmup:
                images += len(batch["images"])
            if batches_seen >= args.warmup + args.batches:
                break
        epoch += 1
    seconds = time.perf_counter() - start
    return seconds / max(images, 1), images, loader.num_workers


def best_seconds(run: Callable[[], object], repeats: int = SCAN_REPEATS) -> float:
    """Return the shortest wall time of `repeats` calls of `run`: the least disturbed by other work on the machine."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def verify_with_pool(files: list[str], num_classes: int, workers: int) -> None:
    """Verify `files` with a VerifierPool of `workers` (1: in this process), starting and stopping its workers."""
    with VerifierPool(workers) as pool:
        pool.verify(files, num_classes)


def time_label_scan(dataset: LoadImagesAndLabels, ctx: DistContext) -> list[tuple[str, float, str]]:
    """Return (label, seconds per image, detail) rows: the label scan without a cache, both ways, and the cache re-read.

    The scans verify every train image and label file as a first run does, in this process and
    in scan_pool_size worker processes (their start-up included, as a scan pays it); which of the
    two `scan_labels` picks for this many files is in the detail. The re-read is what every later
    run does: stat every image and label, compare the digest, load the .npz; no image is opened.
    Each figure is the best of SCAN_REPEATS runs.
    """
    files, num_classes = sorted(dataset.im_files), dataset.options.num_classes
    picked = max(scan_workers(len(files), ctx), 1)
    rows = []
    for workers in sorted({1, scan_pool_size(ctx)}):
        seconds = best_seconds(functools.partial(verify_with_pool, files, num_classes, workers))
        label = "this process" if workers == 1 else f"{workers} worker processes"
        detail = f"{len(files)} files{', what scan_labels picks' if workers == picked else ''}"
        rows.append((f"(c) label scan, {label}", seconds / len(files), detail))
    with tempfile.TemporaryDirectory() as folder:
        cache = Path(folder) / "labels.cache"
        scan_labels(files, num_classes, ctx, cache_path=cache)  # writes the cache
        seconds = best_seconds(functools.partial(scan_labels, files, num_classes, ctx, cache_path=cache))
        rows.append(("(c) label cache re-read", seconds / len(files), "unchanged dataset, no image opened"))
    return rows


def time_cache_fill(
    dataset: LoadImagesAndLabels, args: argparse.Namespace, ctx: DistContext
) -> tuple[float, str] | None:
    """Return (seconds per image, detail) of filling a RAM ImageCache with this rank's shard, as the dataset does.

    Decode and resize to `--imgsz` with the dataset's thread count, into a second cache that is
    dropped afterwards (the dataset's own cache stays as the loader timings used it). None when
    that second cache does not fit in memory (ImageCache then logs why).
    """
    threads = dataset.options.workers
    start = time.perf_counter()
    cache = ImageCache(dataset.im_files, dataset.shapes, dataset.shard, args.imgsz, "ram", ctx, threads, augment=True)
    seconds = time.perf_counter() - start
    if not len(cache):
        return None
    return seconds / len(cache), f"{len(cache)} images, {threads} threads, {cache.nbytes / 2**30:.2f} GiB"


def report(label: str, seconds_per_image: float, detail: str) -> None:
    """Print one result line: images/s and ms/image."""
    print(f"{label:<34} {1 / seconds_per_image:8.1f} images/s  {1000 * seconds_per_image:7.2f} ms/image  ({detail})")


def main(argv: list[str] | None = None) -> None:
    """Build the dataset, time (a) raw __getitem__ and (b) the multi-worker loader, print the figures."""
    args = parse_args(argv)
    if args.warmup < 1:
        raise SystemExit("error: --warmup must be at least 1 (the first batch includes worker start-up)")
    if args.cv_threads:
        cv2.setNumThreads(args.cv_threads)
    ctx = DistContext()
    setup_logging(ctx)
    start = time.perf_counter()
    dataset = build_dataset(args, ctx)
    build_seconds = time.perf_counter() - start
    cached = len(dataset.cache) if dataset.cache is not None else 0
    print(
        f"dataset: {len(dataset)} train images, imgsz {args.imgsz}, cache {args.cache} ({cached} cached), "
        f"mosaic p={dataset.options.aug.mosaic}, built in {build_seconds:.1f}s | "
        f"CPUs {len(os.sched_getaffinity(0))}, torch threads {torch.get_num_threads()}, "
        f"OpenCV threads {cv2.getNumThreads()}, loader items jittered on the {args.hsv}"
    )
    num_items = args.batches * args.batch_size
    per_item = {}
    for where in sorted(("worker", "device"), key=lambda w: w == args.hsv):  # the loader's setting last, kept
        dataset.options = dataclasses.replace(dataset.options, hsv_on_device=where == "device")
        per_item[where] = time_getitem(dataset, num_items, args.warmup * args.batch_size, args.seed)
        run = "CUDA run, HSV on the GPU" if where == "device" else "CPU run, HSV in the item"
        report("(a) __getitem__, one process", per_item[where], f"{num_items} items, as a {run}")
    floor = time_warp_floor(args.imgsz)
    report(f"warpAffine {2 * args.imgsz}^2 -> {args.imgsz}^2 floor", floor, "one per mosaic sample")
    rates = {}
    for count in args.workers:
        per_image, images, workers = time_loader(dataset, args, ctx, count)
        rates[workers] = 1 / per_image
        report(f"(b) train loader, {workers} worker(s)", per_image, f"{images} images, batch {args.batch_size}")
    print(
        f"ratios: __getitem__ / warp floor {per_item['device'] / floor:.2f} (CUDA run), "
        f"{per_item['worker'] / floor:.2f} (CPU run)",
        end="",
    )
    if 0 in rates:
        print("".join(f" | loader {w} workers / 0 workers {rate / rates[0]:.2f}x" for w, rate in rates.items() if w))
    else:
        print()
    for label, seconds_per_image, detail in time_label_scan(dataset, ctx):
        report(label, seconds_per_image, detail)
    fill = time_cache_fill(dataset, args, ctx)
    if fill is None:
        print("(d) RAM cache fill: skipped, a second copy of the shard does not fit in memory")
    else:
        report("(d) RAM cache fill (read + resize)", *fill)


if __name__ == "__main__":
    main()
