"""Benchmark the training data pipeline: images/s of augmented items, in one process and through the loader.

Usage (from the repository root):

    python benchmarks/data_pipeline.py                       # imgsz 640, 2 workers, RAM cache
    python benchmarks/data_pipeline.py --imgsz 320 --workers 4 --batches 40 --cache none

Builds the training dataset as `train.py` does on one rank (augment on, strengths from `--hyp`,
by default YOLOv5's hyp.scratch-low.yaml rather than the quick start's; the chosen cache mode),
then measures (a) `__getitem__` called in this process and (b) batches drawn through
`utils.data.loader.build_train_loader` with worker processes, each after a warm-up that is not
timed. Prints images/s and ms/image for both.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as `python benchmarks/data_pipeline.py`
    sys.path.insert(0, str(ROOT))

from utils.config import DEFAULT_DATA, DEFAULT_HYP, load_hyp  # noqa: E402  (needs the sys.path line above)
from utils.data.data_config import load_data_config  # noqa: E402
from utils.data.dataset import DatasetOptions, LoadImagesAndLabels  # noqa: E402
from utils.data.loader import build_train_loader  # noqa: E402
from utils.distributed import DistContext  # noqa: E402
from utils.logs import setup_logging  # noqa: E402
from utils.train.setup import augment_params  # noqa: E402

LOGGER = logging.getLogger("benchmarks.data_pipeline")
MODEL_STRIDE = 32  # largest stride of every YOLOv5 size; only used for rect shapes, which are off here


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the benchmark's flags."""
    parser = argparse.ArgumentParser(description="Measure images/s of the augmented training data pipeline")
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="dataset YAML (default: built-in synthetic)")
    parser.add_argument("--hyp", type=Path, default=DEFAULT_HYP, help="hyp YAML with the augmentation strengths")
    parser.add_argument("--imgsz", type=int, default=640, help="training image size (pixels)")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader worker processes for part (b)")
    parser.add_argument("--batches", type=int, default=20, help="timed batches in part (b)")
    parser.add_argument("--batch-size", type=int, default=16, help="images per batch (one rank's batch)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed batches before timing (a) and (b)")
    parser.add_argument("--cache", default="ram", choices=("ram", "disk", "none"), help="image cache mode")
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
        workers=max(1, args.workers),
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


def time_loader(dataset: LoadImagesAndLabels, args: argparse.Namespace, ctx: DistContext) -> tuple[float, int, int]:
    """Return (seconds per image, images timed, workers used) for batches drawn through the train loader.

    Worker start-up and the first `args.warmup` batches are not timed. When an epoch has fewer
    batches than needed the loader moves on to the next epoch (workers are persistent).
    """
    loader = build_train_loader(dataset, args.batch_size, args.workers, ctx, args.seed)
    epoch, images, start = 0, 0, 0.0
    batches_seen = 0
    while batches_seen < args.warmup + args.batches:
        loader.set_epoch(epoch)
        for batch in loader:
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


def report(label: str, seconds_per_image: float, detail: str) -> None:
    """Print one result line: images/s and ms/image."""
    print(f"{label:<34} {1 / seconds_per_image:8.1f} images/s  {1000 * seconds_per_image:7.2f} ms/image  ({detail})")


def main(argv: list[str] | None = None) -> None:
    """Build the dataset, time (a) raw __getitem__ and (b) the multi-worker loader, print the figures."""
    args = parse_args(argv)
    if args.warmup < 1:
        raise SystemExit("error: --warmup must be at least 1 (the first batch includes worker start-up)")
    ctx = DistContext()
    setup_logging(ctx)
    start = time.perf_counter()
    dataset = build_dataset(args, ctx)
    build_seconds = time.perf_counter() - start
    cached = len(dataset.cache) if dataset.cache is not None else 0
    print(
        f"dataset: {len(dataset)} train images, imgsz {args.imgsz}, cache {args.cache} ({cached} cached), "
        f"mosaic p={dataset.options.aug.mosaic}, built in {build_seconds:.1f}s | "
        f"CPUs {len(os.sched_getaffinity(0))}, torch threads {torch.get_num_threads()}"
    )
    num_items = args.batches * args.batch_size
    per_item = time_getitem(dataset, num_items, args.warmup * args.batch_size, args.seed)
    report("(a) __getitem__, one process", per_item, f"{num_items} items")
    per_image, images, workers = time_loader(dataset, args, ctx)
    report(f"(b) train loader, {workers} worker(s)", per_image, f"{images} images, batch {args.batch_size}")


if __name__ == "__main__":
    main()
