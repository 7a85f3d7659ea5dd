"""Benchmark export.py: time and round-trip error of TorchScript and ONNX for yolov5n and yolov5s.

Usage (from the repository root):

    python benchmarks/export.py                                  # yolov5n and yolov5s, 640 px, CPU
    python benchmarks/export.py --cfg yolov5n-seg --imgsz 320    # any --cfg, segmentation included

Saves an untrained checkpoint of each `--cfg` (seed 0, 80 classes, as training saves one) in a
temporary folder, then exports it once per format with `utils.export.export_checkpoint`, which loads
the file back and compares it with PyTorch on random images. Prints per model and format: the export
time (trace or ONNX export, save; ONNX also onnx.checker), the whole call (checkpoint load, fuse,
export, parity check), the file size, the largest absolute difference from PyTorch and, for scale,
the largest absolute PyTorch output (box centres and sizes are pixels). ONNX figures need `onnx` and
`onnxruntime`.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as `python benchmarks/export.py`
    sys.path.insert(0, str(ROOT))

from models.yolo import build_model, spec_from_cfg  # noqa: E402  (needs the sys.path line above)
from segment.task import SEGMENT  # noqa: E402
from utils.checkpoint import RunInfo, build_checkpoint, save_checkpoint  # noqa: E402
from utils.distributed import DistContext  # noqa: E402
from utils.export import ExportConfig, ExportWrapper, export_checkpoint  # noqa: E402
from utils.inference_model import load_inference_model  # noqa: E402
from utils.tasks import DETECT  # noqa: E402

TASKS = {DETECT.name: DETECT, SEGMENT.name: SEGMENT}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the benchmark's flags."""
    parser = argparse.ArgumentParser(description="Time export.py and measure its round-trip error")
    parser.add_argument("--cfg", nargs="+", default=["yolov5n", "yolov5s"], help="model sizes to export")
    parser.add_argument("--imgsz", type=int, default=640)
    parser.add_argument("--include", nargs="+", default=["torchscript", "onnx"])
    parser.add_argument("--dynamic", action="store_true", help="ONNX with dynamic axes (parity at batch 1 and 3)")
    return parser.parse_args(argv)


def save_untrained(cfg: str, folder: Path) -> Path:
    """Save an untrained `cfg` model (80 classes) as a checkpoint in `folder` and return its path."""
    torch.manual_seed(0)
    spec = spec_from_cfg(cfg, 80)
    task = SEGMENT if spec.num_masks else DETECT
    run = RunInfo(task=task.name, model_spec=spec.to_dict(), names=[f"class{i}" for i in range(80)],
                  train_config={}, hyp={})  # fmt: skip
    state = build_checkpoint(run=run, model=build_model(spec), ema=None, optimizer=None, scaler=None, epoch=0,
                             best_fitness=0.0)  # fmt: skip
    path = folder / f"{cfg}.pt"
    save_checkpoint(state, path, DistContext())
    return path


def output_scale(weights: Path, imgsz: int) -> float:
    """The largest absolute value PyTorch outputs for a random image: what the differences compare against."""
    task = TASKS[torch.load(weights, map_location="cpu", weights_only=True)["task"]]  # saved on any GPU
    model, _ = load_inference_model(weights, (task).name, torch.device("cpu"), channels_last=False)
    with torch.no_grad():
        outputs = ExportWrapper(model).eval()(torch.rand(1, 3, imgsz, imgsz))
    return max(float(t.abs().max()) for t in (outputs if isinstance(outputs, tuple) else (outputs,)))


def main(argv: list[str] | None = None) -> None:
    """Export each model in each format and print one row per file."""
    args = parse_args(argv)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU, {args.imgsz} px, batch 1")
    print(f"{'model':<14}{'format':<13}{'export s':>9}{'call s':>8}{'MB':>7}{'max |diff|':>12}{'max |out|':>11}")
    with tempfile.TemporaryDirectory() as folder:
        for cfg in args.cfg:
            weights = save_untrained(cfg, Path(folder))
            scale = output_scale(weights, args.imgsz)
            for file_format in args.include:
                options = ExportConfig(weights, (file_format,), (args.imgsz, args.imgsz), dynamic=args.dynamic)
                start = time.perf_counter()
                (item,) = export_checkpoint(options, TASKS, DistContext())
                call_seconds = time.perf_counter() - start
                diff = "not run" if item.max_abs_diff is None else f"{item.max_abs_diff:.2e}"
                size_mb = item.path.stat().st_size / 1e6
                print(
                    f"{cfg:<14}{file_format:<13}{item.export_seconds:>9.2f}{call_seconds:>8.2f}{size_mb:>7.1f}"
                    f"{diff:>12}{scale:>11.1f}"
                )


if __name__ == "__main__":
    main()
