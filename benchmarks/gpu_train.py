"""The GPU benchmark's training part: our train.py per checkout and Ultralytics' trainer, timed alike."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import sys
import time
from pathlib import Path

from benchmarks.gpu_bench import (
    Bench,
    Checkout,
    argv_from,
    coco_scores,
    common_flags,
    data_view,
    fmt,
    our_yaml,
    run_logged,
    slug,
    ultralytics_yaml,
)
from benchmarks.gpu_trace import RunFigures, run_figures

RUNNER = Path(__file__).resolve().parent / "gpu_runner.py"
ENV_WORD = re.compile(r"^[A-Z_][A-Z0-9_]*=")  # GPU_RUNNER_CUDNN=off: an environment assignment, not a flag

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


def traced_run(
    bench: Bench, command: list[str], cwd: Path, name: str, extra_env: dict[str, str] | None = None
) -> tuple[int, float, RunFigures | None]:
    """Run a trainer under gpu_runner.py (`extra_env` set); return (exit status, wall seconds, its figures if any)."""
    trace_file = bench.work / "traces" / f"{name}.json"
    trace_file.parent.mkdir(parents=True, exist_ok=True)
    trace_file.unlink(missing_ok=True)
    summaries = [trace_file.with_suffix(".profile.txt"), trace_file.with_suffix(".startup.txt")]
    for summary in summaries:
        summary.unlink(missing_ok=True)
    profile = ["--profile", bench.args.profile_steps] if bench.args.profile_steps else []
    profile += ["--profile-startup"] if bench.args.profile_startup else []
    launched = time.time()
    rc, seconds = run_logged(
        [sys.executable, str(RUNNER), "--trace", str(trace_file), *profile, *command],
        cwd,
        bench.report.out / "logs" / f"{name}.log",
        bench,
        extra_env,
    )
    for summary in summaries:
        if summary.is_file():
            shutil.copy(summary, bench.report.out / "logs" / f"{name}{summary.suffixes[-2]}.txt")
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


def train_ours(bench: Bench, checkout: Checkout, size: int, epochs: int, variant: str = "", run: int = 0) -> None:
    """Train `--cfg` with the checkout's train.py on the size's set (plus a --train-variant's flags); add its row.

    `run` numbers the rounds of `--rounds` (0: the first), so a repeated run has a folder and a label of its own.
    """
    args = bench.args
    view = data_view(bench, size, slug(bench, checkout))
    name = f"n{size}-{slug(bench, checkout)}" + (f"-v{args.train_variant.index(variant)}" if variant else "")
    name += f"-r{run + 1}" if run else ""
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
    env, flags = split_variant(variant)
    argv += flags
    rc, wall, figures = traced_run(bench, ["--", "train.py", *argv], checkout.path, f"train-{name}", env)
    run_dir = project / name
    label = f"{checkout.label} {variant}".strip() + (f" (round {run + 1})" if run else "")
    bench.report.add("training", TRAIN_COLUMNS, train_row(size, "ours", label, figures, coco_scores(run_dir), wall, rc))
    best = run_dir / "weights" / "best.pt"
    if bench.first_weights is None and best.is_file() and not variant:
        bench.first_weights, bench.first_data = best, our_yaml(view)


def split_variant(variant: str) -> tuple[dict[str, str], list[str]]:
    """A --train-variant's leading NAME=value words (the runner's environment, as in a shell) and its train.py flags."""
    words = variant.split()
    env: dict[str, str] = {}
    while words and ENV_WORD.match(words[0]):
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    return env, words


def ultralytics_available() -> bool:
    """Whether `ultralytics` can be imported here (its wheels installed for the comparison only)."""
    return importlib.util.find_spec("ultralytics") is not None


def train_ultralytics(bench: Bench, size: int, epochs: int, run: int = 0) -> None:
    """Train `--cfg` with Ultralytics' trainer on the same data and settings; score best.pt with our val.py."""
    args = bench.args
    view = data_view(bench, size, "ultralytics")
    name = f"n{size}-ultralytics" + (f"-r{run + 1}" if run else "")
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
    label = f"- (round {run + 1})" if run else "-"
    bench.report.add("training", TRAIN_COLUMNS, train_row(size, "ultralytics", label, figures, scores, wall, rc))


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
        first = bench.checkouts[0]
        trainers: list[tuple[Checkout | None, str]] = [(checkout, "") for checkout in bench.checkouts]
        trainers += [(first, variant) for variant in args.train_variant]
        trainers += [(None, "")] if with_ultralytics else []
        # Rounds alternate the order (A B C, C B A, ...): a machine that warms up or slows down over the
        # runs does not always favour the same trainer, and the rows of one trainer show the spread.
        for run in range(args.rounds):
            for checkout, variant in trainers if run % 2 == 0 else trainers[::-1]:  # None: Ultralytics
                if bench.seconds_left() <= 0:
                    bench.report.say(f"train: deadline reached, the rest of the {size}-image runs skipped")
                    return
                if checkout is None:
                    train_ultralytics(bench, size, epochs, run)
                else:
                    train_ours(bench, checkout, size, epochs, variant, run)
