"""The GPU benchmark's speed parts: val.py per precision and benchmarks/train_step.py per model, task and precision."""

from __future__ import annotations

import re
import sys

from benchmarks.gpu_bench import (
    FLAG,
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
)

SPEED = re.compile(r"Speed per image: ([\d.]+) ms pre-process, ([\d.]+) ms inference, ([\d.]+) ms NMS")
STEP_HEADER = re.compile(r"median ms over")
STEP_COLUMNS = (
    "model", "task", "code", "dtype", "step ms", "pipelined ms", "loss ms", "loss share", "loss ops", "inference ms",
    "status",
)  # fmt: skip
STEP_ROWS = ("step", "pipelined", "loss", "inference")  # train_step.py's rows the table reports
VAL_COLUMNS = ("code", "dtype", "inference ms/img", "pre ms/img", "NMS ms/img", "images/s", "mAP50-95", "status")


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


def parse_step_output(text: str) -> dict[str, dict[str, float | str]]:
    """train_step.py's tables: dtype -> {row: ms of the first column}; "<dtype>+<variant>" for each
    "<layout>+<variant>" column (compile, static, graph). The `loss-ops` row is kept as printed
    ("forward+backward" operator counts)."""
    tables: dict[str, dict[str, float | str]] = {}
    dtype, columns = "", []
    for line in text.splitlines():
        words = line.split()
        if STEP_HEADER.search(line):
            named = re.search(r"dtype (\w+)", line)
            dtype, columns = (named.group(1) if named else ("fp16" if " amp," in line else "fp32")), []
        elif dtype and words and words[0] == "phase":
            columns = words[1:]
        elif dtype and words and (words[0] in STEP_ROWS or words[0] == "loss-ops"):
            for index, value in enumerate(words[1:]):
                name = columns[index] if index < len(columns) else ""
                if index == 0 or ("+" in name and "/" not in name):
                    key = dtype if index == 0 else f"{dtype}+{name.split('+', 1)[1]}"
                    tables.setdefault(key, {})[words[0]] = value if words[0] == "loss-ops" else float(value)
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
    if args.step_graph and "--cuda-graph" in known and bench.cuda:
        base.append("--cuda-graph")
    elif args.step_graph:
        bench.report.say(f"step: {checkout.label}'s train_step.py cannot time --cuda-graph here; timed without it")
    if "--dtypes" in known:
        runs = [(args.step_dtypes, [*base, "--dtypes", *args.step_dtypes, "--layouts", "nhwc"])]
    else:  # an older script: fp32, or fp16 with --amp; both layouts, the first column is NHWC
        runs = [([dtype], base + (["--amp"] if dtype == "fp16" else [])) for dtype in args.step_dtypes]
    for dtypes, argv in runs:
        if dtypes != args.step_dtypes and dtypes[0] == "bf16":
            bench.report.add(
                "train step",
                STEP_COLUMNS,
                [model, task, checkout.label, "bf16", "-", "-", "-", "-", "-", "-", "not in this train_step.py"],
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
                    str(phases.get("loss-ops", "-")),
                    fmt(phases.get("inference"), ".1f"),
                    status,
                ],
            )
