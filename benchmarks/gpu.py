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
import csv
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as `python benchmarks/gpu.py`
    sys.path.insert(0, str(ROOT))

from benchmarks.gpu_trace import RunFigures, run_figures  # noqa: E402  (needs the sys.path line above)
from utils.cpus import usable_cpus  # noqa: E402
from utils.data.synthetic import SHAPE_NAMES, SyntheticSpec, ensure_synthetic_dataset  # noqa: E402

RUNNER = Path(__file__).resolve().parent / "gpu_runner.py"
FLAG = re.compile(r"""["'](--[a-z0-9][a-z0-9-]*)["']""")
SPEED = re.compile(r"Speed per image: ([\d.]+) ms pre-process, ([\d.]+) ms inference, ([\d.]+) ms NMS")
STEP_HEADER = re.compile(r"median ms over")
TRAIN_COLUMNS = (
    "set",
    "trainer",
    "code",
    "first step s",
    "epoch s",
    "epoch+val s",
    "images/s",
    "data wait",
    "peak GiB",
    "mAP50-95",
    "mAP50",
    "wall s",
    "status",
)
STEP_COLUMNS = (
    "model", "task", "code", "dtype", "step ms", "pipelined ms", "loss ms", "loss share", "inference ms", "status"
)  # fmt: skip
STEP_ROWS = ("step", "pipelined", "loss", "inference")  # train_step.py's rows the table reports
PARTS = ("train", "val", "step", "train-more")
VAL_COLUMNS = ("code", "dtype", "inference ms/img", "pre ms/img", "NMS ms/img", "images/s", "mAP50-95", "status")


