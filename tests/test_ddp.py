"""DDP invariants on 2 real gloo processes: gradient equivalence, identical weights, the identical-weights
check, the broadcast early-stop decision, and a failing rank ending the run instead of hanging.

Starting two processes costs seconds (each imports torch), so one spawned job runs every check that
needs a healthy process group (`rank_results`) and the tests assert on its parts. The failure test
needs its own processes, because it breaks the group on purpose.
"""

from __future__ import annotations

import csv
import dataclasses
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from models.anchor_free import AnchorFreeSpec
from models.yolo import spec_from_cfg
from tests.conftest import compile_without_codegen, make_tiny_dataset
from tests.dist_helpers import PROCESS_TIMEOUT_S, captured, check_parts, free_port, run_distributed
from utils.config import DEFAULT_HYP
from utils.data.synthetic import SHAPE_NAMES, SyntheticSpec
from utils.distributed import DistContext, average_bn_stats
from utils.eval.evaluate import DetectionScorer, evaluate
from utils.families import build_model as build_family_model
from utils.hyp import load_hyp
from utils.tasks import DETECT, Task
from utils.train.config import TrainConfig, build_train_parser, config_from_args
from utils.train.engine import fit
from utils.train.records import ANCHOR_FREE_TRAINING, DETECT_TRAINING
from utils.train.setup import ModelBundle, verify_identical_weights
from utils.train.state import build_train_state
from utils.train.step import train_one_epoch

IMGSZ = 64
NUM_CLASSES = 3
SPEC = spec_from_cfg("yolov5n", NUM_CLASSES)
HYP = load_hyp(DEFAULT_HYP)  # configs below name optimizer="AdamW" (the old default): no auto outside fit()
# Small anchor-free models (1/8 width) of the DFL and the end-to-end layouts, with their family's hyp.
ANCHOR_FREE_SPECS = {
    layout: AnchorFreeSpec(layout, 0.33, 0.125, 256, NUM_CLASSES, reg_max=reg_max, end_to_end=layout == "yolo26")
    for layout, reg_max in (("yolo11", 16), ("yolo26", 1))
}
ANCHOR_FREE_HYP = load_hyp(ANCHOR_FREE_TRAINING.recipe_files.short)
GLOBAL_BATCH = 4
WORLD_SIZE = 2
MICRO_BATCHES = 6
TINY = SyntheticSpec(num_train=8, num_val=4, max_objects=3, min_object_frac=0.2, min_side=64, max_side=96)
# Early-stop check: rank 0's fitness falls after epoch 1 (patience 1 stops it after epoch 2); rank 1's
# rises, so rank 1 alone would train all EARLY_STOP_EPOCHS. Only the broadcast keeps them together.
FITNESS_BY_RANK = ((0.5, 0.4, 0.6, 0.7, 0.8, 0.9), (0.1, 0.2, 0.3, 0.4, 0.5, 0.6))
EARLY_STOP_EPOCHS = 4
pytestmark = pytest.mark.distributed  # every test runs on 2 spawned gloo processes (rank_results or Popen)


# ---------------------------------------------------------------------------------------------- fixed data


def _fixed_global_batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Return seeded (images (B, 3, 64, 64) float in [0, 1], targets (N, 6) [image, cls, cx, cy, w, h] normalised).

    The two halves (one per rank) are deliberately unbalanced: 3 random boxes per image in the
    first, 1 in the second, so the ranks match different numbers of anchors per level. The loss
    averages its match counts over ranks, so DDP must still equal one process exactly (with
    per-rank counts, as in YOLOv5, the summed loss was 17% off here).
    """
    generator = torch.Generator().manual_seed(seed)
    images = torch.rand((GLOBAL_BATCH, 3, IMGSZ, IMGSZ), generator=generator)
    half = GLOBAL_BATCH // WORLD_SIZE
    parts = []
    for first_image, per_image in ((0, 3), (half, 1)):
        count = half * per_image
        image_index = (first_image + torch.arange(half).repeat_interleave(per_image)).float()
        classes = torch.randint(0, NUM_CLASSES, (count,), generator=generator).float()
        centres = 0.2 + 0.6 * torch.rand((count, 2), generator=generator)
        sizes = 0.1 + 0.4 * torch.rand((count, 2), generator=generator)
        parts.append(torch.cat((image_index[:, None], classes[:, None], centres, sizes), dim=1))
    return images, torch.cat(parts)


def _rank_slice(images: torch.Tensor, targets: torch.Tensor, ctx: DistContext) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's contiguous share of the global batch, targets re-indexed to the local batch."""
    per_rank = len(images) // ctx.world_size
    first = ctx.rank * per_rank
    mine = (targets[:, 0] >= first) & (targets[:, 0] < first + per_rank)
    local = targets[mine].clone()
    local[:, 0] -= first
    return images[first : first + per_rank], local


