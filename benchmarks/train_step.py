"""Benchmark one training step (forward, loss, backward, optimizer) and eval inference, per memory layout.

Usage (from the repository root):

    python benchmarks/train_step.py                          # yolov5n-seg, 224 px, batch 16 (the quick start's size)
    python benchmarks/train_step.py --task detect --cfg yolov5s --imgsz 640 --batch-size 8
    python benchmarks/train_step.py --device cuda --amp      # on a GPU: fp16 autocast as training uses it
    python benchmarks/train_step.py --device cuda --task detect --cfg yolov8s --imgsz 640 --batch-size 32 \
        --dtypes fp32 fp16 bf16 --layouts nhwc              # one table per precision (benchmarks/gpu.py)
    python benchmarks/train_step.py --device cuda --task detect --cfg yolov8s --layouts nhwc --compile default
    python benchmarks/train_step.py --device cuda --task detect --cfg yolov8s --layouts nhwc --static-loss
    python benchmarks/train_step.py --device cuda --task detect --cfg yolov8n --layouts nhwc --cuda-graph

Builds the quick start's model and loss (`--task`, `--cfg`; the hyp is the model family's short-run
recipe file, so anchor-free models get their `dfl` gain) and a few real augmented batches of the
training loader (built-in dataset unless `--data`), then times `--steps` steps per layout:
NHWC (`channels_last`, the default in training) and NCHW. The layouts take turns step by step
on identical starting weights, so a machine whose speed drifts affects both alike. Then times
eval inference of the fused model, again in turns. Prints, per precision of `--dtypes` (fp32;
fp16 autocast with the GradScaler; bf16 autocast without it), the median milliseconds of each
phase per layout and, with two columns, the second's time over the first's. Each phase is timed
alone (the device is synchronised around it); the `pipelined` row is the step as training runs it,
`--steps` steps back to back with no synchronisation until the last, so host reads inside the step
(which stall the queue) show there. The `loss-ops` row counts the operators one loss call
dispatches, forward+backward (views left out; the backward stops at the model's outputs): on a GPU
each is at least one kernel launch, which is what a host-bound step pays for its loss.
`--compile MODE` adds a column per layout (`nhwc+compile`) whose training forward runs under
torch.compile(MODE), as `train.py --compile` does; its warm-up steps compile (minutes), its
inference is the eager fused model. `--static-loss` adds one (`nhwc+static`) whose loss assigns
targets in fixed shapes, as `train.py --static-loss-shapes` does; with both, a `nhwc+compile+static`
column compiles the forward and the loss, as training does with both flags. `--cuda-graph` adds one
(`nhwc+graph`) whose forward and backward replay CUDA graphs, as `train.py --cuda-graph` runs them
(captured in its first warm-up step).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as `python benchmarks/train_step.py`
    sys.path.insert(0, str(ROOT))

from models.model_info import memory_format  # noqa: E402  (needs the sys.path line above)
from segment.training import SEGMENT_TRAINING  # noqa: E402
from utils.config import DEFAULT_DATA, QUICKSTART_BATCH, QUICKSTART_HYP, QUICKSTART_IMGSZ  # noqa: E402
from utils.data.batch import images_on_device  # noqa: E402
from utils.data.data_config import load_data_config  # noqa: E402
from utils.distributed import DistContext  # noqa: E402
from utils.hyp import load_hyp  # noqa: E402
from utils.train.config import COMPILE_MODES, TrainConfig  # noqa: E402
from utils.train.cuda_graph import graphed_forward  # noqa: E402
from utils.train.plan import RunPlan, plan_model  # noqa: E402
from utils.train.records import DETECT_TRAINING, TrainingTask, family_training  # noqa: E402
from utils.train.setup import build_datasets, build_model_bundle  # noqa: E402
from utils.train.state import compiled_loss  # noqa: E402

LAYOUTS = {"nhwc": True, "nchw": False}
PHASES = ("forward", "loss", "backward", "optimizer")
ROWS = (*PHASES, "step", "pipelined", "inference")
DTYPES = {"fp32": None, "fp16": torch.float16, "bf16": torch.bfloat16}


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
    parser.add_argument("--amp", action="store_true", help="fp16 autocast and GradScaler (CUDA only): --dtypes fp16")
    parser.add_argument("--dtypes", nargs="+", choices=tuple(DTYPES), help="precisions to time, one table each")
    parser.add_argument("--layouts", nargs="+", choices=tuple(LAYOUTS), default=list(LAYOUTS), help="memory layouts")
    parser.add_argument(
        "--compile", default="", choices=COMPILE_MODES, metavar="MODE", help="also time each layout compiled"
    )
    parser.add_argument(
        "--static-loss", action="store_true", help="also time each layout with the loss's fixed-shape assignment"
    )
    parser.add_argument(
        "--cuda-graph", action="store_true", help="also time each layout with forward and backward as CUDA graphs"
    )
    args = parser.parse_args(argv)
    if args.dtypes is None:
        args.dtypes = ["fp16" if args.amp else "fp32"]
    if args.compile and args.static_loss:  # the compiled loss compiles again at its second label count
        args.warmup = max(args.warmup, 3)
    return args


class Arm:
    """One layout's model, loss and optimizer, started from the shared weights."""

    def __init__(
        self,
        model: torch.nn.Module,
        cfg: TrainConfig,
        training: TrainingTask,
        channels_last: bool,
        amp_dtype: torch.dtype | None,
        compile_mode: str = "",
        static_loss: bool = False,
        cuda_graph: bool = False,
    ) -> None:
        self.model = copy.deepcopy(model).to(memory_format=memory_format(channels_last))
        # The training forward, as train.py --compile / --cuda-graph run it; the optimizer and EMA see the bare model.
        self.forward = torch.compile(self.model, mode=compile_mode) if compile_mode else self.model
        self.forward = graphed_forward(self.forward, cuda_graph, amp_dtype)
        self.keep_grads = cuda_graph  # as TrainState.keep_grads: graph replays need gradient tensors of their own
        self.channels_last = channels_last
        arm_cfg = dataclasses.replace(cfg, compile_mode=compile_mode, static_loss_shapes=static_loss)
        self.loss_fn = training.build_loss(self.model, arm_cfg)
        self.loss_call = compiled_loss(self.loss_fn, arm_cfg)  # compiled too with --compile and --static-loss
        self.loss_inputs = training.task.loss_inputs  # targets (and masks) on the device, as training moves them
        # Multi-tensor like training's fused optimizers, so zero_grad(set_to_none=False) zeroes in one op too.
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=1e-4, momentum=0.9, foreach=True)
        self.device = next(self.model.parameters()).device
        self.amp_dtype = amp_dtype
        # As training: bf16 has fp32's exponent range and needs no loss scaling.
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=amp_dtype == torch.float16)
        self.times: dict[str, list[float]] = {phase: [] for phase in (*PHASES, "pipelined", "inference")}
        self.loss_ops = ""  # "forward+backward" operator counts of one loss call (count_loss_ops)

    def _clock(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def step(self, batch: dict, record: bool) -> None:
        """One training step on `batch`, the device synchronised around each phase; times kept when `record`."""
        marks = self._train(self._on_device(batch), self._clock)
        if record:
            for phase, start, end in zip(PHASES, marks[:-1], marks[1:], strict=True):
                self.times[phase].append(end - start)

    def pipelined(self, batches: list[dict], steps: int) -> None:
        """Record the time per step of `steps` steps run back to back, synchronised only before and after."""
        inputs = [self._on_device(batches[i % len(batches)]) for i in range(steps)]
        start = self._clock()
        for batch in inputs:
            self._train(batch, lambda: 0.0)
        self.times["pipelined"].append((self._clock() - start) / steps)

    def _on_device(self, batch: dict) -> dict[str, torch.Tensor]:
        """The step's inputs on the device, as train_one_epoch builds them: images, then the task's loss inputs."""
        return {"images": images_on_device(batch, self.device), **self.loss_inputs(batch, self.device)}

    def _train(self, inputs: dict[str, torch.Tensor], clock: Callable[[], float]) -> list[float]:
        """Forward, loss, backward and optimizer step; returns `clock()` before and after each phase."""
        self.model.train()
        loss_inputs = {name: value for name, value in inputs.items() if name != "images"}
        marks = [clock()]
        with torch.autocast(self.device.type, dtype=self.amp_dtype, enabled=self.amp_dtype is not None):
            preds = self.forward(inputs["images"])
            marks.append(clock())
            loss, _ = self.loss_call(preds, reduce_counts=None, **loss_inputs)
            marks.append(clock())
        self.scaler.scale(loss).backward()
        marks.append(clock())
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=not self.keep_grads)
        marks.append(clock())
        return marks

    def count_loss_ops(self, batch: dict) -> None:
        """Count the operators one loss call and its backward dispatch (views left out), on the eager loss.

        On a GPU each is at least one kernel launch: what a host-bound step pays for the loss. The
        backward stops at the model's outputs (detached leaves), so only the loss's own share counts.
        """
        if self.loss_call is not self.loss_fn:  # a compiled loss runs other operators than it dispatches
            self.loss_ops = "-"
            return
        inputs = self._on_device(batch)
        loss_inputs = {name: value for name, value in inputs.items() if name != "images"}
        with torch.autocast(self.device.type, dtype=self.amp_dtype, enabled=self.amp_dtype is not None):
            with torch.no_grad():
                preds = self.model(inputs["images"])
            preds = tree_map(lambda t: t.detach().requires_grad_() if isinstance(t, torch.Tensor) else t, preds)
            with OperatorCount() as forward:
                loss, _ = self.loss_fn(preds, reduce_counts=None, **loss_inputs)
        with OperatorCount() as backward:
            loss.backward()
        self.loss_ops = f"{forward.count}+{backward.count}"

    @torch.no_grad()
    def infer(self, batch: dict, record: bool) -> None:
        """Eval-mode forward of the fused model on `batch`."""
        images = images_on_device(batch, self.device)
        start = self._clock()
        with torch.autocast(self.device.type, dtype=self.amp_dtype, enabled=self.amp_dtype is not None):
            self.model(images)
        if record:
            self.times["inference"].append(self._clock() - start)


