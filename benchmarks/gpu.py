"""One-command GPU benchmark: training (ours and Ultralytics'), the train step per precision, val.py speed.

Usage (from the repository root; see docs/benchmarks.md for a GPU box without network):

    python benchmarks/gpu.py --out /tmp/gpu-bench                       # this checkout only
    python benchmarks/gpu.py --code . ../old-checkout --out $OUT        # two checkouts side by side
    python benchmarks/gpu.py --sizes 300 --epochs 5 --parts train val    # a trimmed run
    python benchmarks/gpu.py --quick --out /tmp/gpu-quick               # CPU smoke run (tiny, 64 px)

Generates shapes datasets of `--sizes` train images (and `--val-images` val images with COCO
annotations) once under `--data-root`, on every core, then runs the `--parts` in the order given
(default: train val step train-more, the quick ones first):

- `train` (the first size) and `train-more` (the other sizes): per size, each `--code` checkout's
  `train.py` and, when `ultralytics` imports, Ultralytics' own trainer, on the same data (a
  hard-linked copy each, so label caches never mix), model, size, batch, workers, cache and AMP;
  each in its own process under benchmarks/gpu_runner.py, which times it the same way for all.
- `val`: each checkout's `val.py` (fp32, and `--half` on CUDA) on the first training run's best.pt.
- `step`: each checkout's `benchmarks/train_step.py` per `--step-cfgs` x `--step-tasks` x `--step-dtypes`.

Every figure is printed as soon as it exists and the tables are rewritten after each row, so a run
cut short by `--deadline-s` or a timeout still leaves its figures in `--out` (gpu.log, gpu.md, gpu.csv,
one log per subprocess under logs/). Scripts run with the working directory of their checkout and
only with flags every checkout has; a checkout whose script lacks a feature gets a note, not a crash.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as `python benchmarks/gpu.py`
    sys.path.insert(0, str(ROOT))

from benchmarks.gpu_bench import Bench, Checkout, Report, make_datasets  # noqa: E402  (needs the sys.path line above)
from benchmarks.gpu_speed import parse_step_output, step_part, val_part  # noqa: E402
from benchmarks.gpu_train import train_part, ultralytics_available  # noqa: E402
from utils.cpus import usable_cpus  # noqa: E402

__all__ = ["main", "parse_args", "parse_step_output"]

PARTS = ("train", "val", "step", "train-more")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the benchmark's flags; --quick replaces the sizes with a CPU smoke run's."""
    parser = argparse.ArgumentParser(description="GPU benchmark: training, train step, validation; tables to --out")
    add = parser.add_argument
    add("--out", type=Path, required=True, help="folder for gpu.log, gpu.md, gpu.csv and logs/")
    add("--code", nargs="+", default=[str(ROOT)], help="checkouts to measure (default: this one)")
    add("--parts", nargs="+", default=list(PARTS), choices=PARTS,
        help="run in the order given: train (first size), val, step, train-more (the other sizes)")  # fmt: skip
    add("--sizes", nargs="+", type=int, default=[300, 3000], help="train images of each generated set")
    add("--epochs", nargs="+", type=int, default=[8, 3], help="epochs per size (one value: every size)")
    add("--rounds", type=int, default=1,
        help="train every trainer this many times per size, in reversed order each round (a row each)")  # fmt: skip
    add("--val-images", type=int, default=200)
    add("--cfg", default="yolov8n", help="model trained by both trainers")
    add("--imgsz", type=int, default=640)
    add("--batch-size", type=int, default=32)
    add("--workers", type=int, default=8)
    add("--cache", default="ram", choices=("ram", "none"))
    add("--amp", default="fp16", choices=("fp16", "bf16", "off"), help="training precision (CUDA)")
    add("--no-ultralytics", action="store_true", help="skip Ultralytics' trainer even when it imports")
    add("--ultralytics-arg", action="append", default=[], metavar="KEY=VALUE", help="extra Ultralytics train arg")
    add("--step-cfgs", nargs="+", default=["yolov5s", "yolov8s"])
    add("--step-tasks", nargs="+", default=["detect", "segment"], choices=("detect", "segment"))
    add("--step-dtypes", nargs="+", default=["fp32", "fp16", "bf16"], choices=("fp32", "fp16", "bf16"))
    add("--step-batch", type=int, default=32)
    add("--step-imgsz", type=int, default=640)
    add("--steps", type=int, default=10, help="timed train steps per precision")
    add(
        "--step-compile",
        default="",
        metavar="MODE",
        help="also time each step with the forward under torch.compile(MODE) (train.py --compile; minutes to compile)",
    )
    add("--step-static", action="store_true", help="also time each step with train.py --static-loss-shapes")
    add("--step-graph", action="store_true", help="also time each step with train.py --cuda-graph")
    add(
        "--train-variant",
        action="append",
        default=[],
        metavar="FLAGS",
        help="also train the first checkout with these train.py flags, a row each (--train-variant=--cuda-graph)",
    )
    add("--profile-steps", default="", metavar="START:COUNT",
        help="profile each training run's batches after backward START: COUNT with torch.profiler, COUNT with "
        "cProfile; summaries in logs/train-*.profile.txt")  # fmt: skip
    add("--profile-startup", action="store_true",
        help="cProfile each trainer from its start to its first optimizer step: logs/train-*.startup.txt")  # fmt: skip
    add("--device", default="", help="cuda (default when available) or cpu")
    add("--data-root", type=Path, default=Path("/tmp/yolo-gpu-bench"), help="generated data and run folders")
    add("--deadline-s", type=float, default=1e9, help="start no new run after this many seconds; cut runs to it")
    add("--quick", action="store_true", help="CPU smoke run: 16 images, 64 px, 2 epochs, yolov8n step only")
    args = parser.parse_args(argv)
    if args.quick:
        args.device, args.sizes, args.epochs, args.val_images = args.device or "cpu", [16], [2], 8
        args.imgsz, args.batch_size, args.workers, args.amp = 64, 8, 0, "off"
        args.step_cfgs, args.step_tasks, args.step_dtypes = ["yolov8n"], ["detect"], ["fp32"]
        args.step_batch, args.step_imgsz, args.steps = 2, 64, 1
    if not args.device:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cpu":
        args.amp = "off"
        args.step_dtypes = [d for d in args.step_dtypes if d == "fp32"] or ["fp32"]
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds} must be at least 1")
    if len(args.epochs) not in (1, len(args.sizes)):
        parser.error(f"--epochs takes one value or one per size ({len(args.sizes)})")
    return args