@dataclass
class Report:
    """The benchmark's output: gpu.log (everything printed), gpu.md and gpu.csv (the tables), rewritten per row."""

    out: Path
    tables: dict[str, tuple[tuple[str, ...], list[list[str]]]] = field(default_factory=dict)

    def say(self, line: str) -> None:
        """Print `line` and append it to gpu.log."""
        print(line, flush=True)
        with open(self.out / "gpu.log", "a") as handle:
            handle.write(line + "\n")

    def add(self, table: str, columns: tuple[str, ...], row: list[str]) -> None:
        """Add a row to `table`, print it, and rewrite gpu.md and gpu.csv."""
        self.tables.setdefault(table, (columns, []))[1].append(row)
        self.say(f"[{table}] " + " | ".join(f"{c}: {v}" for c, v in zip(columns, row, strict=True)))
        self.write()

    def markdown(self) -> str:
        """All tables as Markdown."""
        parts = []
        for name, (columns, rows) in self.tables.items():
            lines = [f"## {name}", "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
            lines += ["| " + " | ".join(row) + " |" for row in rows]
            parts.append("\n".join(lines))
        return "\n\n".join(parts) + "\n"

    def write(self) -> None:
        """Rewrite gpu.md and gpu.csv from the rows so far."""
        (self.out / "gpu.md").write_text(self.markdown())
        with open(self.out / "gpu.csv", "w", newline="") as handle:
            writer = csv.writer(handle)
            for name, (columns, rows) in self.tables.items():
                writer.writerow(["table", *columns])
                writer.writerows([name, *row] for row in rows)


@dataclass(frozen=True)
class Checkout:
    """A code directory to measure; `label` is the path as given on the command line."""

    label: str
    path: Path

    def flags(self, *scripts: str) -> set[str]:
        """The --flags its `scripts` and `utils/` mention (a superset of what the parsers accept)."""
        files = [self.path / script for script in scripts] + sorted((self.path / "utils").rglob("*.py"))
        return {flag for file in files if file.is_file() for flag in FLAG.findall(file.read_text(errors="ignore"))}


@dataclass
class Bench:
    """What every part needs: options, checkouts, output, work folders and the deadline."""

    args: argparse.Namespace
    checkouts: list[Checkout]
    report: Report
    work: Path
    started: float
    datasets: dict[int, Path] = field(default_factory=dict)  # train size -> generated dataset root
    first_weights: Path | None = None  # best.pt of the first training run: what the val part validates
    first_data: Path | None = None  # and its dataset YAML

    @property
    def cuda(self) -> bool:
        return self.args.device != "cpu"

    def seconds_left(self) -> float:
        return self.args.deadline_s - (time.time() - self.started)


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
    if len(args.epochs) not in (1, len(args.sizes)):
        parser.error(f"--epochs takes one value or one per size ({len(args.sizes)})")
    return args


def run_logged(command: list[str], cwd: Path, log: Path, bench: Bench) -> tuple[int, float]:
    """Run `command` in `cwd`, output to `log`; killed (whole process group) at the deadline. Returns (rc, s)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "YOLO_CONFIG_DIR": str(bench.work / "ultralytics-config")}
    bench.report.say(f"$ (cd {cwd} && {' '.join(command)}) > {log}")
    start = time.time()
    with open(log, "w") as handle:
        process = subprocess.Popen(
            command, cwd=cwd, stdout=handle, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            rc = process.wait(timeout=max(bench.seconds_left(), 1.0))
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            rc = process.wait()
            bench.report.say(f"  killed at the deadline (--deadline-s {bench.args.deadline_s:.0f})")
    seconds = time.time() - start
    if rc != 0:
        tail = log.read_text(errors="replace").replace("\r", "\n").strip().splitlines()[-8:]
        bench.report.say(f"  exit status {rc} after {seconds:.1f} s; last lines:\n    " + "\n    ".join(tail))
    return rc, seconds


def make_datasets(bench: Bench) -> None:
    """Generate each size's shapes dataset once, on every core (seed 1; val split with COCO annotations)."""
    for size in bench.args.sizes:
        name = f"shapes-n{size}-v{bench.args.val_images}"
        start = time.time()
        spec = SyntheticSpec(seed=1, num_train=size, num_val=bench.args.val_images)
        bench.datasets[size] = ensure_synthetic_dataset(bench.work / "data" / name, spec, max_threads=usable_cpus())
        bench.report.say(f"data: {name} ready in {time.time() - start:.1f} s ({usable_cpus()} threads)")


def data_view(bench: Bench, size: int, owner: str) -> Path:
    """A hard-linked copy of a generated set for one trainer, so each writes its own label cache files."""
    source = bench.datasets[size]
    view = bench.work / "views" / owner / source.name
    if not view.exists():

        def link(src: str, dst: str) -> None:
            try:
                os.link(src, dst)
            except OSError:  # another file system
                shutil.copy2(src, dst)

        shutil.copytree(source, view, copy_function=link, ignore=shutil.ignore_patterns("*.cache", "*.npy"))
    return view


def our_yaml(view: Path) -> Path:
    """Our dataset YAML for `view` (pycocotools scoring through val_annotations)."""
    raw = {
        "path": str(view),
        "train": "images/train",
        "val": "images/val",
        "val_annotations": "annotations/instances_val.json",
        "names": list(SHAPE_NAMES),
    }
    path = view.parent / f"{view.name}.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def ultralytics_yaml(view: Path) -> Path:
    """Ultralytics' dataset YAML for `view`: the same YOLO txt layout (labels/ beside images/), names by index."""
    raw = {"path": str(view), "train": "images/train", "val": "images/val", "names": dict(enumerate(SHAPE_NAMES))}
    path = view.parent / f"{view.name}-ultralytics.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def fmt(value: float | None, spec: str = ".2f") -> str:
    """A table cell: `value` formatted, or '-' when unknown."""
    return "-" if value is None else format(value, spec)


def coco_scores(folder: Path) -> tuple[float | None, float | None]:
    """(mAP50-95, mAP50) of the coco_eval.json in `folder`, or (None, None)."""
    path = folder / "coco_eval.json"
    if not path.is_file():
        return None, None
    stats = json.loads(path.read_text()).get("bbox", {})
    return stats.get("AP"), stats.get("AP50")


def common_flags(bench: Bench, *scripts: str) -> set[str]:
    """The --flags every checkout's `scripts` (and utils/) mention: the ones a side-by-side run may pass."""
    sets = [checkout.flags(*scripts) for checkout in bench.checkouts]
    return set.intersection(*sets) if sets else set()


def argv_from(wanted: list[tuple[str, str | None]], known: set[str]) -> tuple[list[str], list[str]]:
    """(argv of the `wanted` flags that are `known`, the names of those that are not)."""
    argv: list[str] = []
    dropped: list[str] = []
    for flag, value in wanted:
        if flag not in known:
            dropped.append(flag)
            continue
        argv += [flag] if value is None else [flag, value]
    return argv, dropped


def slug(bench: Bench, checkout: Checkout) -> str:
    """A short unique name for `checkout` in file names: its index and its folder's name."""
    index = bench.checkouts.index(checkout)
    return f"c{index}-" + (re.sub(r"[^A-Za-z0-9]+", "_", checkout.path.name).strip("_") or "root")


def traced_run(bench: Bench, command: list[str], cwd: Path, name: str) -> tuple[int, float, RunFigures | None]:
    """Run a trainer under gpu_runner.py; return (exit status, wall seconds, its figures if it left a trace)."""
    trace_file = bench.work / "traces" / f"{name}.json"
    trace_file.parent.mkdir(parents=True, exist_ok=True)
    trace_file.unlink(missing_ok=True)
    launched = time.time()
    rc, seconds = run_logged(
        [sys.executable, str(RUNNER), "--trace", str(trace_file), *command],
        cwd,
        bench.report.out / "logs" / f"{name}.log",
        bench,
    )
    if not trace_file.is_file():
        return rc, seconds, None
    return rc, seconds, run_figures(json.loads(trace_file.read_text()), launched)


def train_row(size: int, trainer: str, code: str, figures: RunFigures | None, scores: tuple, wall: float, rc: int):
    """One row of the training table."""
    f = figures
    status = "ok" if rc == 0 else f"exit {rc}"
    return [
        str(size),
        trainer,
        code,
        fmt(f and f.first_step_s, ".1f"),
        fmt(f and f.epoch_s),
        fmt(f and f.epoch_with_val_s),
        fmt(f and f.images_per_s, ".0f"),
        fmt(f.wait_share * 100, ".1f") + "%" if f and f.wait_share is not None else "-",
        fmt(f and f.peak_gpu_gib),
        fmt(scores[0], ".3f"),
        fmt(scores[1], ".3f"),
        f"{wall:.1f}",
        status + (f", {f.epochs} epochs" if f else ""),
    ]


def train_ours(bench: Bench, checkout: Checkout, size: int, epochs: int) -> None:
    """Train `--cfg` with the checkout's train.py on the size's set; add its row."""
    args = bench.args
    view = data_view(bench, size, slug(bench, checkout))
    name = f"n{size}-{slug(bench, checkout)}"
    project = bench.work / "runs"
    wanted = [
        ("--data", str(our_yaml(view))),
        ("--cfg", args.cfg),
        ("--imgsz", str(args.imgsz)),
        ("--batch-size", str(args.batch_size)),
        ("--workers", str(args.workers)),
        ("--cache", args.cache),
        ("--amp", args.amp),
        ("--epochs", str(epochs)),
        ("--seed", "0"),
        ("--project", str(project)),
        ("--name", name),
        ("--exist-ok", None),
        ("--noplots", None),
    ]
    if not bench.cuda:
        wanted.append(("--device", "cpu"))
    argv, dropped = argv_from(wanted, common_flags(bench, "train.py"))
    if dropped:
        bench.report.say(f"  train.py flags not in every checkout, left out: {' '.join(dropped)}")
    rc, wall, figures = traced_run(bench, ["--", "train.py", *argv], checkout.path, f"train-{name}")
    run_dir = project / name
    bench.report.add(
        "training", TRAIN_COLUMNS, train_row(size, "ours", checkout.label, figures, coco_scores(run_dir), wall, rc)
    )
    best = run_dir / "weights" / "best.pt"
    if bench.first_weights is None and best.is_file():
        bench.first_weights, bench.first_data = best, our_yaml(view)


def ultralytics_available() -> bool:
    """Whether `ultralytics` can be imported here (its wheels installed for the comparison only)."""
    return importlib.util.find_spec("ultralytics") is not None


def train_ultralytics(bench: Bench, size: int, epochs: int) -> None:
    """Train `--cfg` with Ultralytics' trainer on the same data and settings; score best.pt with our val.py."""
    args = bench.args
    view = data_view(bench, size, "ultralytics")
    name = f"n{size}-ultralytics"
    project = bench.work / "runs"
    pairs = [
        f"model={args.cfg}.yaml",
        f"data={ultralytics_yaml(view)}",
        f"epochs={epochs}",
        f"imgsz={args.imgsz}",
        f"batch={args.batch_size}",
        f"workers={args.workers}",
        f"cache={args.cache if args.cache != 'none' else False}",
        f"amp={args.amp != 'off'}",
        "plots=False",
        "close_mosaic=0",
        "seed=0",
        f"project={project}",
        f"name={name}",
        "exist_ok=True",
        f"device={0 if bench.cuda else 'cpu'}",
        *args.ultralytics_arg,
    ]
    # close_mosaic=0: mosaic in every epoch, as our default (Ultralytics' 10 would turn it off in short runs).
    rc, wall, figures = traced_run(bench, ["--ultralytics", *pairs], bench.work, f"train-{name}")
    best = project / name / "weights" / "best.pt"
    scores = score_checkpoint(bench, best, size, name) if best.is_file() else (None, None)
    bench.report.add("training", TRAIN_COLUMNS, train_row(size, "ultralytics", "-", figures, scores, wall, rc))


def score_checkpoint(bench: Bench, weights: Path, size: int, name: str) -> tuple[float | None, float | None]:
    """pycocotools (mAP50-95, mAP50) of `weights` by the first checkout's val.py --save-json on the size's val split."""
    checkout = bench.checkouts[0]
    data = our_yaml(data_view(bench, size, slug(bench, checkout)))
    project = bench.work / "val"
    argv = [
        "val.py",
        "--weights",
        str(weights),
        "--data",
        str(data),
        "--imgsz",
        str(bench.args.imgsz),
        "--batch-size",
        str(bench.args.batch_size),
        "--workers",
        str(bench.args.workers),
        "--save-json",
        "--project",
        str(project),
        "--name",
        f"score-{name}",
        "--exist-ok",
    ]
    if not bench.cuda:
        argv += ["--device", "cpu"]
    run_logged([sys.executable, *argv], checkout.path, bench.report.out / "logs" / f"score-{name}.log", bench)
    return coco_scores(project / f"score-{name}")


def val_part(bench: Bench) -> None:
    """val.py of every checkout on the first training run's best.pt: fp32 and (CUDA) --half."""
    if bench.first_weights is None:
        bench.report.say("val: skipped, no best.pt from a training run of this benchmark")
        return
    args = bench.args
    known = common_flags(bench, "val.py")
    for dtype in ("fp32", "fp16") if bench.cuda else ("fp32",):
        for checkout in bench.checkouts:
            if bench.seconds_left() <= 0:
                return
            name = f"{slug(bench, checkout)}-{dtype}"
            wanted = [
                ("--weights", str(bench.first_weights)),
                ("--data", str(bench.first_data)),
                ("--imgsz", str(args.imgsz)),
                ("--batch-size", str(args.batch_size)),
                ("--workers", str(args.workers)),
                ("--save-json", None),
                ("--project", str(bench.work / "val")),
                ("--name", name),
                ("--exist-ok", None),
            ]
            wanted += [("--half", None)] if dtype == "fp16" else []
            wanted += [] if bench.cuda else [("--device", "cpu")]
            argv, _ = argv_from(wanted, known)
            log = bench.report.out / "logs" / f"val-{name}.log"
            rc, _ = run_logged([sys.executable, "val.py", *argv], checkout.path, log, bench)
            speed = SPEED.findall(log.read_text(errors="replace")) if log.is_file() else []
            pre, inference, nms = (float(v) for v in speed[-1]) if speed else (None, None, None)
            rate = 1000 / (pre + inference + nms) if speed and pre + inference + nms > 0 else None
            scores = coco_scores(bench.work / "val" / name)
            bench.report.add(
                "val.py",
                VAL_COLUMNS,
                [
                    checkout.label,
                    dtype,
                    fmt(inference),
                    fmt(pre),
                    fmt(nms),
                    fmt(rate, ".0f"),
                    fmt(scores[0], ".3f"),
                    "ok" if rc == 0 else f"exit {rc}",
                ],
            )


def parse_step_output(text: str) -> dict[str, dict[str, float]]:
    """train_step.py's tables: dtype -> {row: ms of the first column}; "<dtype>+<variant>" for each
    "<layout>+<variant>" column (compile, static)."""
    tables: dict[str, dict[str, float]] = {}
    dtype, columns = "", []
    for line in text.splitlines():
        words = line.split()
        if STEP_HEADER.search(line):
            named = re.search(r"dtype (\w+)", line)
            dtype, columns = (named.group(1) if named else ("fp16" if " amp," in line else "fp32")), []
        elif dtype and words and words[0] == "phase":
            columns = words[1:]
        elif dtype and words and words[0] in STEP_ROWS:
            for index, value in enumerate(words[1:]):
                name = columns[index] if index < len(columns) else ""
                if index == 0 or ("+" in name and "/" not in name):
                    key = dtype if index == 0 else f"{dtype}+{name.split('+', 1)[1]}"
                    tables.setdefault(key, {})[words[0]] = float(value)
    return tables


def step_part(bench: Bench) -> None:
    """Every checkout's train_step.py per model, task and precision (NHWC, as training runs)."""
    args = bench.args
    for cfg in args.step_cfgs:
        for task in args.step_tasks:
            model = f"{cfg}-seg" if task == "segment" else cfg
            for checkout in bench.checkouts:
                if bench.seconds_left() <= 0:
                    return
                step_one(bench, checkout, model, task)


def step_one(bench: Bench, checkout: Checkout, model: str, task: str) -> None:
    """One checkout's train_step.py for one model: one process with --dtypes, or one per dtype for an old script."""
    args = bench.args
    script = checkout.path / "benchmarks" / "train_step.py"
    if not script.is_file():
        bench.report.say(f"step: {checkout.label} has no benchmarks/train_step.py")
        return
    known = set(FLAG.findall(script.read_text()))
    data = our_yaml(data_view(bench, args.sizes[0], slug(bench, checkout)))
    base = [
        "benchmarks/train_step.py",
        "--task",
        task,
        "--cfg",
        model,
        "--imgsz",
        str(args.step_imgsz),
        "--batch-size",
        str(args.step_batch),
        "--steps",
        str(args.steps),
        "--warmup",
        "3",
        "--device",
        "cuda" if bench.cuda else "cpu",
        "--data",
        str(data),
    ]
    if args.step_compile and "--compile" in known:
        base += ["--compile", args.step_compile]
    elif args.step_compile:
        bench.report.say(f"step: {checkout.label}'s train_step.py has no --compile; timed without it")
    if args.step_static and "--static-loss" in known:
        base.append("--static-loss")
    elif args.step_static:
        bench.report.say(f"step: {checkout.label}'s train_step.py has no --static-loss; timed without it")
    if "--dtypes" in known:
        runs = [(args.step_dtypes, [*base, "--dtypes", *args.step_dtypes, "--layouts", "nhwc"])]
    else:  # an older script: fp32, or fp16 with --amp; both layouts, the first column is NHWC
        runs = [([dtype], base + (["--amp"] if dtype == "fp16" else [])) for dtype in args.step_dtypes]
    for dtypes, argv in runs:
        if dtypes != args.step_dtypes and dtypes[0] == "bf16":
            bench.report.add(
                "train step",
                STEP_COLUMNS,
                [model, task, checkout.label, "bf16", "-", "-", "-", "-", "-", "not in this train_step.py"],
            )
            continue
        log = bench.report.out / "logs" / f"step-{model}-{slug(bench, checkout)}-{'-'.join(dtypes)}.log"
        rc, _ = run_logged([sys.executable, *argv], checkout.path, log, bench)
        tables = parse_step_output(log.read_text(errors="replace")) if log.is_file() else {}
        rows = [row for plain in dtypes for row in [plain, *(t for t in tables if t.startswith(f"{plain}+"))]]
        for dtype in rows:  # a variant's column is its own row, e.g. "fp16+compile", "fp16+static"
            phases = tables.get(dtype, {})
            step, loss = phases.get("step"), phases.get("loss")
            share = fmt(100 * loss / step, ".0f") + "%" if step and loss is not None else "-"
            status = "ok" if rc == 0 and phases else f"exit {rc}" if rc else "no table"
            bench.report.add(
                "train step",
                STEP_COLUMNS,
                [
                    model,
                    task,
                    checkout.label,
                    dtype,
                    fmt(step, ".1f"),
                    fmt(phases.get("pipelined"), ".1f"),
                    fmt(loss, ".1f"),
                    share,
                    fmt(phases.get("inference"), ".1f"),
                    status,
                ],
            )


def train_part(bench: Bench, sizes: list[int]) -> None:
    """Training runs on `sizes`: every checkout's train.py, then Ultralytics' when it imports."""
    args = bench.args
    with_ultralytics = ultralytics_available() and not args.no_ultralytics
    if not with_ultralytics:
        bench.report.say(
            "train: Ultralytics "
            + ("skipped (--no-ultralytics)" if args.no_ultralytics else "not importable: its rows are left out")
        )
    for size in sizes:
        epochs = args.epochs[min(args.sizes.index(size), len(args.epochs) - 1)]
        trainers: list[Checkout | None] = [*bench.checkouts, *([None] if with_ultralytics else [])]
        for checkout in trainers:  # None: Ultralytics
            if bench.seconds_left() <= 0:
                bench.report.say(f"train: deadline reached, the rest of the {size}-image runs skipped")
                return
            if checkout is None:
                train_ultralytics(bench, size, epochs)
            else:
                train_ours(bench, checkout, size, epochs)


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
