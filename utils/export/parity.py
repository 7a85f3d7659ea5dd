"""Export's check of a written file against PyTorch: element-wise tolerances, and INT8's detection agreement."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from utils.backends.exported import Runner
from utils.backends.metadata import ExportMetadata
from utils.errors import ConfigError
from utils.export.quantization import MIN_AGREEMENT, Agreement, detection_agreement

LOGGER = logging.getLogger(__name__)


@dataclass(frozen=True)
class Tolerance:
    """Exported outputs pass when |exported - pytorch| <= atol + rtol * |pytorch| element-wise (numpy.allclose)."""

    rtol: float
    atol: float


# fp32: onnxruntime sums in another order, so yolov5n/s at 640 differ from PyTorch by up to 6e-5 on box pixels
# near 640 (one float32 step there; benchmarks/export.py) and TorchScript by 0. atol + rtol = 1e-3 allows
# 0.64 px at 640 and 0.002 on a score: well above rounding, well below what a wrong graph gives (whole pixels).
# The margin is smallest on box coordinates near 0 px (points at the image's top or left edge), where only
# atol applies, while an anchor-free head's pixel error is about the same everywhere: its DFL expectation is
# scaled by the stride (up to 32). A yolov8n at 224 px with batch norms fitted to real images differed by
# 7.9e-3 px at most, 0.25 of the tolerance, at a centre 2.07 px from the top edge (random weights: 3e-5 px).
FP32_TOLERANCE = Tolerance(rtol=1e-3, atol=1e-3)
FP16_TOLERANCE = Tolerance(rtol=1e-2, atol=1e-2)  # fp16 keeps ~3 significant digits


@dataclass(frozen=True)
class Parity:
    """How far an exported file's outputs are from PyTorch's, over every element compared.

    `tolerance_share` is the largest |diff| / (atol + rtol * |value|), the file's margin (1 is the
    limit); `worst_value` is the PyTorch value where it was reached. The largest |diff| alone says
    little: rtol lets a 200-px box corner differ 100 times more than a score near 0.
    """

    max_abs_diff: float
    tolerance_share: float
    worst_value: float


class ExportMismatchError(ConfigError):
    """An exported file's outputs differ from PyTorch's beyond the tolerance; no file was written.

    A ConfigError so the entry point reports it as one line (exit status 2) like other refusals.
    """


def check_parity(
    wrapper: nn.Module, runner: Runner, inputs: list[torch.Tensor], tolerance: Tolerance, path: Path
) -> Parity:
    """Compare the exported file's outputs with PyTorch's on each input; return the largest difference and margin.

    Raises ExportMismatchError naming `path` when a shape differs or any element is outside `tolerance`.
    """
    worst, closest = 0.0, Parity(0.0, 0.0, 0.0)
    for images in inputs:
        with torch.no_grad():
            expected = wrapper(images)
        expected_arrays = [t.float().cpu().numpy() for t in (expected if isinstance(expected, tuple) else (expected,))]
        got_arrays = [np.asarray(array, dtype=np.float32) for array in runner(images)]
        for index, (want, got) in enumerate(zip(expected_arrays, got_arrays, strict=True)):
            if want.shape != got.shape:
                raise ExportMismatchError(f"{path}: output shape {got.shape} differs from PyTorch's {want.shape}")
            if index == 0 and getattr(wrapper, "end_to_end", False):
                got = np.stack([match_detection_rows(w, g, tolerance) for w, g in zip(want, got, strict=True)])
            diff = float(np.abs(want - got).max()) if want.size else 0.0
            worst = max(worst, diff)
            closest = _closer(closest, want, got, tolerance)
            if not np.allclose(got, want, rtol=tolerance.rtol, atol=tolerance.atol):
                raise ExportMismatchError(
                    f"{path}: outputs differ from PyTorch by up to {diff:.3g} at batch {len(images)}, beyond "
                    f"{tolerance.atol:g} + {tolerance.rtol:g} * |value|; the file was not written"
                )
    return Parity(worst, closest.tolerance_share, closest.worst_value)


def _closer(closest: Parity, want: np.ndarray, got: np.ndarray, tolerance: Tolerance) -> Parity:
    """`closest`, or the element of this output nearer its tolerance (as a Parity: share and PyTorch value)."""
    if not want.size:
        return closest
    share = np.abs(want - got) / (tolerance.atol + tolerance.rtol * np.abs(want))
    index = np.unravel_index(int(share.argmax()), share.shape)
    if share[index] <= closest.tolerance_share:
        return closest
    return Parity(0.0, float(share[index]), float(want[index]))


def match_detection_rows(want: np.ndarray, got: np.ndarray, tolerance: Tolerance) -> np.ndarray:
    """Reorder one image's exported detection rows (k, 6 [+ nm]) onto PyTorch's, for an order-free comparison.

    A file ranks (point, class) scores that are equal to float rounding in whatever order its runtime
    gives them, so rows are paired greedily by their largest column difference. Rows scoring within
    the tolerance of the last one kept may have been swapped for others at the cut: only their score
    is compared (their columns are taken from PyTorch's row).
    """
    remaining = list(range(len(got)))
    paired = np.empty_like(got)
    boundary = want[:, 4].min() + tolerance.atol + tolerance.rtol * abs(want[:, 4].min()) if len(want) else 0.0
    for row in range(len(want)):
        costs = np.abs(got[remaining] - want[row]).max(axis=1)
        best = remaining.pop(int(costs.argmin()))
        paired[row] = got[best]
        if want[row, 4] <= boundary:
            paired[row, :4], paired[row, 5:] = want[row, :4], want[row, 5:]
    return paired


def check_agreement(
    wrapper: nn.Module, runner: Runner, batches: list[torch.Tensor], metadata: ExportMetadata, path: Path
) -> Agreement:
    """detection_agreement on the calibration batches; below MIN_AGREEMENT an ExportMismatchError naming `path`."""
    agreement = detection_agreement(wrapper, runner, batches, metadata)
    if not agreement.measured:
        LOGGER.warning(
            f"{path}: PyTorch finds no detection on the {sum(len(b) for b in batches)} calibration image(s) at conf "
            "0.25, so the INT8 file's agreement with it could not be checked (an undertrained model, or --data "
            "images unlike its training data); check the file with val.py"
        )
    if agreement.recall < MIN_AGREEMENT:
        raise ExportMismatchError(
            f"{path}: the INT8 model finds {agreement.matched} of PyTorch's {agreement.expected} detections on the "
            f"calibration images, fewer than {MIN_AGREEMENT:.0%}; the file was not written"
        )
    return agreement
