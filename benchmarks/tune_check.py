"""Does tuning pay? A pruned study on the built-in set, then its best hyp against the base recipe on a set it never saw.

    python3 benchmarks/tune_check.py                       # 20 trials x 5 epochs at 128 px, then 2 seeds x 20 epochs
    python3 benchmarks/tune_check.py --trials 40 --epochs 10 --imgsz 224 --full-imgsz 320

1. `tune.py` on the built-in set (short schedule, median pruning); run again with the same --out it
   resumes the study instead of starting over.
2. What pruning saved: epochs (and seconds) the pruned trials did not train, against the same trials
   run to the end (a pruned trial's missing epochs are costed at its own seconds per epoch).
3. A second generated set (generator seed 1, 500 train / 100 val images, its own COCO annotations):
   the base recipe and the study's best_hyp.yaml, each trained --full-epochs with every --seeds seed,
   same optimizer; pycocotools mAP50-95 of best.pt. Prints one table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import optuna  # noqa: E402

import train  # noqa: E402
import tune  # noqa: E402
from utils.data.synthetic import SyntheticSpec, ensure_synthetic_dataset  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cfg", default="yolov8n")
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--epochs", type=int, default=5, help="epochs per trial")
    parser.add_argument("--imgsz", type=int, default=128, help="trial image size")
    parser.add_argument("--full-epochs", type=int, default=20)
    parser.add_argument("--full-imgsz", type=int, default=160)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "tune-check")
    return parser.parse_args()


def run_study(args: argparse.Namespace) -> Path:
    """The pruned study on the built-in set; returns its folder."""
    tune.main(["--cfg", args.cfg, "--imgsz", str(args.imgsz), "--epochs", str(args.epochs), "--trials",
               str(args.trials), "--workers", str(args.workers), "--project", str(args.out), "--name", "study",
               "--noplots"])  # fmt: skip
    return args.out / "study"


def pruning_savings(study_dir: Path, epochs: int) -> str:
    """Epochs and seconds the pruned trials saved against running every trial to its end."""
    study = optuna.load_study(study_name="study", storage=f"sqlite:///{study_dir / 'study.db'}")
    trained = full = seconds = full_seconds = 0.0
    for trial in study.get_trials():
        if trial.state not in (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED):
            continue
        run = int(trial.user_attrs.get("epochs", epochs)) or 1
        spent = (trial.datetime_complete - trial.datetime_start).total_seconds()
        trained, full = trained + run, full + epochs
        seconds, full_seconds = seconds + spent, full_seconds + spent * epochs / run
    pruned = sum(t.state == optuna.trial.TrialState.PRUNED for t in study.get_trials())
    return (
        f"pruning: {pruned} trials pruned; {trained:.0f} of {full:.0f} trial-epochs trained "
        f"({1 - trained / full:.0%} saved); {seconds / 3600:.2f} h of compute, {full_seconds / 3600:.2f} h unpruned"
    )


def second_set(out: Path) -> Path:
    """The generated set the study never saw, with a dataset YAML naming its COCO annotations."""
    ensure_synthetic_dataset(out / "set2", SyntheticSpec(seed=1, num_train=500, num_val=100))
    data = out / "set2.yaml"
    names = list(SyntheticSpec().class_names)
    data.write_text(yaml.safe_dump({"path": "set2", "train": "images/train", "val": "images/val",
                                    "val_annotations": "annotations/instances_val.json", "names": names}))  # fmt: skip
    return data


def confirm(args: argparse.Namespace, study_dir: Path, data: Path) -> dict[str, list[float]]:
    """Train the base recipe and the best hyp on `data` with each seed; mAP50-95 of best.pt per recipe."""
    settings = optuna.load_study(study_name="study", storage=f"sqlite:///{study_dir / 'study.db'}").user_attrs
    optimizer = settings["settings"]["optimizer"]
    scores: dict[str, list[float]] = {"base recipe": [], "tuned (best_hyp.yaml)": []}
    for label, hyp in (("base recipe", []), ("tuned (best_hyp.yaml)", ["--hyp", str(study_dir / "best_hyp.yaml")])):
        for seed in args.seeds:
            name = f"{'tuned' if hyp else 'base'}-seed{seed}"
            result = train.main(["--cfg", args.cfg, "--data", str(data), "--epochs", str(args.full_epochs), "--imgsz",
                                 str(args.full_imgsz), "--seed", str(seed), "--optimizer", optimizer, "--workers",
                                 str(args.workers), "--project", str(args.out / "confirm"), "--name", name,
                                 "--exist-ok", "--noplots", *hyp])  # fmt: skip
            scores[label].append(result.metrics["mAP50-95"])
    return scores


def main() -> None:
    args = parse_args()
    started = time.time()
    study_dir = run_study(args)
    study_s = time.time() - started
    lines = [pruning_savings(study_dir, args.epochs), f"study wall time {study_s / 60:.1f} min"]
    data = second_set(args.out)
    scores = confirm(args, study_dir, data)
    lines.append(f"| recipe on the unseen set ({args.full_epochs} epochs, {args.full_imgsz} px) | mAP50-95 per seed "
                 f"{args.seeds} | mean |")  # fmt: skip
    lines.append("|---|---|---|")
    for label, values in scores.items():
        lines.append(f"| {label} | {', '.join(f'{v:.4f}' for v in values)} | {statistics.mean(values):.4f} |")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
