"""Benchmark COCO validation: internal mAP vs pycocotools, validation images/s, and COCOeval's own time.

Usage (from the repository root):

    python benchmarks/coco_val.py --weights runs/train/exp/weights/best.pt
    python benchmarks/coco_val.py --weights best.pt --imgsz 320 --batch-size 16 --workers 2

Validates the checkpoint on the built-in val split (data/synthetic.yaml, generated on first use)
exactly as `val.py --save-json` does, in one process, and prints: the internal mAP50-95 / mAP50
and pycocotools' (target: differ by at most 0.02), the validation throughput in images/s (the
whole evaluation loop: loading, letterbox, inference, NMS, matching; worker start-up included),
its per-image stage times, and the time COCOeval itself takes (loadRes, evaluate, accumulate,
summarize). Without --weights it uses the quick start's runs/train/exp/weights/best.pt when it
exists; an untrained model would score ~0 mAP and make the comparison meaningless.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as `python benchmarks/coco_val.py`
    sys.path.insert(0, str(ROOT))

from utils.config import DEFAULT_DATA  # noqa: E402
from utils.distributed import DistContext  # noqa: E402
from utils.eval.checkpoint_val import prepare_validation  # noqa: E402
from utils.eval.coco import EVAL_FILE, coco_evaluate  # noqa: E402  (needs the repository root on sys.path)
from utils.eval.config import ValConfig  # noqa: E402
from utils.eval.evaluate import EvalOptions  # noqa: E402
from utils.logs import setup_logging  # noqa: E402
from utils.tasks import DETECT  # noqa: E402

QUICKSTART_BEST = ROOT / "runs" / "train" / "exp" / "weights" / "best.pt"
TARGET_DIFFERENCE = 0.02


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Parse the benchmark's flags (validation flags with val.py's names)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weights", type=Path, default=None, help="checkpoint from `python train.py` (best.pt)")
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="dataset YAML naming val_annotations")
    parser.add_argument("--imgsz", type=int, default=640)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    return parser.parse_args(argv)


def resolve_weights(weights: Path | None) -> Path:
    """Return --weights, or the quick start's best.pt; exit with an explanation when there is neither."""
    if weights is not None:
        return weights
    if QUICKSTART_BEST.is_file():
        print(f"--weights not given: using the quick start's {QUICKSTART_BEST}")
        return QUICKSTART_BEST
    sys.exit(
        "error: pass --weights <checkpoint>; train one first with `python train.py` (the quick start writes "
        f"{QUICKSTART_BEST.relative_to(ROOT)}). An untrained model scores ~0 mAP, which compares nothing."
    )


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print its figures; return 0 when the mAP difference is within the target."""
    args = parse_args(argv)
    ctx = DistContext(device=torch.device(args.device))
    setup_logging(ctx)
    save_dir = Path(tempfile.mkdtemp(prefix="coco-val-bench-"))
    cfg = ValConfig(
        weights=resolve_weights(args.weights),
        data=args.data,
        batch_size=args.batch_size,
        imgsz=args.imgsz,
        workers=args.workers,
        device=args.device,
        save_json=True,
        project=save_dir.parent,
        name=save_dir.name,
        exist_ok=True,
    )
    load_before = os.getloadavg()
    setup = prepare_validation(cfg, DETECT, ctx)
    options = EvalOptions(num_classes=len(setup.names), collect_predictions=True)
    start = time.perf_counter()
    result = DETECT.evaluate(setup.model, setup.loader, options, ctx)
    eval_seconds = time.perf_counter() - start
    internal = result.as_dict()
    start = time.perf_counter()
    scored = coco_evaluate(result, setup.data, cfg.split, setup.save_dir, ctx, target=setup.coco_target)
    coco_seconds = time.perf_counter() - start
    cocoeval_seconds = json.loads((setup.save_dir / EVAL_FILE).read_text())["seconds"]
    coco = scored.as_dict()
    return report(args, cfg, result.num_images, internal, coco, (eval_seconds, coco_seconds, cocoeval_seconds),
                  result.speed_ms, load_before)  # fmt: skip


def report(
    args: argparse.Namespace,
    cfg: ValConfig,
    num_images: int,
    internal: dict[str, float],
    coco: dict[str, float],
    seconds: tuple[float, float, float],
    speed_ms: dict[str, float],
    load_before: tuple[float, float, float],
) -> int:
    """Print the figures and the target check; return the exit status (0 = within target).

    `seconds` = (evaluation loop, coco_evaluate in all, COCOeval alone).
    """
    eval_seconds, coco_seconds, cocoeval_seconds = seconds
    difference = abs(internal["mAP50-95"] - coco["mAP50-95"])
    print(f"\nweights {cfg.weights} | data {cfg.data} | {num_images} images")
    print(f"internal    mAP50-95 {internal['mAP50-95']:.4f}  mAP50 {internal['mAP50']:.4f}")
    print(f"pycocotools mAP50-95 {coco['mAP50-95']:.4f}  mAP50 {coco['mAP50']:.4f}")
    print(
        f"difference  mAP50-95 {coco['mAP50-95'] - internal['mAP50-95']:+.4f}  mAP50 "
        f"{coco['mAP50'] - internal['mAP50']:+.4f}  (target |mAP50-95 diff| <= {TARGET_DIFFERENCE}: "
        f"{'met' if difference <= TARGET_DIFFERENCE else 'MISSED'})"
    )
    print(
        f"validation  {num_images / eval_seconds:.1f} images/s ({eval_seconds:.1f} s) at --imgsz {cfg.imgsz}, "
        f"batch {cfg.batch_size}, {args.workers} workers, {torch.get_num_threads()} torch threads, "
        f"{len(os.sched_getaffinity(0))} CPU cores"
    )
    print(
        f"per image   {speed_ms['preprocess']:.1f} ms pre-process, {speed_ms['inference']:.1f} ms inference, "
        f"{speed_ms['nms']:.1f} ms NMS"
    )
    print(f"COCOeval    {cocoeval_seconds:.2f} s (coco_evaluate total with JSON writing: {coco_seconds:.2f} s)")
    print(f"load avg    {load_before[0]:.2f} before, {os.getloadavg()[0]:.2f} after (1 min)")
    return 0 if difference <= TARGET_DIFFERENCE else 1


if __name__ == "__main__":
    sys.exit(main())
