"""Run one trainer under benchmarks/gpu.py's clock: a script of any checkout, or Ultralytics' own trainer.

Usage (benchmarks/gpu.py runs it; the working directory is the checkout whose script runs):

    python /path/to/gpu_runner.py --trace trace.json -- train.py --data d.yaml --epochs 3
    python /path/to/gpu_runner.py --trace trace.json --ultralytics model=yolov8n.yaml data=u.yaml epochs=3

It imports nothing of this repository, so the same file times an older checkout that lacks it.
Before the trainer starts it wraps three of torch's own entry points, the same for every trainer:
`Tensor.backward` (one event per training batch), the DataLoader iterator's `__next__` (start, end,
dataset and number of images of every batch taken, train and val alike) and a global optimizer
step hook (the time of the first step, after a device synchronisation so the step has run). At exit,
error or not, it writes those events, the peak CUDA memory and the exit status to `--trace` as JSON;
benchmarks/gpu.py turns them into epoch times, images/s and the data-wait share.

`--profile START:COUNT` also profiles the training batches after backward number START: COUNT
batches under torch.profiler (per batch: wall, device busy, kernels, host waits; the top operators),
then the next COUNT under cProfile (the Python functions); the summary goes to `<trace>.profile.txt`.
`--profile-startup` runs cProfile from the trainer's start to its first optimizer step (imports,
set-up, data, the first step) into `<trace>.startup.txt`.

The environment variable GPU_RUNNER_CUDNN sets cuDNN's autotuning whatever the trainer asks for:
`off` keeps `torch.backends.cudnn.benchmark` False (each convolution takes cuDNN's heuristic choice,
no timing in the first step, as Ultralytics trains), `limit:N` leaves it as the trainer sets it and
times at most N algorithms per convolution (`torch.backends.cudnn.benchmark_limit`, default 10).
gpu.py sets it per run with `--train-variant='GPU_RUNNER_CUDNN=off'`.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import runpy
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.data import dataloader

EVENTS: dict[str, Any] = {"backward": [], "batches": [], "first_step": None}


def _count_images(data: Any) -> int:
    """Images in a loaded batch: the first dimension of its first 4-D tensor (dict, list or object fields)."""
    values: Any = data
    if isinstance(data, dict):
        values = data.values()
    elif hasattr(data, "__dict__") and not isinstance(data, torch.Tensor):
        values = vars(data).values()
    if isinstance(values, torch.Tensor):
        return int(values.shape[0]) if values.dim() == 4 else 0
    try:
        for value in values:
            if isinstance(value, torch.Tensor) and value.dim() == 4:
                return int(value.shape[0])
    except TypeError:
        return 0
    return 0


class WindowProfiler:
    """Profile the batches between backward calls: torch.profiler for `count`, then cProfile for `count` more."""

    def __init__(self, start: int, count: int, out: Path) -> None:
        self.start, self.count, self.out = start, count, out
        self.torch_profile: Any = None
        self.python_profile: cProfile.Profile | None = None
        self.opened = 0.0
        self.sections: list[str] = []

    def after_backward(self, number: int) -> None:
        """Called after backward call `number` (1-based): opens and closes the windows."""
        if number == self.start:
            self._sync()
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.torch_profile = torch.profiler.profile(activities=activities)
            self.torch_profile.__enter__()
            self.opened = time.perf_counter()
        elif number == self.start + self.count and self.torch_profile is not None:
            self._sync()
            wall = time.perf_counter() - self.opened
            self.torch_profile.__exit__(None, None, None)
            self.sections.append(self._torch_summary(self.torch_profile, wall))
            self.torch_profile = None
            self.python_profile = cProfile.Profile()
            self.opened = time.perf_counter()
            self.python_profile.enable()
        elif number == self.start + 2 * self.count and self.python_profile is not None:
            self.python_profile.disable()
            self._sync()
            wall = time.perf_counter() - self.opened
            self.sections.append(f"== cProfile, {self.count} batches, {1000 * wall / self.count:.1f} ms per batch\n")
            self.sections.append(_cprofile_text(self.python_profile, cumulative=45))
            self.python_profile = None
            self.write()

    def write(self) -> None:
        if self.sections:
            self.out.write_text("\n".join(self.sections))

    @staticmethod
    def _sync() -> None:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()

    def _torch_summary(self, profile: Any, wall: float) -> str:
        """Per batch: wall ms, device-busy ms (kernels and copies), kernel launches, host waits; top operators."""
        spans, waits, wait_us, ops = [], 0, 0.0, 0
        for event in profile.events():
            if event.device_type != torch.autograd.DeviceType.CPU:
                spans.append((event.time_range.start, event.time_range.end))
                continue
            if event.name in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize"):
                waits += 1
                wait_us += event.cpu_time_total
            elif event.name.startswith("aten::") and event.cpu_parent is None:
                ops += 1
        device_us, reached = 0.0, float("-inf")  # the union of the device's busy intervals (streams overlap)
        for begin, end in sorted(spans):
            device_us += max(0.0, end - max(begin, reached))
            reached = max(reached, end)
        kernels, n = len(spans), self.count
        head = (
            f"== torch.profiler, {n} batches: per batch {1000 * wall / n:.1f} ms wall, "
            f"{device_us / 1000 / n:.1f} ms device busy (kernels and copies), {kernels / n:.0f} device launches, "
            f"{ops / n:.0f} top-level aten ops, {waits / n:.1f} host waits taking {wait_us / 1000 / n:.1f} ms\n"
        )
        averages = profile.key_averages()
        by_cpu = averages.table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=60)
        by_device = averages.table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=60)
        return head + "\n-- by self CPU time\n" + by_cpu + "\n-- by self device time\n" + by_device


PROFILER: WindowProfiler | None = None
STARTUP: dict[str, Any] = {}  # --profile-startup: "profile" (cProfile.Profile), "out" (Path), "start" (perf_counter)


def _end_startup_profile() -> None:
    """Stop the start-up profile at the first optimizer step and write its summary (once)."""
    profile = STARTUP.pop("profile", None)
    if profile is None:
        return
    profile.disable()
    seconds = time.perf_counter() - STARTUP["start"]
    head = f"== cProfile, trainer start to its first optimizer step: {seconds:.2f} s\n"
    STARTUP["out"].write_text(head + _cprofile_text(profile, cumulative=60))


def _cprofile_text(profile: cProfile.Profile, cumulative: int) -> str:
    """The `cumulative` functions with the most time inside them, then the 30 with the most time of their own."""
    text = io.StringIO()
    stats = pstats.Stats(profile, stream=text)
    stats.sort_stats("cumulative").print_stats(cumulative)
    stats.sort_stats("tottime").print_stats(30)
    return text.getvalue()


def install_hooks() -> None:
    """Wrap backward, the DataLoader iterator and the optimizer step so they record into EVENTS."""
    original_backward = torch.Tensor.backward

    def backward(self: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        original_backward(self, *args, **kwargs)
        EVENTS["backward"].append(time.time())
        if PROFILER is not None:
            PROFILER.after_backward(len(EVENTS["backward"]))

    torch.Tensor.backward = backward  # type: ignore[method-assign]
    original_next = dataloader._BaseDataLoaderIter.__next__

    def next_batch(self: Any) -> Any:
        start = time.time()
        data = original_next(self)
        EVENTS["batches"].append([start, time.time(), id(self._dataset), _count_images(data)])
        return data

    dataloader._BaseDataLoaderIter.__next__ = next_batch  # type: ignore[method-assign]

    def first_step(optimizer: Any, args: Any, kwargs: Any) -> None:
        if EVENTS["first_step"] is None:
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.synchronize()  # once: the step has run, not only been queued
            EVENTS["first_step"] = time.time()
            _end_startup_profile()

    register_optimizer_step_post_hook(first_step)


def apply_cudnn_setting(setting: str) -> None:
    """GPU_RUNNER_CUDNN: `off` pins cudnn.benchmark False (a trainer's True is ignored); `limit:N` caps its search."""
    if not setting:
        return
    cudnn = torch.backends.cudnn
    if setting == "off":
        # torch's own property class on its module's class: private, but the only way to outvote every later
        # `cudnn.benchmark = True` in code we do not edit (a benchmark's concern, never the product's).
        getter = torch._C._get_cudnn_benchmark
        type(cudnn).benchmark = torch.backends.ContextProp(getter, lambda value: torch._C._set_cudnn_benchmark(False))
        cudnn.benchmark = False
    elif setting.startswith("limit:") and setting[6:].isdigit():
        cudnn.benchmark_limit = int(setting[6:])  # None where cuDNN is not available: CPU runs ignore it
    else:
        raise SystemExit(f"GPU_RUNNER_CUDNN={setting!r}: expected off or limit:N")


def write_trace(path: Path, status: int, error: str) -> None:
    """Write EVENTS, the peak CUDA memory (GiB) and the exit status to `path` (atomically)."""
    if PROFILER is not None:
        PROFILER.write()
    _end_startup_profile()  # a run that never stepped: its whole life
    peak = 0.0
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        peak = torch.cuda.max_memory_allocated() / 2**30
    trace = {**EVENTS, "peak_gpu_gib": peak, "status": status, "error": error, "end": time.time()}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(trace))
    os.replace(tmp, path)


