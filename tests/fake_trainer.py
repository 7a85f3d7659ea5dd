"""A stand-in for train.py in tuner tests: writes results.csv rows and trial.json as a run would, in milliseconds.

Reads the flags the tuner passes (--hyp, --project, --name, --epochs). Its per-epoch score and
fitness are a smooth function of lr0 (best at 0.002), so samplers have something to find. Behaviour
per trial name comes from FAKE_TRAINER (JSON {name: refused | crash | oom | nan | hang | slow | slow_final | quick |
poor}: refused exits with a one-line error before making its run folder, as train.py does on a bad flag;
slow_final spends ten epochs' time between its last row and trial.json, as train.py's final validation does;
quick epochs take a tenth of the time; poor scores half what its lr0 would, below any other trial);
FAKE_EPOCH_S sets the seconds per epoch. It never imports torch, so a trial costs about one Python start.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import yaml


def main() -> int:
    parser = argparse.ArgumentParser()
    for flag in ("--hyp", "--project", "--name", "--epochs", "--optimizer", "--device", "--data", "--cfg", "--imgsz"):
        parser.add_argument(flag)
    parser.add_argument("--callbacks", nargs="+", default=[])
    args, _ = parser.parse_known_args()
    mode = json.loads(os.environ.get("FAKE_TRAINER", "{}")).get(args.name, "")
    if mode == "refused":
        print("error: --imgsz 64 is refused by the fake trainer", file=sys.stderr)
        return 2
    run_dir = Path(args.project) / args.name
    run_dir.mkdir(parents=True, exist_ok=True)
    hyp = yaml.safe_load(Path(args.hyp).read_text())
    epoch_s = float(os.environ.get("FAKE_EPOCH_S", "0.05")) * {"slow": 50, "hang": 50, "quick": 0.1}.get(mode, 1)
    epochs = int(args.epochs or 2)
    (run_dir / "argv.json").write_text(json.dumps(sys.argv[1:]))
    if mode == "crash":
        print("Traceback (most recent call last):\nRuntimeError: the fake trainer crashed", file=sys.stderr)
        return 1
    if mode == "oom":
        print("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", file=sys.stderr)
        return 1
    peak = (0.5 - 0.1 * abs(math.log10(hyp["lr0"] / 0.002))) * (0.5 if mode == "poor" else 1)
    with (run_dir / "results.csv").open("w") as file:
        file.write("epoch,metrics/mAP50-95,metrics/mask_mAP50-95\n")  # a segmentation run's mask column too
        for epoch in range(1, epochs + 1):
            time.sleep(epoch_s)
            score = float("nan") if mode == "nan" else peak * epoch / epochs
            file.write(f"{epoch},{score},{0.9 * score}\n")
            file.flush()
    if mode == "slow_final":
        time.sleep(10 * epoch_s)
    weights = run_dir / "weights"
    weights.mkdir(exist_ok=True)
    (weights / "best.pt").write_bytes(b"fake")
    fitness = float("nan") if mode == "nan" else peak
    metrics = {"mAP50-95": fitness, "mask_mAP50-95": 0.9 * fitness}
    result = {"metrics": metrics, "epochs": epochs, "best": str(weights / "best.pt")}
    (run_dir / "trial.json").write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
