"""Turn a benchmarks/gpu_runner.py trace into training figures: first step, epoch time, images/s, data wait."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class EpochFigures:
    """One epoch's train phase: from its first train-batch request to its last backward (validation excluded)."""

    start: float  # time.time() of the phase's first train-batch request
    seconds: float
    images: int
    wait_seconds: float  # time spent inside the train loader's __next__ during the phase


@dataclass(frozen=True)
class RunFigures:
    """A training run's figures; None where the trace cannot tell (e.g. epoch + val with fewer than 3 epochs)."""

    first_step_s: float | None  # launch to the end of the first optimizer step
    epoch_s: float | None  # median train phase of the epochs after the first
    epoch_with_val_s: float | None  # median start-to-start of the epochs after the first (validation included)
    images_per_s: float | None  # over the epochs after the first
    wait_share: float | None  # data wait / train phase, over the epochs after the first
    first_epoch_s: float | None
    epochs: int
    peak_gpu_gib: float


def train_epochs(trace: dict[str, Any]) -> list[EpochFigures]:
    """Split a trace's batches and backward calls into epochs' train phases.

    The train loader is the one whose batch was taken last before the first backward; a batch of any
    other loader (validation) ends the phase. A phase without a backward (a batch taken ahead, then
    validation) is not an epoch. Images count the first as many train batches as the phase has
    backward calls, so a batch prefetched for the next epoch is not counted twice.
    """
    backward = sorted(trace.get("backward", []))
    batches = sorted(trace.get("batches", []))
    if not backward:
        return []
    before = [batch for batch in batches if batch[1] <= backward[0]]
    if not before:
        return []
    train_id = before[-1][2]
    events = sorted([(t, "backward", None) for t in backward] + [(b[0], "batch", b) for b in batches])
    epochs: list[EpochFigures] = []
    phase: dict[str, list[Any]] = {"batches": [], "backward": []}
    for time_at, kind, batch in events:
        if kind == "batch" and batch[2] != train_id:
            _close(phase, epochs)
            phase = {"batches": [], "backward": []}
        elif kind == "batch":
            phase["batches"].append(batch)
        else:
            phase["backward"].append(time_at)
    _close(phase, epochs)
    return epochs


def _close(phase: dict[str, list[Any]], epochs: list[EpochFigures]) -> None:
    """Append `phase` to `epochs` when it trained (has backward calls)."""
    if not phase["backward"]:
        return
    end = phase["backward"][-1]
    start = phase["batches"][0][0] if phase["batches"] else phase["backward"][0]
    images = sum(batch[3] for batch in phase["batches"][: len(phase["backward"])])
    wait = sum(min(batch[1], end) - batch[0] for batch in phase["batches"] if batch[0] < end)
    epochs.append(EpochFigures(start, end - start, images, wait))


def run_figures(trace: dict[str, Any], launched: float) -> RunFigures:
    """The figures of one run whose process was started at `launched` (time.time())."""
    epochs = train_epochs(trace)
    first_step = trace.get("first_step")
    later = epochs[1:]
    seconds = sum(epoch.seconds for epoch in later)
    starts = [epoch.start for epoch in epochs]
    with_val = [b - a for a, b in zip(starts[1:], starts[2:], strict=False)]
    return RunFigures(
        first_step_s=first_step - launched if first_step is not None else None,
        epoch_s=statistics.median(epoch.seconds for epoch in later) if later else None,
        epoch_with_val_s=statistics.median(with_val) if with_val else None,
        images_per_s=sum(epoch.images for epoch in later) / seconds if seconds > 0 else None,
        wait_share=sum(epoch.wait_seconds for epoch in later) / seconds if seconds > 0 else None,
        first_epoch_s=epochs[0].seconds if epochs else None,
        epochs=len(epochs),
        peak_gpu_gib=float(trace.get("peak_gpu_gib", 0.0)),
    )
