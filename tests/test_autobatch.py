"""--batch-size -1 (AutoBatch): the fit, the one-line refusals, the CPU fallback and the ranks' agreement.

The measurement itself needs CUDA (tests/test_cuda.py)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from tests.dist_helpers import run_distributed
from utils.distributed import DistContext
from utils.errors import ConfigError
from utils.families import build_model, spec_from_cfg
from utils.train.autobatch import MAX_PER_RANK, agree_on_batch, fit_batch, resolve_autobatch
from utils.train.config import TrainConfig, validate

MB = 2**20


def test_the_fit_meets_the_budget_on_the_measured_line() -> None:
    sizes = [1, 2, 4, 8, 16]
    peaks = [300 * MB + size * 50 * MB for size in sizes]  # 300 MB for the model and buffers, 50 MB an image
    assert fit_batch(sizes, peaks, 3300 * MB) == 60
    assert fit_batch(sizes[:3], peaks[:3], 3325 * MB) == 60  # a larger size ran out of memory: fit what ran
    assert fit_batch(sizes, peaks, 100 * MB) == 1  # never below one image
    assert fit_batch(sizes, peaks, 10**15) == MAX_PER_RANK
    assert fit_batch([1], [350 * MB], 3300 * MB) is None  # one point is no line
    assert fit_batch(sizes, [300 * MB] * 5, 3300 * MB) is None  # memory that does not grow says nothing


def test_bad_values_and_autobatch_with_resume_are_one_line(tmp_path: Path) -> None:
    ctx = DistContext()
    validate(TrainConfig(batch_size=-1), ctx)  # accepted: measured once the model is known
    with pytest.raises(ConfigError, match=r"^--batch-size -2 must be at least 1, or -1 for AutoBatch$"):
        validate(TrainConfig(batch_size=-2), ctx)
    with pytest.raises(ConfigError, match=r"--batch-size -1 \(AutoBatch\) with --resume: give a size"):
        validate(TrainConfig(batch_size=-1, resume=str(tmp_path / "last.pt")), ctx)


def test_without_cuda_the_default_batch_is_used_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    built = []

    def build() -> torch.nn.Module:
        built.append(True)
        return build_model(spec_from_cfg("yolov8n", 2))

    with caplog.at_level(logging.WARNING, logger="utils.train.autobatch"):
        cfg = resolve_autobatch(TrainConfig(batch_size=-1), build, None, DistContext())
    assert cfg.batch_size == 16 and not built  # nothing to measure on a CPU: no model is built
    assert "--batch-size -1 (AutoBatch): no CUDA device to measure; using --batch-size 16" in caplog.text
    given = TrainConfig(batch_size=8)
    assert resolve_autobatch(given, build, None, DistContext()) is given


def _agree(ctx: DistContext) -> tuple[int | None, int | None]:
    # Rank 1's GPU has less room: both ranks take its batch. Then rank 1 could not measure: both fall back.
    tight = agree_on_batch(24 if ctx.rank == 0 else 10, ctx)
    unknown = agree_on_batch(24 if ctx.rank == 0 else None, ctx)
    return tight, unknown


@pytest.mark.distributed
def test_ranks_agree_on_the_tightest_gpu(tmp_path: Path) -> None:
    assert run_distributed(_agree, 2, tmp_path) == [(10, None), (10, None)]
