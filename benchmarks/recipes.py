"""Benchmark training recipes: train each candidate on one dataset and print one table of their accuracy and cost.

Usage (from the repository root):

    python benchmarks/recipes.py                              # built-in set at the quick start's sizes
    python benchmarks/recipes.py --synthetic-images 100       # a generated set of 100 train images
    python benchmarks/recipes.py --synthetic-images 2000 --epochs 30
    python benchmarks/recipes.py --data my.yaml --epochs 60 --imgsz 320 -- --cfg yolov5s   # after --: train.py
    python benchmarks/recipes.py --cfg yolov5n yolov8n yolo11n yolo26n --seeds 0 1   # the model table

With `--cfg`, the candidates are models instead of recipes: each trains with `--optimizer auto` (its
family's recipe files) once per `--seeds` value, and the table gives parameters, GFLOPs at 640, CPU
milliseconds per 640 px image (fused, batch 1, median of 15 after 5 warm-ups), and mAP50-95 / mAP50
as the mean over the seeds with the spread (max - min) beside it.

Each candidate is `python train.py` (segment/train.py with --task segment) in its own subprocess, so
one that crashes leaves a "failed" row and the others still run. Every candidate gets the same
dataset, epochs, image size, global batch and seed; they differ only in the recipe flags below.
Candidates whose options resolve to the same run (`auto` picking the old defaults' recipe) are
trained once and share a row's figures. The table gives, per candidate: its optimizer steps
(utils/train/recipe.py: optimizer_steps, from the run's opt.yaml and hyp.yaml), mAP50-95 and mAP50
of best.pt from pycocotools (the final validation of train.py: multi-label NMS at conf 0.001 and IoU
0.6, as YOLOv5's val.py, then COCOeval on the YAML's val_annotations; a dataset without them is
scored by the internal metric, said in the table) and the wall time of the subprocess.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as `python benchmarks/recipes.py`
    sys.path.insert(0, str(ROOT))

from benchmarks.quickstart import parse_done_line, parse_scores  # noqa: E402  (needs the repository root)
from utils.config import (  # noqa: E402
    DEFAULT_DATA,
    DEFAULT_HYP,
    QUICKSTART_BATCH,
    QUICKSTART_EPOCHS,
    QUICKSTART_HYP,
    QUICKSTART_IMGSZ,
)
from utils.data.data_config import load_data_config  # noqa: E402
from utils.data.image_files import list_image_files  # noqa: E402
from utils.data.synthetic import SHAPE_NAMES, SyntheticSpec, ensure_synthetic_dataset  # noqa: E402
from utils.distributed import DistContext  # noqa: E402
from utils.eval.coco import EVAL_FILE  # noqa: E402
from utils.train.config import train_config_from_argv  # noqa: E402
from utils.train.recipe import YOLOV5_RECIPES, optimizer_steps, resolve_recipe  # noqa: E402

SCRIPTS = {"detect": "train.py", "segment": "segment/train.py"}
# The close-mosaic candidate trains this share of the epochs without mosaic (Ultralytics closes the last
# 10). Measured: +0.005 / 0.000 mAP50-95 on the built-in and a 100-image set (docs/training.md), so the default stays 0.
CLOSE_MOSAIC_SHARE = 0.15
RECIPE_MODEL = "yolov5n"  # the model the recipe candidates train (--cfg compares models instead)


@dataclass(frozen=True)
class Candidate:
    """One recipe to train: a short name (also the run folder's), what it stands for, and its train.py flags."""

    name: str
    title: str
    flags: tuple[str, ...]


def candidates(epochs: int) -> list[Candidate]:
    """The recipes compared, in table order; the close-mosaic one closes CLOSE_MOSAIC_SHARE of `epochs`."""
    closed = max(1, round(CLOSE_MOSAIC_SHARE * epochs))
    # Absolute paths, as auto records them, so a run auto resolves to the same recipe is recognised as one.
    # The two recipe files compared are the YOLOv5 family's, so every candidate trains RECIPE_MODEL.
    model = ("--cfg", RECIPE_MODEL)
    old_defaults = (*model, "--optimizer", "AdamW", "--hyp", str(QUICKSTART_HYP))
    old_advice = (*model, "--optimizer", "SGD", "--hyp", str(DEFAULT_HYP))
    return [
        Candidate("old-defaults", "old defaults: AdamW, hyp.quickstart (nbs 16)", old_defaults),
        Candidate("sgd-scratch-low", "old README advice: SGD, hyp.scratch-low (nbs 64)", old_advice),
        Candidate("auto", "new defaults: --optimizer auto", model),
        Candidate("auto-close-mosaic", f"auto + --close-mosaic {closed}", (*model, "--close-mosaic", str(closed))),
    ]


@dataclass(frozen=True)
class Outcome:
    """What one candidate's run gave; scores are None when it failed."""

    candidate: Candidate
    seconds: float
    returncode: int
    resolved: str = ""  # "AdamW, hyp.quickstart.yaml" from the run's opt.yaml
    steps: int | None = None
    map50_95: float | None = None
    map50: float | None = None
    source: str = ""  # "pycocotools" | "internal"
    same_as: str = ""  # the candidate whose run this one shares


def synthetic_data(num_train: int, num_val: int, seed: int) -> Path:
    """Generate (once) a shapes dataset of `num_train`/`num_val` images with COCO val annotations; return its YAML."""
    name = f"synthetic-n{num_train}-v{num_val}-s{seed}"
    root = ensure_synthetic_dataset(
        ROOT / "datasets" / name, SyntheticSpec(seed=seed, num_train=num_train, num_val=num_val)
    )
    yaml_file = root.parent / f"{name}.yaml"
    raw = {"path": name, "train": "images/train", "val": "images/val",
           "val_annotations": "annotations/instances_val.json", "names": list(SHAPE_NAMES)}  # fmt: skip
    yaml_file.write_text(yaml.safe_dump(raw, sort_keys=False), encoding="utf-8")
    return yaml_file


def train_argv(args: argparse.Namespace, data: Path, project: Path, candidate: Candidate) -> list[str]:
    """train.py's flags for `candidate`: the shared sizes, the candidate's recipe flags, then the extra flags."""
    shared = ["--data", str(data), "--epochs", str(args.epochs), "--imgsz", str(args.imgsz),
              "--batch-size", str(args.batch_size), "--seed", str(args.seed), "--noplots",
              "--project", str(project), "--name", candidate.name]  # fmt: skip
    return [*shared, *candidate.flags, *args.train_args]


def same_runs(argvs: dict[str, list[str]], num_images: int, task: str) -> dict[str, str]:
    """Map each candidate whose options resolve exactly like an earlier one's to that one (run once)."""
    first: dict[str, str] = {}
    shared: dict[str, str] = {}
    for name, argv in argvs.items():
        cfg, _ = resolve_recipe(train_config_from_argv(argv, task), YOLOV5_RECIPES, num_images)
        key = json.dumps({**cfg.to_dict(), "name": ""}, sort_keys=True, default=str)
        if key in first:
            shared[name] = first[key]
        else:
            first[key] = name
    return shared


def run_candidate(candidate: Candidate, argv: list[str], script: str, log: Path, num_images: int) -> Outcome:
    """Train one candidate in a subprocess (output to `log`) and read its figures from the run folder."""
    command = [sys.executable, script, *argv]
    print(f"[{candidate.name}] $ {' '.join(command)}  (log: {log})", flush=True)
    start = time.perf_counter()
    with log.open("w", encoding="utf-8") as out:
        returncode = subprocess.run(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT).returncode
    seconds = time.perf_counter() - start
    done = parse_done_line(log.read_text(encoding="utf-8", errors="replace").splitlines())
    print(f"[{candidate.name}] exit {returncode} after {seconds / 60:.1f} min", flush=True)
    if returncode != 0 or done is None:
        return Outcome(candidate, seconds, returncode)
    run_dir = Path(done["best"].strip()).parent.parent
    options = yaml.safe_load((run_dir / "opt.yaml").read_text())
    hyp = yaml.safe_load((run_dir / "hyp.yaml").read_text())
    steps = optimizer_steps(num_images, options["batch_size"], hyp["nbs"], options["epochs"])
    resolved = f"{options['optimizer']}, {Path(options['hyp_path']).name}"
    scores = _pycocotools_scores(run_dir / EVAL_FILE, options["task"])
    source = "pycocotools"
    if scores is None:  # no val_annotations in the dataset YAML: the internal metric of the Done line
        prefix = "mask_" if options["task"] == "segment" else ""
        done_scores = parse_scores(done["scores"])
        scores, source = (done_scores[f"{prefix}mAP50-95"], done_scores[f"{prefix}mAP50"]), "internal"
    return Outcome(candidate, seconds, returncode, resolved, steps, scores[0], scores[1], source)


def _pycocotools_scores(path: Path, task: str) -> tuple[float, float] | None:
    """(mAP50-95, mAP50) from a run's coco_eval.json (masks for segmentation), or None without the file."""
    if not path.is_file():
        return None
    stats = json.loads(path.read_text())
    kind = "segm" if task == "segment" and "segm" in stats else "bbox"
    return max(stats[kind]["AP"], 0.0), max(stats[kind]["AP50"], 0.0)


def print_table(outcomes: list[Outcome], header: str) -> None:
    """Print the one table (Markdown, to paste into "Choosing a recipe" in docs/training.md)."""
    print(f"\n{header}\n")
    print("| recipe | resolved to | optimizer steps | mAP50-95 | mAP50 | wall time |")
    print("|---|---|---|---|---|---|")
    for item in outcomes:
        title = item.candidate.title + (f" (same run as {item.same_as})" if item.same_as else "")
        if item.map50_95 is None:
            print(f"| {title} | failed (exit {item.returncode}) | | | | {item.seconds / 60:.1f} min |")
            continue
        scored = "" if item.source == "pycocotools" else f" ({item.source})"
        print(
            f"| {title} | {item.resolved} | {item.steps:,} | {item.map50_95:.3f}{scored} | {item.map50:.3f}{scored} "
            f"| {item.seconds / 60:.1f} min |"
        )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The benchmark's flags; defaults are the quick start's sizes on the built-in dataset."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=tuple(SCRIPTS), default="detect", help="segment: segment/train.py")
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="dataset YAML (default: the built-in set)")
    parser.add_argument("--synthetic-images", type=int, default=0, help="generate a shapes set of N train images")
    parser.add_argument("--synthetic-val", type=int, default=100, help="val images of the generated set")
    parser.add_argument("--synthetic-seed", type=int, default=1, help="generator seed (the built-in set uses 0)")
    parser.add_argument("--epochs", type=int, default=QUICKSTART_EPOCHS)
    parser.add_argument("--imgsz", type=int, default=QUICKSTART_IMGSZ)
    parser.add_argument("--batch-size", type=int, default=QUICKSTART_BATCH, help="global batch")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--recipes", nargs="+", default=None, help="candidate names to run (default: all)")
    parser.add_argument("--cfg", nargs="+", default=None, help="compare these models (auto recipe) instead")
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="with --cfg: train each model per seed")
    parser.add_argument("--project", type=Path, default=ROOT / "runs" / "recipes", help="parent of this run's folder")
    parser.add_argument("train_args", nargs="*", help="extra flags for every train.py run, after `--`")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Train the candidates, print the table; exit 1 when a candidate failed."""
    args = parse_args(argv)
    data = (
        synthetic_data(args.synthetic_images, args.synthetic_val, args.synthetic_seed)
        if args.synthetic_images
        else args.data
    )
    num_images = len(list_image_files(load_data_config(data, DistContext()).split("train")))
    if args.cfg:
        compare_models(args, data, num_images)
        return
    every = candidates(args.epochs)
    unknown = sorted(set(args.recipes or ()) - {c.name for c in every})
    if unknown:
        sys.exit(f"error: --recipes {unknown[0]} is not one of {', '.join(c.name for c in every)}")
    chosen = [c for c in every if args.recipes is None or c.name in args.recipes]
    project = args.project / time.strftime("%Y%m%d-%H%M%S")
    project.mkdir(parents=True)
    argvs = {c.name: train_argv(args, data, project, c) for c in chosen}
    shared = same_runs(argvs, num_images, args.task)
    outcomes: dict[str, Outcome] = {}
    for candidate in chosen:
        if candidate.name in shared:
            outcomes[candidate.name] = dataclasses.replace(
                outcomes[shared[candidate.name]], candidate=candidate, same_as=shared[candidate.name]
            )
            continue
        log = project / f"{candidate.name}.log"
        outcomes[candidate.name] = run_candidate(candidate, argvs[candidate.name], SCRIPTS[args.task], log, num_images)
    header = (
        f"{SCRIPTS[args.task]} on {data} ({num_images:,} train images), {args.epochs} epochs, {args.imgsz} px, "
        f"global batch {args.batch_size}, seed {args.seed}; runs in {project}"
    )
    print_table(list(outcomes.values()), header)
    sys.exit(1 if any(item.map50_95 is None for item in outcomes.values()) else 0)


def model_figures(cfg: str, task: str) -> tuple[int, float, float]:
    """(parameters, GFLOPs at 640, CPU ms per 640 px image: fused, batch 1, median of 15 after 5 warm-ups)."""
    import torch

    from models.model_info import estimate_gflops
    from utils.families import build_model, segmentation_spec, spec_from_cfg

    spec = spec_from_cfg(cfg, len(SHAPE_NAMES))
    spec = segmentation_spec(spec) if task == "segment" and not spec.num_masks else spec
    model = build_model(spec).eval()
    params = sum(p.numel() for p in model.parameters())
    gflops = estimate_gflops(model, 640)
    model = model.fuse()
    images = torch.rand(1, 3, 640, 640)
    times = []
    with torch.inference_mode():
        for rep in range(20):  # single runs vary by tens of percent on a busy CPU: take the median of many
            start = time.perf_counter()
            model(images)
            if rep >= 5:
                times.append(1000 * (time.perf_counter() - start))
    return params, gflops, sorted(times)[len(times) // 2]


def compare_models(args: argparse.Namespace, data: Path, num_images: int) -> None:
    """--cfg: train every model once per seed with the auto recipe and print the model table."""
    project = args.project / time.strftime("%Y%m%d-%H%M%S")
    project.mkdir(parents=True)
    seeds = args.seeds or [args.seed]
    rows = []
    for cfg in args.cfg:
        candidate = Candidate(cfg, cfg, ("--cfg", cfg))
        outcomes = []
        for seed in seeds:
            run_args = argparse.Namespace(**vars(args))
            run_args.seed = seed
            argv = train_argv(run_args, data, project / f"seed{seed}", candidate)
            log = project / f"{cfg}-seed{seed}.log"
            outcomes.append(run_candidate(candidate, argv, SCRIPTS[args.task], log, num_images))
        rows.append((cfg, model_figures(cfg, args.task), outcomes))
    print(
        f"\n{SCRIPTS[args.task]} on {data} ({num_images:,} train images), {args.epochs} epochs, {args.imgsz} px, "
        f"global batch {args.batch_size}, seeds {' '.join(map(str, seeds))}; runs in {project}\n"
    )
    print("| model | parameters | GFLOPs (640) | CPU ms/img (640) | recipe | mAP50-95 | mAP50 | wall per run |")
    print("|---|---|---|---|---|---|---|---|")
    failed = False
    for cfg, (params, gflops, ms), outcomes in rows:
        scored = [o for o in outcomes if o.map50_95 is not None]
        failed |= len(scored) < len(outcomes)
        if not scored:
            print(f"| {cfg} | {params:,} | {gflops:.1f} | {ms:.0f} | failed | | | |")
            continue
        strict = [o.map50_95 for o in scored]
        loose = [o.map50 for o in scored]
        spread = f" ({max(strict) - min(strict):.3f})" if len(strict) > 1 else ""
        minutes = sum(o.seconds for o in scored) / len(scored) / 60
        print(
            f"| {cfg} | {params:,} | {gflops:.1f} | {ms:.0f} | {scored[0].resolved} | "
            f"{sum(strict) / len(strict):.3f}{spread} | {sum(loose) / len(loose):.3f} | {minutes:.1f} min |"
        )
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