def _model_with_bn_pinned_to_eval(seed: int = 0, spec: Any = SPEC) -> nn.Module:
    """yolov5n whose BatchNorm layers stay in eval mode (running statistics) even under model.train().

    In train mode BatchNorm normalises with the statistics of the batch it sees, which differ
    between a half batch and the full batch, so gradients could not match. With BN on running
    statistics the forward is per-image, and DDP on half batches must reproduce one process on
    the whole batch. train_one_epoch calls model.train(), so each BN layer's train() is replaced.
    """
    torch.manual_seed(seed)
    model = build_family_model(spec)
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            module.train = lambda mode=True, bn=module: nn.Module.train(bn, False)
            module.eval()
    return model


def _flat(tensors: Any) -> torch.Tensor:
    return torch.cat([t.detach().flatten() for t in tensors]).clone()


def _as_batch(images: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
    """A collated batch as the loader yields it: uint8 RGB images (B, H, W, 3), (N, 6) targets."""
    return {"images": (images * 255).round().to(torch.uint8).permute(0, 2, 3, 1).contiguous(), "targets": targets}


def _record_step_gradients(optimizer: torch.optim.Optimizer, model: nn.Module) -> list[torch.Tensor]:
    """Make `optimizer.step` first record the flat gradients it is about to apply; return the record."""
    record: list[torch.Tensor] = []
    real_step = optimizer.step

    def step(*args: Any, **kwargs: Any) -> Any:
        record.append(_flat(p.grad for p in model.parameters() if p.requires_grad))
        return real_step(*args, **kwargs)

    optimizer.step = step
    return record


def _count_no_sync(ddp: nn.Module) -> list[int]:
    """Make `ddp.no_sync()` append to the returned list each time the engine enters it."""
    calls: list[int] = []
    real_no_sync = ddp.no_sync
    ddp.no_sync = lambda: calls.append(1) or real_no_sync()
    return calls


# ---------------------------------------------------------------------------- the checks run on each rank


def _first_step_gradients(ctx: DistContext, spec: Any = SPEC, hyp: Any = HYP) -> dict[str, Any]:
    """Run train_one_epoch on one batch (this rank's share of the global batch) and return the loss items
    and the gradients the optimizer steps with. The engine multiplies the loss by the world size."""
    model = _model_with_bn_pinned_to_eval(spec=spec)
    cfg = TrainConfig(model="yolov5n", hyp=hyp, optimizer="AdamW", batch_size=GLOBAL_BATCH, imgsz=IMGSZ, epochs=1)
    state = build_train_state(ModelBundle(model, spec, SHAPE_NAMES[:NUM_CLASSES]), cfg, DETECT_TRAINING, ctx, batches=1)
    stepped_with = _record_step_gradients(state.optimizer, model)
    trained = train_one_epoch(state, [_as_batch(*_rank_slice(*_fixed_global_batch(), ctx))], 0, cfg, ctx)
    assert len(stepped_with) == 1, "iteration 0 must step"
    return {"items": trained.mean_loss, "images": trained.images, "grads": stepped_with[0]}


def _gradients(ctx: DistContext, spec: Any = SPEC, hyp: Any = HYP) -> dict[str, Any]:
    """This rank's DDP result; rank 0 also computes the one-process reference on the whole global batch."""
    result = {"ddp": _first_step_gradients(ctx, spec, hyp)}
    if ctx.is_main:
        result["reference"] = _first_step_gradients(DistContext(), spec, hyp)  # world size 1: no DDP
    return result


def _engine_steps(ctx: DistContext, compile_mode: str = "") -> dict[str, Any]:
    """Train MICRO_BATCHES per-rank batches with the real engine pieces, from per-rank initial weights.

    build_train_state wraps with smart_ddp (and, with `compile_mode`, compiles the forward and the loss,
    whose assignment then runs in static shapes) and builds the optimizer and EMA; train_one_epoch
    accumulates with no_sync. BN statistics are averaged afterwards, as fit() does before saving.
    """
    torch.manual_seed(10 + ctx.rank)  # different initial weights per rank: DDP must broadcast rank 0's
    model = build_family_model(SPEC)
    initial = _flat(model.parameters())
    cfg = TrainConfig(
        model="yolov5n", hyp=HYP, optimizer="AdamW", batch_size=GLOBAL_BATCH, imgsz=IMGSZ, epochs=1,
        compile_mode=compile_mode, static_loss_shapes=bool(compile_mode),
    )  # fmt: skip
    bundle = ModelBundle(model, SPEC, tuple(SHAPE_NAMES[:NUM_CLASSES]))
    with compile_without_codegen() as compile_modes:
        state = build_train_state(bundle, cfg, DETECT_TRAINING, ctx, batches=MICRO_BATCHES)
    no_sync_calls = _count_no_sync(state.ddp)
    batches = []
    for step in range(MICRO_BATCHES):  # different data on each rank and step
        images, targets = _rank_slice(*_fixed_global_batch(seed=100 * ctx.rank + step), ctx)
        batches.append(_as_batch(images, targets))
    torch._dynamo.reset()
    train_one_epoch(state, batches, 0, cfg, ctx)
    graphs = int(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    average_bn_stats(state.model, ctx)
    average_bn_stats(state.ema.ema, ctx)
    verify_identical_weights(state.model, ctx)  # must not raise
    return {
        "initial": initial,
        "final": _flat(state.model.parameters()),
        "model": {k: v.clone() for k, v in state.model.state_dict().items()},
        "ema": {k: v.clone() for k, v in state.ema.ema.state_dict().items()},
        "last_opt_step": state.last_opt_step,
        "no_sync_calls": len(no_sync_calls),
        "compile_modes": compile_modes,
        "compiled_graphs": graphs,
    }


def _verify_with_rank1_changed(ctx: DistContext, change: str) -> str | None:
    """Build the same model on every rank, change rank 1's copy (no DDP to undo it), return the check's error."""
    torch.manual_seed(0)
    model = build_family_model(SPEC)
    verify_identical_weights(model, ctx)  # identical: must pass
    if ctx.rank == 1:
        with torch.no_grad():
            if change == "reseed":
                torch.manual_seed(1)
                model.load_state_dict(build_family_model(SPEC).state_dict())
            else:  # "swap": same values in other places, so the tensors differ but not their sum
                weight = model.layers()[0].conv.weight.view(-1)
                weight[[0, 1]] = weight[[1, 0]].clone()
    try:
        verify_identical_weights(model, ctx)
    except RuntimeError as error:
        return str(error)
    return None


POISONED_MICRO_BATCH = 4  # runs under no_sync (see the accumulation test); the next micro-batch steps


def _nonfinite_on_rank1(ctx: DistContext, num_batches: int = MICRO_BATCHES) -> dict[str, Any]:
    """Train `num_batches` where rank 1's loss alone turns NaN at POISONED_MICRO_BATCH; return what each rank saw.

    With POISONED_MICRO_BATCH + 1 batches the bad one is the epoch's tail: no optimizer step follows it.
    """
    torch.manual_seed(10)
    model = build_family_model(SPEC)
    cfg = TrainConfig(model="yolov5n", hyp=HYP, optimizer="AdamW", batch_size=GLOBAL_BATCH, imgsz=IMGSZ, epochs=1)
    state = build_train_state(
        ModelBundle(model, SPEC, SHAPE_NAMES[:NUM_CLASSES]), cfg, DETECT_TRAINING, ctx, num_batches
    )
    stepped_with = _record_step_gradients(state.optimizer, model)
    real_loss, calls = state.train_loss, []

    def poisoned(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        loss, items = real_loss(*args, **kwargs)
        calls.append(1)
        if ctx.rank == 1 and len(calls) == POISONED_MICRO_BATCH + 1:
            loss = loss * float("nan")
        return loss, items

    state.train_loss = poisoned  # the training step's loss call
    batches = [_as_batch(*_rank_slice(*_fixed_global_batch(seed=step), ctx)) for step in range(num_batches)]
    try:
        train_one_epoch(state, batches, 0, cfg, ctx)
        message = None
    except FloatingPointError as raised:
        message = str(raised)
    return {  # no "error" key: _parts reads that as a check that crashed
        "message": message,
        "micro_batches": len(calls),
        "steps": len(stepped_with),
        "weights": _flat(state.model.parameters()),
        "ema": _flat(state.ema.ema.parameters()),
    }


class _RankFitness:
    """An evaluation result whose fitness is replaced by this rank's next value from FITNESS_BY_RANK."""

    calls = 0

    def __init__(self, result: Any, rank: int) -> None:
        self.loss_items = result.loss_items
        self.metric_source, self.mask_metric_source = result.metric_source, result.mask_metric_source
        self.mask_metrics = result.mask_metrics
        self.metrics = {**result.as_dict(), "fitness": FITNESS_BY_RANK[rank][_RankFitness.calls]}
        _RankFitness.calls += 1

    def as_dict(self) -> dict[str, float]:
        return self.metrics


@dataclasses.dataclass(frozen=True)
class _RankFitnessTask(Task):
    """DETECT whose evaluation reports rank-dependent fitness (to prove the early-stop decision is rank 0's)."""

    def evaluate(self, model: nn.Module, batches: Any, options: Any, ctx: DistContext, loss_fn: Any = None) -> Any:
        return _evaluate_with_rank_fitness(model, batches, options, ctx, loss_fn)


def _evaluate_with_rank_fitness(
    model: nn.Module, batches: Any, options: Any, ctx: DistContext, loss_fn: Any = None
) -> Any:
    """The real evaluation (its collectives included), reporting a per-rank fitness sequence."""
    inputs = DETECT.loss_inputs
    result = evaluate(model, batches, options, ctx, scorer=DetectionScorer(), loss_fn=loss_fn, loss_inputs=inputs)
    return _RankFitness(result, ctx.rank)


def _fit_with_patience(ctx: DistContext, data_yaml: str, project: str) -> int:
    """Run the real fit() with --patience 1 and rank-dependent fitness; return the epochs it ran."""
    args = ["--cfg", "yolov5n", "--data", data_yaml, "--imgsz", str(IMGSZ), "--batch-size", str(GLOBAL_BATCH),
            "--workers", "0", "--device", "cpu", "--project", project, "--name", "patience", "--seed", "3",
            "--epochs", str(EARLY_STOP_EPOCHS), "--patience", "1", "--noplots"]  # fmt: skip
    cfg = config_from_args(build_train_parser("detect").parse_args(args), "detect")
    training = dataclasses.replace(DETECT_TRAINING, task=_RankFitnessTask(**vars(DETECT)))
    return fit(cfg, training, ctx).epochs_run


def _rank_checks(ctx: DistContext, data_yaml: str, project: str) -> dict[str, Any]:
    """Every check that needs a healthy 2-rank group, in the same order on both ranks."""
    return {
        "gradients": captured(_gradients, ctx),
        # Anchor-free: DFL (yolo11 layout) and the end-to-end one-to-one branch with L1 (yolo26 layout).
        "gradients_yolo11": captured(_gradients, ctx, ANCHOR_FREE_SPECS["yolo11"], ANCHOR_FREE_HYP),
        "gradients_yolo26": captured(_gradients, ctx, ANCHOR_FREE_SPECS["yolo26"], ANCHOR_FREE_HYP),
        "engine": captured(_engine_steps, ctx),
        "engine_compiled": captured(_engine_steps, ctx, "default"),
        "verify_reseed": captured(_verify_with_rank1_changed, ctx, "reseed"),
        "verify_swap": captured(_verify_with_rank1_changed, ctx, "swap"),
        "early_stop_epochs": captured(_fit_with_patience, ctx, data_yaml, project),
        "nonfinite": captured(_nonfinite_on_rank1, ctx),
        "nonfinite_tail": captured(_nonfinite_on_rank1, ctx, POISONED_MICRO_BATCH + 1),
    }


def _parts(rank_results: tuple[list[dict[str, Any]], Path], name: str) -> list[Any]:
    """Each rank's result of check `name`; fails the test with the rank's traceback if it raised."""
    return check_parts(rank_results[0], name)


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An 8/4-image shapes dataset (64-96 px images) and its YAML."""
    return make_tiny_dataset(tmp_path_factory.mktemp("ddp_data"), TINY)


@pytest.fixture(scope="module")
def rank_results(tiny_data: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], Path]:
    """Both ranks' results of _rank_checks, and the project folder fit() wrote to."""
    root = tmp_path_factory.mktemp("ddp")
    results = run_distributed(_rank_checks, WORLD_SIZE, root / "dist", str(tiny_data), str(root / "runs"))
    return results, root / "runs"


# ---------------------------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("check", ["gradients", "gradients_yolo11", "gradients_yolo26"])
def test_two_rank_gradients_equal_one_process_with_the_global_batch(rank_results, check: str) -> None:
    rank0, rank1 = _parts(rank_results, check)
    reference, first, second = rank0["reference"], rank0["ddp"], rank1["ddp"]
    scale = float(reference["grads"].abs().max())
    assert scale > 0
    # Clipping (max norm 10) would rescale wrong gradients onto right ones and hide a missing factor: the
    # reference must stay well below it (a DDP result off by a factor then shows, clipped or not).
    assert float(reference["grads"].norm()) < 8
    # The epoch's loss items (results.csv) are averaged over ranks: equal on both, and equal to one process.
    np.testing.assert_array_equal(first["items"], second["items"])
    np.testing.assert_allclose(first["items"], reference["items"], rtol=1e-5)
    assert first["images"] == second["images"] == reference["images"] == GLOBAL_BATCH  # counted over ranks
    assert torch.equal(first["grads"], second["grads"]), "DDP leaves the same averaged gradient on every rank"
    torch.testing.assert_close(first["grads"], reference["grads"], rtol=1e-4, atol=1e-6 * scale)


def test_weights_stay_identical_across_ranks_through_accumulated_steps(rank_results) -> None:
    first, second = _parts(rank_results, "engine")
    assert not torch.equal(first["initial"], second["initial"]), "ranks must start from different weights"
    # In warmup accumulation ramps from 1 to 2: steps after micro-batches 0-3 and 5, no_sync at 4.
    assert first["last_opt_step"] == second["last_opt_step"] == MICRO_BATCHES - 1
    assert first["no_sync_calls"] == second["no_sync_calls"] >= 1, "accumulation must skip the all-reduce"
    assert not torch.equal(first["final"], first["initial"]), "the optimiser must have changed the weights"
    for name in ("model", "ema"):
        assert first[name].keys() == second[name].keys()
        for key, tensor in first[name].items():
            assert torch.equal(tensor, second[name][key]), f"{name}.{key} differs between ranks"


def test_compile_trains_the_ddp_module_and_loss_to_the_same_weights_on_every_rank(rank_results) -> None:
    (eager, _), (first, second) = _parts(rank_results, "engine"), _parts(rank_results, "engine_compiled")
    assert eager["compile_modes"] == [] and eager["compiled_graphs"] == 0, "no --compile: nothing compiled"
    assert first["compile_modes"] == second["compile_modes"] == ["default"] * 2, "the forward and the loss, per rank"
    assert first["compiled_graphs"] >= 2, "the training forward and the loss must have run through dynamo"
    assert first["last_opt_step"] == eager["last_opt_step"]
    assert first["no_sync_calls"] == eager["no_sync_calls"] >= 1, "accumulation still skips the all-reduce"
    for name in ("model", "ema"):
        for key, tensor in first[name].items():
            assert torch.equal(tensor, second[name][key]), f"compiled: {name}.{key} differs between ranks"
    # The same starting weights and batches: compiled, the step trains to what eager DDP trains to.
    torch.testing.assert_close(first["final"], eager["final"], rtol=1e-4, atol=1e-5)


def test_verify_identical_weights_raises_when_a_rank_was_initialised_differently(rank_results) -> None:
    errors = _parts(rank_results, "verify_reseed")
    assert all(e is not None and "model weights differ across ranks" in e for e in errors), errors


def test_verify_identical_weights_sees_swapped_weights(rank_results) -> None:
    # Known bug (see report): a checksum of sums cannot tell two swapped weights apart.
    errors = _parts(rank_results, "verify_swap")
    assert all(e is not None and "model weights differ across ranks" in e for e in errors), errors


def test_early_stop_decision_is_broadcast_so_ranks_leave_together(rank_results) -> None:
    assert _parts(rank_results, "early_stop_epochs") == [2, 2]
    with (rank_results[1] / "patience" / "results.csv").open() as file:
        assert [row["epoch"] for row in csv.DictReader(file)] == ["1", "2"]


def test_a_nan_loss_on_one_rank_stops_every_rank_before_the_weights_change(rank_results) -> None:
    first, second = _parts(rank_results, "nonfinite")
    # Both ranks raise (rank 0 never saw a NaN); without the shared check rank 0 would step on.
    for seen in (first, second):
        assert seen["message"] is not None and "on 1 of 2 ranks" in seen["message"], seen["message"]
        assert seen["micro_batches"] == POISONED_MICRO_BATCH + 2, "stops at the step after the bad micro-batch"
        assert seen["steps"] == POISONED_MICRO_BATCH, "the step carrying the NaN gradient is not taken"
        assert torch.isfinite(seen["weights"]).all() and torch.isfinite(seen["ema"]).all()
    assert torch.equal(first["weights"], second["weights"])


def test_a_nan_loss_in_an_epochs_last_micro_batch_stops_every_rank_before_its_closing_step(rank_results) -> None:
    # Warmup schedule: steps after micro-batches 0-3; micro-batch 4 ends the epoch, and an epoch always
    # ends with a step (no gradient left pending in an epoch-end checkpoint), which is not taken.
    for seen in _parts(rank_results, "nonfinite_tail"):
        message = seen["message"]
        assert message is not None and f"the optimizer step at epoch 1 batch {POISONED_MICRO_BATCH + 1}" in message
        assert "on 1 of 2 ranks" in seen["message"]
        assert seen["micro_batches"] == POISONED_MICRO_BATCH + 1 and seen["steps"] == POISONED_MICRO_BATCH
        assert torch.isfinite(seen["weights"]).all()


# ------------------------------------------------------------------------ a failing rank ends the run

# One rank of a torchrun-like job through the real entry plumbing: run_entry creates the group, runs the
# body and destroys the group, as train.py does. A separate interpreter importing only utils.cli starts
# faster than a spawned copy of this module. Ranks are ordered by files in argv[2], not by guessed delays:
# rank 1 raises once rank 0 is entering the barrier ("at-barrier"); once run_entry has raised, rank 1 stays
# alive until rank 0's barrier has ended ("barrier-ended"), so only rank 1's teardown, not its process's
# exit, can have ended that barrier. Each rank prints "key: value" lines for the test to read.
FAILING_RANK_SCRIPT = """
import datetime, pathlib, sys, time
import torch
import torch.distributed as dist
from utils.cli.entry import run_entry
from utils.distributed import barrier

def body(ctx):
    marks["rank"] = ctx.rank
    if ctx.rank == 1:
        wait_for(events / "at-barrier")
        raise ValueError("rank 1 fails on purpose")
    (events / "at-barrier").touch()
    try:
        barrier(ctx)
    finally:
        marks["barrier_end"], marks["modules"] = time.monotonic(), set(sys.modules)
        (events / "barrier-ended").touch()

def wait_for(path):
    deadline = time.monotonic() + timeout_s  # a rank that never gets there fails the test anyway
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    return path.exists()

torch.set_num_threads(1)
timeout_s, events, marks = float(sys.argv[1]), pathlib.Path(sys.argv[2]), {}
try:
    run_entry("cpu", body, datetime.timedelta(seconds=timeout_s))
finally:
    if marks.get("rank") == 1:
        print(f"rank 0's barrier ended while rank 1 was alive: {wait_for(events / 'barrier-ended')}", flush=True)
    elif "barrier_end" in marks:
        print(f"seconds from the barrier's end to run_entry's: {time.monotonic() - marks['barrier_end']:.2f}")
        print(f"group left initialised: {dist.is_initialized()}")
        print(f"modules imported in teardown: {sorted(set(sys.modules) - marks['modules'])}", flush=True)
"""


def _printed(output: str) -> dict[str, str]:
    """The "key: value" lines a FAILING_RANK_SCRIPT rank printed (other lines, e.g. logging, skipped)."""
    return dict(line.split(": ", 1) for line in output.splitlines() if ": " in line)


def test_a_rank_that_raises_ends_the_run_instead_of_hanging(tmp_path: Path) -> None:
    # The process-group timeout: rank 0 must end because its peer left ("by peer") long before it could fire.
    timeout_s = 120.0
    script = tmp_path / "failing_rank.py"
    script.write_text(FAILING_RANK_SCRIPT)
    (tmp_path / "events").mkdir()
    port, repo = free_port(), Path(__file__).resolve().parents[1]
    processes = []
    for rank in range(WORLD_SIZE):
        env = {**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1"}
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_PORT=str(port))
        command = [sys.executable, str(script), str(timeout_s), str(tmp_path / "events")]
        processes.append(subprocess.Popen(command, cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    outputs = []
    try:
        for process in processes:
            stdout, stderr = process.communicate(timeout=timeout_s + PROCESS_TIMEOUT_S)  # start-up under load
            outputs.append((process.returncode, _printed(stdout.decode()), stderr.decode()))
    finally:
        for process in processes:
            process.kill()  # no-op for a finished process; ends a hung one
    (code0, printed0, err0), (code1, printed1, err1) = outputs
    assert code1 != 0 and "ValueError: rank 1 fails on purpose" in err1, err1
    # run_entry destroys the failing rank's group before its error propagates: the survivor is released then,
    # not when the failing process has printed its traceback and shut its interpreter down (seconds, minutes
    # under load) nor at the timeout.
    assert printed1.get("rank 0's barrier ended while rank 1 was alive") == "True", (printed1, err1)
    assert code0 != 0 and "by peer" in err0, f"rank 0 should fail in the barrier because its peer left:\n{err0}"
    # The survivor's teardown after the failed collective: the group destroyed, promptly (about 0.1 s idle;
    # the bound only catches a teardown that waits like a collective), and no import on the way out.
    assert printed0.get("group left initialised") == "False", (printed0, err0)
    teardown_s = float(printed0["seconds from the barrier's end to run_entry's"])
    assert teardown_s < timeout_s, f"rank 0's teardown took {teardown_s:.1f} s, as long as a collective's timeout"
    # torch.use_deterministic_algorithms imports torch._inductor (seconds under load) if the run changed nothing.
    assert "'torch._inductor'" not in printed0["modules imported in teardown"], printed0
