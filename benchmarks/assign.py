"""Benchmark the task-aligned assigner: time and peak memory per call for 10 to 3,000 labels per image.

Usage (from the repository root):

    python benchmarks/assign.py                        # batch 16, 640 px, 80 classes, 10/100/300/3000 boxes
    python benchmarks/assign.py --device cuda          # on a GPU (peak from torch.cuda.max_memory_allocated)
    python benchmarks/assign.py --boxes 3000 --max-elements 4194304   # a smaller chunk budget
    python benchmarks/assign.py --static               # the fixed-shape candidate search (--static-loss-shapes)

Each box count runs in its own subprocess, so one case's peak does not hide another's. On CPU the peak
is the growth of the process's maximum resident set during the first call, above what the inputs
already hold (scores (B, 8400, 80) float32 alone are 43 MB); the time is the median of `--repeats`
calls after that one. Labels are random boxes of 4 to 100 px, predictions random boxes around the
points, scores uniform: the work of a training step's assignment at that density.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as `python benchmarks/assign.py`
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from models.dense_head import anchor_points  # noqa: E402
from utils.train.assign import DEFAULT_MAX_ELEMENTS, AlignOptions, Labels, assign  # noqa: E402


def make_inputs(batch: int, imgsz: int, num_classes: int, num_boxes: int, device: torch.device) -> tuple:
    """Random scores, predicted boxes, points and `num_boxes` labels per image of one training step's assignment."""
    generator = torch.Generator().manual_seed(0)
    sizes = [(imgsz // stride, imgsz // stride) for stride in (8, 16, 32)]
    grid, strides = anchor_points(sizes, [8.0, 16.0, 32.0], torch.empty(0), torch.float32)
    points = grid * strides
    wh = torch.rand(batch, len(points), 2, generator=generator) * 96 + 8
    pred_boxes = torch.cat((points - wh / 2, points + wh / 2), -1)
    scores = torch.rand(batch, len(points), num_classes, generator=generator)
    centre = torch.rand(batch * num_boxes, 2, generator=generator) * imgsz
    label_wh = torch.rand(batch * num_boxes, 2, generator=generator) * 96 + 4
    label_boxes = torch.cat((centre - label_wh / 2, centre + label_wh / 2), -1)
    classes = torch.randint(0, num_classes, (batch * num_boxes,), generator=generator)
    image = torch.arange(batch).repeat_interleave(num_boxes)
    labels = Labels(image.to(device), classes.to(device), label_boxes.to(device))
    return scores.to(device), pred_boxes.to(device), points.to(device), labels


def measure_one(args: argparse.Namespace) -> dict[str, float]:
    """Run one box count in this process; return its seconds per call and peak memory in MB."""
    device = torch.device(args.device)
    inputs = make_inputs(args.batch, args.imgsz, args.classes, args.one, device)
    options = AlignOptions(max_elements=args.max_elements, static_shapes=args.static)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    assign(*inputs, options)
    if device.type == "cuda":
        torch.cuda.synchronize()
        peak_mb = (torch.cuda.max_memory_allocated() - before) / 2**20
    else:
        peak_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        result = assign(*inputs, options)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    positives = int(result.foreground.sum())
    return {"seconds": statistics.median(times), "peak_mb": peak_mb, "positives": positives}


def main(argv: list[str] | None = None) -> None:
    """Measure every box count in a subprocess and print one Markdown table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--boxes", type=int, nargs="+", default=[10, 100, 300, 3000], help="labels per image")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--imgsz", type=int, default=640)
    parser.add_argument("--classes", type=int, default=80)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls after the first (measured) one")
    parser.add_argument("--max-elements", type=int, default=DEFAULT_MAX_ELEMENTS, help="the chunk budget")
    parser.add_argument("--static", action="store_true", help="the fixed-shape candidate search")
    parser.add_argument("--one", type=int, default=0, help=argparse.SUPPRESS)  # internal: one case, JSON out
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(measure_one(args)))
        return
    print(f"assign(): batch {args.batch}, {args.imgsz} px ({(args.imgsz // 8) ** 2 * 21 // 16:,} points), "
          f"{args.classes} classes, device {args.device}, {'static' if args.static else 'sparse'} candidate search, "
          f"chunk budget {args.max_elements:,} elements, "
          f"torch threads {torch.get_num_threads()}\n")  # fmt: skip
    print("| labels per image | ms per call | peak memory (MB) | foreground points |")
    print("|---|---|---|---|")
    for boxes in args.boxes:
        forwarded = [a for a in (argv if argv is not None else sys.argv[1:]) if a]
        command = [sys.executable, __file__, *_without_boxes(forwarded), "--one", str(boxes)]
        output = subprocess.run(command, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
        figures = json.loads(output)
        print(
            f"| {boxes:,} | {1000 * figures['seconds']:.0f} | {figures['peak_mb']:.0f} | {figures['positives']:,} |",
            flush=True,
        )


def _without_boxes(argv: list[str]) -> list[str]:
    """The flags to pass on to a one-case subprocess: everything but --boxes and its values."""
    kept, skipping = [], False
    for item in argv:
        if item == "--boxes":
            skipping = True
            continue
        if skipping and not item.startswith("--"):
            continue
        skipping = False
        kept.append(item)
    return kept


if __name__ == "__main__":
    main()