def build_batches(args: argparse.Namespace) -> tuple[torch.nn.Module, list[dict], TrainConfig, TrainingTask]:
    """Build the shared model (seed 0) and a few real training batches; the hyp is the family's short recipe."""
    training = SEGMENT_TRAINING if args.task == "segment" else DETECT_TRAINING
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
    spec, _ = plan_model(cfg, training.task, tuple(data.names), resume=None)
    family = family_training(spec)
    # YOLOv5's quick-start hyp has no `dfl`: an anchor-free loss needs its own family's file.
    cfg = dataclasses.replace(cfg, hyp=load_hyp(family.recipe_files.short))
    bundle = build_model_bundle(RunPlan(cfg, data, tuple(data.names), spec, family), ctx)
    loader = build_datasets(cfg, training.task, data, bundle, ctx).train_loader
    loader.set_epoch(0)
    batches = [batch for batch, _ in zip(loader, range(4), strict=False)]
    return bundle.model, batches, cfg, training


class OperatorCount(TorchDispatchMode):
    """Counts the operators dispatched inside the block, views (which launch nothing) left out."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if not func.is_view:
            self.count += 1
        return func(*args, **(kwargs or {}))


def time_arms(arms: dict[str, Arm], batches: list[dict], args: argparse.Namespace) -> None:
    """Train, then fuse and infer, every arm in turns, recording after the warm-up steps."""
    for i in range(args.warmup + args.steps):
        for arm in arms.values():
            arm.step(batches[i % len(batches)], record=i >= args.warmup)
    for _ in range(3):  # three rounds in turns; the median is reported
        for arm in arms.values():
            arm.pipelined(batches, args.steps)
    for arm in arms.values():
        arm.count_loss_ops(batches[0])
        arm.model.eval().fuse()
        arm.model.to(memory_format=memory_format(arm.channels_last))
    for i in range(args.warmup + args.steps):
        for arm in arms.values():
            arm.infer(batches[i % len(batches)], record=i >= args.warmup)


def print_table(arms: dict[str, Arm], cfg: TrainConfig, args: argparse.Namespace, dtype: str) -> None:
    """Print one precision's medians per phase and column (and the second column over the first with two)."""
    print(
        f"{cfg.model} {args.task}, {args.imgsz} px, batch {args.batch_size}, {args.device}"
        f"{' amp' if dtype == 'fp16' else ''}, dtype {dtype}, {torch.get_num_threads()} threads; "
        f"median ms over {args.steps} steps"
    )
    both = len(arms) == 2
    ratio_name = "/".join(reversed(list(arms)))
    widths = [max(14, len(name) + 2) for name in arms]  # names never run together (gpu.py splits on spaces)
    header = "".join(f"{name:>{width}}" for name, width in zip(arms, widths, strict=True))
    print(f"{'phase':<12}" + header + (f"{ratio_name:>26}" if both else ""))
    for phase in ROWS:
        if phase == "step":
            medians = [
                statistics.median(map(sum, zip(*(arm.times[p] for p in PHASES), strict=True))) for arm in arms.values()
            ]
        else:
            medians = [statistics.median(arm.times[phase]) for arm in arms.values()]
        ratio = f"{medians[1] / medians[0]:>26.2f}" if both else ""
        cells = "".join(f"{1000 * m:>{width}.1f}" for m, width in zip(medians, widths, strict=True))
        print(f"{phase:<12}" + cells + ratio, flush=True)
    cells = "".join(f"{arm.loss_ops:>{width}}" for arm, width in zip(arms.values(), widths, strict=True))
    print(f"{'loss-ops':<12}" + cells, flush=True)


