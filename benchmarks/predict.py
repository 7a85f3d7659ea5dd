"""Benchmark detect.py: images/s of prediction on the built-in val images, end to end and per stage.

Usage (from the repository root):

    python benchmarks/predict.py --weights runs/train/exp/weights/best.pt            # 30 images at 640, CPU
    python benchmarks/predict.py --weights n.pt s.pt --images 50 --imgsz 640 --device cpu
    python benchmarks/predict.py --task segment --weights runs/train-seg/exp/weights/best.pt

For each checkpoint it runs what `detect.py --source <list> --imgsz 640` runs (utils.predict.predictor.predict,
one process, annotated images saved into a temporary folder) over the first --images images of the
built-in val split (generated on first use), after a warm-up run on --warmup images, and prints
the images/s of the whole loop (reading, letterbox, inference, NMS, drawing, writing; model
loading excluded) and its per-image pre-process / inference / NMS times. Without --weights it
uses the quick start's runs/train/exp/weights/best.pt when it exists.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as `python benchmarks/predict.py`
    sys.path.insert(0, str(ROOT))

from segment.task import SEGMENT  # noqa: E402
from utils.config import DEFAULT_DATA  # noqa: E402  (needs the repository root on sys.path)
from utils.data.data_config import load_data_config  # noqa: E402
from utils.data.image_files import list_image_files  # noqa: E402
from utils.distributed import DistContext, select_device  # noqa: E402
from utils.predict.config import PredictConfig  # noqa: E402
from utils.predict.predictor import PredictResult, predict  # noqa: E402
from utils.tasks import DETECT  # noqa: E402

QUICKSTART_BEST = ROOT / "runs" / "train" / "exp" / "weights" / "best.pt"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Parse the benchmark's flags (prediction flags with detect.py's names)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weights", type=Path, nargs="+", default=None, help="one or more checkpoints")
    parser.add_argument("--task", choices=("detect", "segment"), default="detect")
    parser.add_argument("--images", type=int, default=30, help="val images to predict (timed)")
    parser.add_argument("--warmup", type=int, default=3, help="images predicted first, untimed")
    parser.add_argument("--imgsz", type=int, default=640)
    parser.add_argument("--device", default="cpu")
    return parser.parse_args(argv)


def image_list(count: int, folder: Path) -> Path:
    """Write the first `count` built-in val images to a .txt list in `folder` (a detect.py --source)."""
    data = load_data_config(DEFAULT_DATA, DistContext())
    files = list_image_files(data.split("val"))[:count]
    listing = folder / f"images{count}.txt"
    listing.write_text("".join(f"{path}\n" for path in files))
    return listing


def run_once(cfg: PredictConfig, task_name: str, ctx: DistContext) -> PredictResult:
    """Predict `cfg` once; logging is not set up here, so only warnings (skipped inputs) are printed."""
    return predict(cfg, SEGMENT if task_name == "segment" else DETECT, ctx)


def main(argv: list[str] | None = None) -> None:
    """Print one line per checkpoint: images/s end to end and the per-image stage times."""
    args = parse_args(argv)
    weights = args.weights or [QUICKSTART_BEST]
    missing = [str(path) for path in weights if not path.is_file()]
    if missing:
        sys.exit(f"no checkpoint at {', '.join(missing)}: train one first (python train.py) or pass --weights")
    ctx = DistContext(device=select_device(args.device))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, device {ctx.device}")
    with tempfile.TemporaryDirectory(prefix="predict-bench-") as tmp:
        folder = Path(tmp)
        warm, timed = image_list(args.warmup, folder), image_list(args.images, folder)
        for path in weights:
            cfg = PredictConfig(path, str(warm), imgsz=(args.imgsz, args.imgsz), device=args.device)
            cfg = replace(cfg, project=folder / "runs", name=path.stem)
            run_once(cfg, args.task, ctx)
            result = run_once(replace(cfg, source=str(timed)), args.task, ctx)
            frames = result.total.frames
            pre, inference, nms = (1000 * result.total.seconds / frames).tolist()
            print(
                f"{path}: {frames} images at {args.imgsz}: {frames / result.loop_seconds:.2f} images/s end to end "
                f"({1000 * result.loop_seconds / frames:.1f} ms/image); per image {pre:.1f} ms pre-process, "
                f"{inference:.1f} ms inference, {nms:.1f} ms NMS; {result.total.detections} detections"
            )


if __name__ == "__main__":
    main()
