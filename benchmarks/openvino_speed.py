"""Benchmark OpenVINO model folders side by side: median inference time at the IR's own input shape.

Usage (from the repository root; needs `pip install openvino`):

    python benchmarks/openvino_speed.py runs/train/exp/weights/best_openvino_model \
        runs/train/exp/weights/best_int8_openvino_model
    python benchmarks/openvino_speed.py A B --threads 2 --rounds 5 --runs 200

Any OpenVINO IR folder works (ours, or another tool's export of the same weights): each is compiled
for the CPU plugin with the settings our backend uses (FP32 precision hint, `--threads` inference
threads), so only the graphs differ. Every folder gets the same random input in [0, 1] at its static
input shape, `--warmup` untimed calls, then `--rounds` rounds in which the folders take turns running
`--runs` timed synchronous calls each; interleaving spreads any drift of the machine (another job,
clock changes) over all of them. Prints per folder the median and the 10th-90th percentile of the
per-call milliseconds over all rounds, each round's median, and images/s at the median. Time on an
idle machine: a busy core moves these figures by more than the differences they are meant to show.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the benchmark's flags."""
    parser = argparse.ArgumentParser(description="Median OpenVINO CPU inference time of IR folders, interleaved")
    parser.add_argument("folders", nargs="+", type=Path, help="OpenVINO model folders (each holding one .xml)")
    parser.add_argument("--threads", type=int, default=2, help="OpenVINO inference threads")
    parser.add_argument("--warmup", type=int, default=30, help="untimed calls per folder first")
    parser.add_argument("--rounds", type=int, default=3, help="rounds; each folder runs --runs calls per round")
    parser.add_argument("--runs", type=int, default=100, help="timed calls per folder per round")
    return parser.parse_args(argv)


def model_file(folder: Path) -> Path:
    """The folder's single .xml; a missing or ambiguous one is a one-line error naming the folder."""
    files = sorted(folder.glob("*.xml"))
    if len(files) != 1:
        raise SystemExit(f"error: {folder} holds {len(files)} .xml files; give an OpenVINO model folder")
    return files[0]


def percentile(values: list[float], share: float) -> float:
    """The value below which `share` of `values` lie (nearest rank)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


def main(argv: list[str] | None = None) -> int:
    """Compile every folder, time them interleaved and print one line per folder."""
    args = parse_args(argv)
    try:
        import openvino as ov
    except ImportError:
        print("error: this benchmark needs OpenVINO: pip install openvino", file=sys.stderr)
        return 1
    core = ov.Core()
    config = {"INFERENCE_PRECISION_HINT": "f32", "INFERENCE_NUM_THREADS": args.threads}
    requests, inputs = {}, {}
    rng = np.random.default_rng(0)
    for folder in args.folders:
        model = core.read_model(str(model_file(folder)))
        shape = model.inputs[0].partial_shape
        if shape.is_dynamic:
            raise SystemExit(f"error: {folder} has a dynamic input {shape}; export it with a static size")
        inputs[folder] = rng.random(tuple(shape.to_shape()), dtype=np.float32)
        requests[folder] = core.compile_model(model, "CPU", config).create_infer_request()
        for _ in range(args.warmup):
            requests[folder].infer({0: inputs[folder]})
    times: dict[Path, list[list[float]]] = {folder: [] for folder in args.folders}
    for _ in range(args.rounds):
        for folder, request in requests.items():
            calls = []
            for _ in range(args.runs):
                start = time.perf_counter()
                request.infer({0: inputs[folder]})
                calls.append((time.perf_counter() - start) * 1e3)
            times[folder].append(calls)
    print(
        f"OpenVINO {ov.__version__}, CPU plugin, FP32 hint, {args.threads} threads, {args.rounds} rounds x {args.runs}"
    )
    for folder, rounds in times.items():
        calls = [value for round_calls in rounds for value in round_calls]
        median = statistics.median(calls)
        batch = inputs[folder].shape[0]
        per_round = " ".join(f"{statistics.median(round_calls):.3f}" for round_calls in rounds)
        print(
            f"{median:.3f} ms (p10 {percentile(calls, 0.1):.3f}, p90 {percentile(calls, 0.9):.3f}; "
            f"rounds {per_round}) {batch * 1e3 / median:.0f} images/s  {folder}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