def main(argv: list[str] | None = None) -> None:
    """Time the layouts in turns, once per precision, and print the medians."""
    args = parse_args(argv)
    if args.device == "cpu" and set(args.dtypes) - {"fp32"}:
        print("fp16 / bf16 need --device cuda; timing fp32")
        args.dtypes = ["fp32"]
    if args.device == "cpu" and args.cuda_graph:
        print("--cuda-graph needs --device cuda; timing without it")
        args.cuda_graph = False
    model, batches, cfg, training = build_batches(args)
    for dtype in args.dtypes:
        arms = {}
        for name in args.layouts:
            arms[name] = Arm(model, cfg, training, LAYOUTS[name], DTYPES[dtype])
            if args.compile:
                arms[f"{name}+compile"] = Arm(model, cfg, training, LAYOUTS[name], DTYPES[dtype], args.compile)
            if args.static_loss:
                arms[f"{name}+static"] = Arm(model, cfg, training, LAYOUTS[name], DTYPES[dtype], static_loss=True)
            if args.cuda_graph:
                arms[f"{name}+graph"] = Arm(model, cfg, training, LAYOUTS[name], DTYPES[dtype], cuda_graph=True)
            if args.static_loss and args.compile:  # the forward and the (then one-graph) loss compiled
                arms[f"{name}+compile+static"] = Arm(
                    model, cfg, training, LAYOUTS[name], DTYPES[dtype], args.compile, static_loss=True
                )
        time_arms(arms, batches, args)
        print_table(arms, cfg, args, dtype)
        del arms
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
