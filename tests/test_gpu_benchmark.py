"""benchmarks/gpu.py: its trace arithmetic on hand-made events, and its --quick CPU run end to end."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from benchmarks import gpu, gpu_runner, gpu_train
from benchmarks.gpu_bench import Bench, Checkout, Report
from benchmarks.gpu_trace import run_figures, train_epochs
from utils.config import ROOT

TRAIN, VAL = 1, 2  # dataset ids in a trace


def _trace() -> dict:
    """Two epochs of 3 batches of 4 images: each batch waits 0.1 s, each step takes 1 s, validation between.

    The second epoch's loader hands out one batch ahead (taken before its last backward), as a prefetcher does.
    """
    batches, backward = [], []
    for epoch_start in (100.0, 110.0):
        for i in range(3):
            start = epoch_start + 1.1 * i
            batches.append([start, start + 0.1, TRAIN, 4])
            backward.append(start + 1.1)
        batches.append([epoch_start + 5.0, epoch_start + 5.5, VAL, 8])  # validation
    batches.insert(-1, [112.5, 112.7, TRAIN, 4])  # prefetched during the second epoch's last step
    return {"backward": backward, "batches": batches, "first_step": 101.5, "peak_gpu_gib": 1.25}


def test_epochs_are_the_train_phases_between_validations() -> None:
    epochs = train_epochs(_trace())
    assert len(epochs) == 2
    assert epochs[0].start == 100.0 and epochs[0].seconds == pytest.approx(3.3)
    assert epochs[0].images == 12 and epochs[0].wait_seconds == pytest.approx(0.3)
    assert epochs[1].images == 12  # the batch taken ahead is not counted twice
    assert epochs[1].wait_seconds == pytest.approx(0.5)  # but its wait is: the step waited for it


def test_run_figures_use_the_epochs_after_the_first() -> None:
    figures = run_figures(_trace(), launched=90.0)
    assert figures.first_step_s == pytest.approx(11.5) and figures.epochs == 2
    assert figures.epoch_s == pytest.approx(3.3) and figures.images_per_s == pytest.approx(12 / 3.3)
    assert figures.wait_share == pytest.approx(0.5 / 3.3) and figures.peak_gpu_gib == 1.25
    assert figures.epoch_with_val_s is None  # needs a third epoch


def test_a_trace_without_training_gives_no_epochs() -> None:
    assert train_epochs({"backward": [], "batches": [[0.0, 1.0, VAL, 8]]}) == []
    assert run_figures({"backward": [], "batches": []}, launched=0.0).epoch_s is None


def test_step_tables_give_the_first_column_and_each_variant_per_precision() -> None:
    text = (
        "yolov8s detect, 640 px, batch 32, cuda, dtype fp16, 16 threads; median ms over 10 steps\n"
        "phase                 nhwc  nhwc+compile   nhwc+static\n"
        "loss                   2.5           2.4           2.0\n"
        "step                  24.0          20.0          23.0\n"
        "pipelined             22.0          19.0          18.5\n"
        "inference              4.0           4.1           4.0\n"
        "loss-ops           221+127             -       231+127\n"
        "yolov8s detect, 640 px, batch 32, cuda, dtype bf16, 16 threads; median ms over 10 steps\n"
        "phase             nhwc      nchw  nchw/nhwc\n"  # an older script's two layouts: only the first is read
        "step               30.0      33.0       1.10\n"
    )
    assert gpu.parse_step_output(text) == {
        "fp16": {"loss": 2.5, "step": 24.0, "pipelined": 22.0, "inference": 4.0, "loss-ops": "221+127"},
        "fp16+compile": {"loss": 2.4, "step": 20.0, "pipelined": 19.0, "inference": 4.1, "loss-ops": "-"},
        "fp16+static": {"loss": 2.0, "step": 23.0, "pipelined": 18.5, "inference": 4.0, "loss-ops": "231+127"},
        "bf16": {"step": 30.0},
    }


def test_rounds_repeat_every_trainer_in_alternating_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    flags = ["--device", "cpu", "--sizes", "300", "--epochs", "2", "--rounds", "3", "--train-variant=--cuda-graph"]
    args = gpu.parse_args(["--out", str(tmp_path), *flags])
    with pytest.raises(SystemExit):  # no round: nothing would train, silently
        gpu.parse_args(["--out", str(tmp_path), "--rounds", "0"])
    checkouts = [Checkout(".", tmp_path / "a"), Checkout("old", tmp_path / "b")]
    bench = Bench(args, checkouts, Report(tmp_path), tmp_path, time.time())
    runs: list[tuple[str, int]] = []

    def ours(bench: Bench, checkout: Checkout, size: int, epochs: int, variant: str = "", run: int = 0) -> None:
        runs.append((f"{checkout.label} {variant}".strip(), run))

    monkeypatch.setattr(gpu_train, "train_ours", ours)
    monkeypatch.setattr(gpu_train, "train_ultralytics", lambda bench, size, epochs, run=0: runs.append(("ul", run)))
    monkeypatch.setattr(gpu_train, "ultralytics_available", lambda: True)
    gpu_train.train_part(bench, [300])
    order = [".", "old", ". --cuda-graph", "ul"]
    expected = [(name, 0) for name in order] + [(name, 1) for name in order[::-1]] + [(name, 2) for name in order]
    assert runs == expected


def test_a_variant_sets_the_runners_environment_and_off_pins_cudnn_autotuning(monkeypatch: pytest.MonkeyPatch) -> None:
    assert gpu_train.split_variant("GPU_RUNNER_CUDNN=off A_B=1 --cuda-graph X=1") == (
        {"GPU_RUNNER_CUDNN": "off", "A_B": "1"},
        ["--cuda-graph", "X=1"],  # after the first flag every word is train.py's
    )
    cudnn = torch.backends.cudnn
    monkeypatch.setattr(type(cudnn), "benchmark", type(cudnn).benchmark)  # put back after the test
    previous = cudnn.benchmark
    try:
        gpu_runner.apply_cudnn_setting("off")
        cudnn.benchmark = True  # what train.py does on CUDA
        assert cudnn.benchmark is False
    finally:
        torch._C._set_cudnn_benchmark(previous)
    with pytest.raises(SystemExit, match="expected off or limit:N"):
        gpu_runner.apply_cudnn_setting("fast")


def test_a_variant_trains_with_its_flags_and_runner_environment_in_a_row_of_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What a --train-variant changes in the trainer's command; the quick run below trains the plain one for real.
    variant = "GPU_RUNNER_CUDNN=off --static-loss-shapes"
    args = gpu.parse_args(["--quick", "--out", str(tmp_path / "out"), f"--train-variant={variant}"])
    (tmp_path / "out" / "logs").mkdir(parents=True)
    bench = Bench(args, [Checkout(".", ROOT)], Report(tmp_path / "out"), tmp_path / "work", time.time())
    bench.datasets[16] = tmp_path / "data" / "shapes"
    (tmp_path / "data" / "shapes").mkdir(parents=True)
    launched: list[tuple[list[str], dict[str, str]]] = []

    def run_logged(command: list[str], cwd: Path, log: Path, bench: Bench, extra_env: dict | None = None):
        launched.append((command, extra_env or {}))
        return 0, 1.0

    monkeypatch.setattr(gpu_train, "run_logged", run_logged)
    gpu_train.train_ours(bench, bench.checkouts[0], 16, 2)
    gpu_train.train_ours(bench, bench.checkouts[0], 16, 2, variant)
    (plain, plain_env), (varied, varied_env) = launched
    assert plain_env == {} and varied_env == {"GPU_RUNNER_CUDNN": "off"}
    # The same command with the variant's flags after train.py's, in a run folder (and trace) of its own.
    name = plain[plain.index("--name") + 1]  # n16-c0-<the checkout's folder>
    assert " ".join(varied) == " ".join(plain).replace(name, f"{name}-v0") + " --static-loss-shapes"
    assert "--static-loss-shapes" not in plain and f"{name}-v0" not in " ".join(plain)
    rows = bench.report.markdown().splitlines()
    assert any(f"| ours | . {variant} |" in row for row in rows), rows


@pytest.mark.slow  # train.py, val.py and train_step.py end to end
@pytest.mark.distributed  # in subprocesses
def test_quick_cpu_run_fills_every_table(tmp_path: Path) -> None:
    out = tmp_path / "out"
    gpu.main(
        ["--quick", "--out", str(out), "--data-root", str(tmp_path / "work"), "--no-ultralytics",
         "--profile-steps", "1:1", "--profile-startup"]
    )  # fmt: skip
    tables = (out / "gpu.md").read_text()
    assert "## training" in tables and "## val.py" in tables and "## train step" in tables
    rows = [line for line in tables.splitlines() if line.startswith("| ") and "---" not in line]
    training = next(line for line in rows if "| ours |" in line).split(" | ")
    assert training[-1].startswith("ok, 2 epochs") and float(training[4]) > 0  # epoch s
    # The training run profiled: torch.profiler's batch, then cProfile's; and its start-up.
    (profile,) = (out / "logs").glob("train-*.profile.txt")
    text = profile.read_text()
    assert text.startswith("== torch.profiler, 1 batches: per batch ") and "top-level aten ops" in text
    assert "== cProfile, 1 batches" in text and "train_one_epoch" in text
    (startup,) = (out / "logs").glob("train-*.startup.txt")
    text = startup.read_text()
    assert text.startswith("== cProfile, trainer start to its first optimizer step: ") and "_start_run" in text
    assert all(" ok |" in line or "ok, " in line for line in rows if line.count("|") > 8 and "status" not in line)
    assert (tmp_path / "out" / "gpu.csv").is_file() and (tmp_path / "out" / "gpu.log").read_text()