def _literal(text: str) -> Any:
    """An Ultralytics key=value value: int, float, bool or None when it reads as one, else the string."""
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered == "none":
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def run_ultralytics(pairs: list[str]) -> None:
    """Train with Ultralytics' own trainer, offline: no AMP check download, no font download, no hub events."""
    os.environ.setdefault("YOLO_OFFLINE", "1")
    from ultralytics import YOLO
    from ultralytics.data import utils as data_utils
    from ultralytics.engine import trainer
    from ultralytics.utils import SETTINGS

    # No analytics and no logger integrations (an installed MLflow would get a database in the working folder).
    for key in ("sync", "hub", "mlflow", "tensorboard", "wandb", "comet", "clearml", "dvc", "neptune", "raytune"):
        if key in SETTINGS:
            SETTINGS[key] = False
    # The AMP check downloads yolo11n.pt and fonts are downloaded for plots: both need the network.
    trainer.check_amp = lambda *args, **kwargs: True
    data_utils.check_font = lambda *args, **kwargs: None
    # results.csv is read with polars, a 55 MB wheel: a plain csv reader gives the trainer the same dict.
    trainer.BaseTrainer.read_results_csv = _read_results_csv
    kwargs = dict(pair.split("=", 1) for pair in pairs)
    model = kwargs.pop("model")
    YOLO(model).train(**{key: _literal(value) for key, value in kwargs.items()})