def describe_machine(bench: Bench) -> None:
    """Log the device, versions, cores and each checkout's commit."""
    import torch

    gpu = torch.cuda.get_device_name(0) if bench.cuda and torch.cuda.is_available() else "none"
    bench.report.say(
        f"gpu.py: device {bench.args.device} ({gpu}), torch {torch.__version__}, "
        f"{usable_cpus()} usable CPUs, ultralytics importable: {ultralytics_available()}"
    )
    for checkout in bench.checkouts:
        if not (checkout.path / ".git").exists():  # git would report the enclosing repository's commit
            bench.report.say(f"code {checkout.label}: {checkout.path} (not a git checkout)")
            continue
        commit = subprocess.run(
            ["git", "-C", str(checkout.path), "log", "-1", "--format=%h %s"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout.strip()
        bench.report.say(f"code {checkout.label}: {checkout.path} ({commit or 'not a git checkout'})")


def main(argv: list[str] | None = None) -> None:
    """Generate the data, run the parts (the first size's training, val, step, then the other sizes), print tables."""
    args = parse_args(argv)
    (args.out / "logs").mkdir(parents=True, exist_ok=True)
    args.data_root.mkdir(parents=True, exist_ok=True)
    checkouts = [Checkout(label, Path(label).resolve()) for label in args.code]
    bench = Bench(args, checkouts, Report(args.out), args.data_root, time.time())
    describe_machine(bench)
    make_datasets(bench)
    # In the order asked; by default the quick parts first, so a run cut short by the deadline still has them.
    for part in args.parts:
        if part == "train":
            train_part(bench, args.sizes[:1])
        elif part == "train-more":
            train_part(bench, args.sizes[1:])
        elif part == "val":
            val_part(bench)
        else:
            step_part(bench)
    bench.report.say(f"\nDone in {time.time() - bench.started:.0f} s. Tables in {args.out / 'gpu.md'}:\n")
    bench.report.say(bench.report.markdown())


if __name__ == "__main__":
    main()
