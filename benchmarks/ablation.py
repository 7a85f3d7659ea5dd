"""Why our short-run recipe trains better than Ultralytics' at equal epochs: swap one part of it at a time.

    python3 benchmarks/ablation.py                                  # yolov8n, 15 epochs at 160 px, 2 seeds, 2 sets
    python3 benchmarks/ablation.py --epochs 30 --imgsz 224 --seeds 0 1 2

Our anchor-free short-run recipe (`--optimizer auto` on a small set: AdamW, data/hyps/hyp.anchor-free.quickstart.yaml)
and what Ultralytics' trainer runs by default on the same data (its `optimizer=auto` for a run of under
10,000 iterations: AdamW at lr0 = 0.002 x 5 / (4 + classes), 0.001 for the 6 shape classes, momentum 0.9,
warmup_bias_lr 0; default.yaml: nbs 64, warmup_epochs 3, close_mosaic 10) share lr0, lrf, momentum,
weight decay, the loss gains (box 7.5, cls 0.5, dfl 1.5) and every augmentation value. They differ in
four parts, and each candidate below trains our recipe with one of them swapped for Ultralytics' value,
the last with all four (Ultralytics' recipe, in our trainer):

    nbs 16 -> 64              gradients accumulated over 4 batches of 16 (a quarter of the optimizer steps)
    warmup_epochs 1 -> 3      (both trainers warm up for at least 100 iterations)
    warmup_bias_lr 0.1 -> 0   Ultralytics' auto optimizer starts the bias warmup at zero
    --close-mosaic 0 -> 10    the last 10 epochs without mosaic

Each run is train.py in a subprocess (benchmarks/recipes.py's runner) on the built-in set and on a
second generated set (generator seed 1, --second-images train / 100 val images), once per --seeds
value; the score is pycocotools mAP50-95 of best.pt. Prints one Markdown table: per candidate and set
the mean over seeds, the spread (max - min) and the change from our recipe.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as `python benchmarks/ablation.py`
    sys.path.insert(0, str(ROOT))

from benchmarks.recipes import Candidate, run_candidate, synthetic_data  # noqa: E402
from utils.config import DEFAULT_DATA  # noqa: E402
from utils.data.data_config import load_data_config  # noqa: E402
from utils.data.image_files import list_image_files  # noqa: E402
from utils.distributed import DistContext  # noqa: E402

OUR_HYP = ROOT / "data" / "hyps" / "hyp.anchor-free.quickstart.yaml"
# Ultralytics' values for the four parts where the recipes differ (hyp keys; close_mosaic is a train.py flag).
SWAPS = {"nbs": 64, "warmup_epochs": 3.0, "warmup_bias_lr": 0.0, "close_mosaic": 10}


@dataclass(frozen=True)
class Variant:
    """Our recipe with some parts set to Ultralytics' values."""

    name: str
    title: str
    changes: dict[str, float]


VARIANTS = [
    Variant("ours", "our recipe (AdamW, hyp.anchor-free.quickstart)", {}),
    *(Variant(f"{key}-{value:g}", f"ours with {key} {value:g}", {key: value}) for key, value in SWAPS.items()),
    Variant("ultralytics", "all four: Ultralytics' recipe in our trainer", dict(SWAPS)),
]


def candidate(variant: Variant, folder: Path, model: str) -> Candidate:
    """train.py flags for `variant`: our hyp file with its changed keys written beside the runs, AdamW as auto picks."""
    hyp = yaml.safe_load(OUR_HYP.read_text())
    hyp.update({key: value for key, value in variant.changes.items() if key != "close_mosaic"})
    hyp_file = folder / f"hyp.{variant.name}.yaml"
    hyp_file.parent.mkdir(parents=True, exist_ok=True)
    hyp_file.write_text(yaml.safe_dump(hyp, sort_keys=False), encoding="utf-8")
    flags = ("--cfg", model, "--optimizer", "AdamW", "--hyp", str(hyp_file),
             "--close-mosaic", str(int(variant.changes.get("close_mosaic", 0))))  # fmt: skip
    return Candidate(variant.name, variant.title, flags)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cfg", default="yolov8n")
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--imgsz", type=int, default=160)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--second-images", type=int, default=500, help="train images of the second, generated set")
    parser.add_argument("--variants", nargs="+", default=None, help="variant names to run (default: all)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--project", type=Path, default=ROOT / "runs" / "ablation")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    sets = {"built-in": DEFAULT_DATA, f"generated {args.second_images}": synthetic_data(args.second_images, 100, 1)}
    variants = [v for v in VARIANTS if args.variants is None or v.name in args.variants]
    scores: dict[tuple[str, str], list[float]] = {}
    for set_name, data in sets.items():
        config = load_data_config(data, DistContext())
        num_images = len(list_image_files(config.split("train")))
        for seed in args.seeds:
            for variant in variants:
                folder = args.project / set_name.replace(" ", "-") / f"seed{seed}"
                item = candidate(variant, folder, args.cfg)
                argv = ["--data", str(data), "--epochs", str(args.epochs), "--imgsz", str(args.imgsz),
                        "--batch-size", str(args.batch_size), "--seed", str(seed), "--workers", str(args.workers),
                        "--noplots", "--project", str(folder), "--name", variant.name, "--exist-ok",
                        *item.flags]  # fmt: skip
                outcome = run_candidate(item, argv, "train.py", folder / f"{variant.name}.log", num_images)
                if outcome.map50_95 is not None:
                    scores.setdefault((variant.name, set_name), []).append(outcome.map50_95)
                print(f"{set_name} seed {seed} {variant.name}: mAP50-95 {outcome.map50_95}", flush=True)
    print_table(variants, list(sets), scores, args)


def print_table(variants: list[Variant], sets: list[str], scores: dict[tuple[str, str], list[float]],
                args: argparse.Namespace) -> None:  # fmt: skip
    seeds = " ".join(map(str, args.seeds))
    print(f"\n{args.cfg}, {args.epochs} epochs at {args.imgsz} px, batch {args.batch_size}, seeds {seeds}: "
          "pycocotools mAP50-95 of best.pt, mean (spread) and change from ours\n")  # fmt: skip
    print("| candidate | " + " | ".join(sets) + " |")
    print("|---|" + "---|" * len(sets))
    for variant in variants:
        cells = []
        for set_name in sets:
            found, base = scores.get((variant.name, set_name), []), scores.get(("ours", set_name), [])
            if not found:
                cells.append("failed")
                continue
            mean = statistics.mean(found)
            delta = f", {mean - statistics.mean(base):+.3f}" if base and variant.name != "ours" else ""
            cells.append(f"{mean:.3f} ({max(found) - min(found):.3f}{delta})")
        print(f"| {variant.title} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