def _read_results_csv(self: Any) -> dict[str, list[Any]]:
    import csv

    try:
        with open(self.csv, newline="") as handle:
            rows = list(csv.DictReader(handle))
    except OSError:
        return {}
    columns = {key.strip(): [] for key in (rows[0] if rows else {})}
    for row in rows:
        for key, value in row.items():
            columns[key.strip()].append(_literal(value.strip()))
    return columns


def main() -> None:
    """Parse the runner's flags, install the hooks, run the trainer, write the trace whatever happens."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, required=True, help="JSON file the events are written to")
    parser.add_argument("--ultralytics", nargs="+", metavar="KEY=VALUE", help="train with Ultralytics' trainer")
    parser.add_argument("--profile", metavar="START:COUNT", help="profile COUNT batches after backward START")
    parser.add_argument("--profile-startup", action="store_true", help="cProfile up to the first optimizer step")
    parser.add_argument("script", nargs="*", help="after --: the script of the checkout (cwd) and its flags")
    args = parser.parse_args()
    if args.profile:
        global PROFILER
        start, count = (int(part) for part in args.profile.split(":"))
        PROFILER = WindowProfiler(start, count, args.trace.with_suffix(".profile.txt"))
    install_hooks()
    apply_cudnn_setting(os.environ.get("GPU_RUNNER_CUDNN", ""))
    if args.profile_startup:
        STARTUP.update(profile=cProfile.Profile(), out=args.trace.with_suffix(".startup.txt"))
        STARTUP["start"] = time.perf_counter()
        STARTUP["profile"].enable()
    status, error = 0, ""
    try:
        if args.ultralytics:
            run_ultralytics(args.ultralytics)
        else:
            sys.path[0] = os.getcwd()  # the checkout's packages, as `python train.py` there sees them; not ours
            sys.argv = list(args.script)
            runpy.run_path(args.script[0], run_name="__main__")
    except SystemExit as stop:
        status = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException as raised:  # recorded in the trace, then re-raised for the log
        status, error = 1, f"{type(raised).__name__}: {raised}"
        write_trace(args.trace, status, error)
        raise
    write_trace(args.trace, status, error)
    sys.exit(status)


if __name__ == "__main__":
    main()
