"""Benchmark one training step (forward, loss, backward, optimizer) and eval inference, per memory layout.

Usage (from the repository root):

    python benchmarks/train_step.py                          # yolov5n-seg, 224 px, batch 16: the seg quick start
    python benchmarks/train_step.py --task detect --cfg yolov5s --imgsz 640 --batch-size 8
    python benchmarks/train_step.py --device cuda --amp      # on a GPU: fp16 autocast as training uses it

Builds the quick start's model and loss (`--task`, `--cfg`) and a few real augmented batches of
the training loader (built-in dataset unless `--data`), then times `--steps` steps per layout:
NHWC (`channels_last`, the default in training) and NCHW. The layouts take turns step by step
on identical starting weights, so a machine whose speed drifts affects both alike. Then times
eval inference of the fused model, again in turns. Prints the median milliseconds of each phase
per layout and the NCHW / NHWC ratio.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as `python benchmarks/train_step.py`
    sys.path.insert(0, str(ROOT))

from models.model_info import memory_format  # noqa: E402  (needs the sys.path line above)
from segment.task import SEGMENT  # noqa: E402
from utils.config import DEFAULT_DATA, QUICKSTART_BATCH, QUICKSTART_HYP, QUICKSTART_IMGSZ, TrainConfig  # noqa: E402
from utils.data.data_config import load_data_config  # noqa: E402
from utils.data.loader import images_on_device  # noqa: E402
from utils.distributed import DistContext  # noqa: E402
from utils.hyp import load_hyp  # noqa: E402
from utils.tasks import DETECT  # noqa: E402
from utils.train.setup import build_datasets, build_model_bundle  # noqa: E402

LAYOUTS = {"nhwc": True, "nchw": False}
PHASES = ("forward", "loss", "backward", "optimizer")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the benchmark's flags."""
    parser = argparse.ArgumentParser(description="Time training steps and inference in NHWC and NCHW layouts")
    parser.add_argument("--task", default="segment", choices=("detect", "segment"))
    parser.add_argument("--cfg", default="", help="model size (default: yolov5n, or yolov5n-seg for segment)")
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="dataset YAML (default: built-in synthetic)")
    parser.add_argument("--imgsz", type=int, default=QUICKSTART_IMGSZ)
    parser.add_argument("--batch-size", type=int, default=QUICKSTART_BATCH, help="images per step (one process)")
    parser.add_argument("--steps", type=int, default=12, help="timed steps per layout")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per layout first")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--amp", action="store_true", help="fp16 autocast and GradScaler (CUDA only)")
    return parser.parse_args(argv)


class Arm:
    """One layout's model, loss and optimizer, started from the shared weights."""

    def __init__(self, model: torch.nn.Module, cfg: TrainConfig, task, channels_last: bool, amp: bool) -> None:
        self.model = copy.deepcopy(model).to(memory_format=memory_format(channels_last))
        self.loss_fn = task.build_loss(self.model, cfg)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=1e-4, momentum=0.9)
        self.device = next(self.model.parameters()).device
        self.amp = amp
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=amp)
        self.times: dict[str, list[float]] = {phase: [] for phase in (*PHASES, "inference")}

    def _clock(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def step(self, batch: dict, record: bool) -> None:
        """One training step on `batch`; its phase times are kept when `record`."""
        self.model.train()
        images = images_on_device(batch, self.device)
        extra = {"masks": batch["masks"].to(self.device)} if "masks" in batch else {}
        marks = [self._clock()]
        with torch.autocast(self.device.type, dtype=torch.float16, enabled=self.amp):
            preds = self.model(images)
            marks.append(self._clock())
            loss, _ = self.loss_fn(preds, batch["targets"].to(self.device), None, **extra)
            marks.append(self._clock())
        self.scaler.scale(loss).backward()
        marks.append(self._clock())
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        marks.append(self._clock())
        if record:
            for phase, start, end in zip(PHASES, marks[:-1], marks[1:], strict=True):
                self.times[phase].append(end - start)

    @torch.no_grad()
    def infer(self, batch: dict, record: bool) -> None:
        """Eval-mode forward of the fused model on `batch`."""
        images = images_on_device(batch, self.device)
        start = self._clock()
        with torch.autocast(self.device.type, dtype=torch.float16, enabled=self.amp):
            self.model(images)
        if record:
            self.times["inference"].append(self._clock() - start)


def build_arms(args: argparse.Namespace) -> tuple[dict[str, Arm], list[dict], TrainConfig]:
    """Build the shared model and real training batches, then one Arm per layout."""
    task = SEGMENT if args.task == "segment" else DETECT
    cfg = TrainConfig(
        hyp=load_hyp(QUICKSTART_HYP),
        data=args.data,
        model=args.cfg or ("yolov5n-seg" if args.task == "segment" else "yolov5n"),
        imgsz=args.imgsz,
        batch_size=args.batch_size,
        workers=0,
        task=args.task,
        channels_last=False,
    )
    ctx = dataclasses.replace(DistContext(), device=torch.device(args.device))
    data = load_data_config(cfg.data, ctx)
    torch.manual_seed(0)
    bundle = build_model_bundle(cfg, task, data, ctx, None)
    loader = build_datasets(cfg, task, data, bundle, ctx).train_loader
    loader.set_epoch(0)
    batches = [batch for batch, _ in zip(loader, range(4), strict=False)]
    amp = args.amp and ctx.device.type == "cuda"
    arms = {name: Arm(bundle.model, cfg, task, channels_last, amp) for name, channels_last in LAYOUTS.items()}
    return arms, batches, cfg


def main(argv: list[str] | None = None) -> None:
    """Time both layouts in turns and print the medians."""
    args = parse_args(argv)
    if args.amp and args.device == "cpu":
        print("--amp needs --device cuda; timing fp32")
    arms, batches, cfg = build_arms(args)
    for i in range(args.warmup + args.steps):
        for arm in arms.values():
            arm.step(batches[i % len(batches)], record=i >= args.warmup)
    for arm in arms.values():
        arm.model.eval().fuse()
        arm.model.to(memory_format=memory_format(arm is arms["nhwc"]))
    for i in range(args.warmup + args.steps):
        for arm in arms.values():
            arm.infer(batches[i % len(batches)], record=i >= args.warmup)
    print(
        f"{cfg.model} {args.task}, {args.imgsz} px, batch {args.batch_size}, {args.device}"
        f"{' amp' if arms['nhwc'].amp else ''}, {torch.get_num_threads()} threads; median ms over {args.steps} steps"
    )
    print(f"{'phase':<12}" + "".join(f"{name:>10}" for name in arms) + f"{'nchw/nhwc':>11}")
    for phase in (*PHASES, "step", "inference"):
        if phase == "step":
            medians = [
                statistics.median(map(sum, zip(*(arm.times[p] for p in PHASES), strict=True))) for arm in arms.values()
            ]
        else:
            medians = [statistics.median(arm.times[phase]) for arm in arms.values()]
        print(f"{phase:<12}" + "".join(f"{1000 * m:>10.1f}" for m in medians) + f"{medians[1] / medians[0]:>11.2f}")


if __name__ == "__main__":
    main()
