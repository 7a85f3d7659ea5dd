"""End-to-end tests: train.py on a tiny generated dataset, val.py on its best.pt, and --resume."""

from __future__ import annotations

import csv
import logging
import math
import os
import re
from pathlib import Path

import cv2
import pytest
import torch
import yaml

import train
import val
from tests.conftest import MessageRecorder, compile_without_codegen, make_tiny_dataset, tiny_val_argv
from utils.config import QUICKSTART_HYP
from utils.data.synthetic import SHAPE_NAMES, SyntheticSpec
from utils.distributed import DistContext
from utils.errors import ConfigError
from utils.hyp import load_hyp
from utils.inference_model import load_inference_model
from utils.tasks import DETECT

TINY = SyntheticSpec(num_train=16, num_val=8, max_objects=4, min_object_frac=0.15)
pytestmark = pytest.mark.slow  # every test uses trained_run (train.main) or calls train.main / val.main


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 16/8-image shapes dataset and its YAML, shared by this module's tests."""
    return make_tiny_dataset(tmp_path_factory.mktemp("tiny"), TINY)


def _train_args(data: Path, project: Path, name: str, *extra: str) -> list[str]:
    return [
        "--cfg",
        "yolov5n",
        "--data",
        str(data),
        "--imgsz",
        "64",
        "--batch-size",
        "8",
        "--workers",
        "0",
        "--device",
        "cpu",
        "--project",
        str(project),
        "--name",
        name,
        "--seed",
        "3",
        *extra,
    ]


def _read_rows(path: Path) -> list[dict[str, str]]:
    with path.open() as file:
        return list(csv.DictReader(file))


@pytest.fixture(scope="module")
def trained_run(tiny_data: Path, tmp_path_factory: pytest.TempPathFactory):
    """Two epochs of train.py, saving epoch1.pt too so --resume can be tested against it."""
    project = tmp_path_factory.mktemp("runs")
    handler = MessageRecorder()
    loggers = [
        logging.getLogger(name)
        for name in ("utils.train.engine", "utils.train.setup", "utils.train.plan", "utils.train.startup")
    ]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        relative = Path(os.path.relpath(tiny_data))  # as typed from the working folder; recorded resolved
        args = _train_args(relative, project, "e2e", "--epochs", "2", "--save-period", "1", "--close-mosaic", "1")
        result = train.main(args)
    finally:
        for logger in loggers:
            logger.removeHandler(handler)
    ENGINE_LOG[:] = handler.messages
    return result


ENGINE_LOG: list[str] = []  # utils.train.engine's, setup's, plan's and startup's messages during trained_run


def test_startup_line_counts_the_cached_images(trained_run) -> None:
    # --cache auto holds the 16 tiny training images in RAM; the line once said "cached 0" regardless.
    startup = [message for message in ENGINE_LOG if message.startswith("world size")]
    assert len(startup) == 1 and "(this rank's shard 16, cached 16)" in startup[0], startup


def test_the_start_up_time_is_logged_once_at_the_first_optimizer_step(trained_run) -> None:
    lines = [message for message in ENGINE_LOG if message.startswith("start-up: ")]
    assert len(lines) == 1, lines  # two epochs, one line
    pattern = r"start-up: first optimizer step ([\d.]+) s after the process started \(([\d.]+) s of it waiting .*\)"
    match = re.fullmatch(pattern, lines[0])
    assert match is not None, lines[0]
    assert float(match.group(2)) <= float(match.group(1))
    first_epoch = ENGINE_LOG.index(lines[0])
    assert not any(message.startswith("train: ") for message in ENGINE_LOG[:first_epoch])  # during epoch 1


def test_every_epoch_logs_its_images_per_second_and_data_wait(trained_run) -> None:
    lines = [message for message in ENGINE_LOG if message.startswith("train: ")]
    assert len(lines) == 2, lines  # one per epoch
    pattern = r"train: 16 images in ([\d.]+) s \(([\d.]+) images/s on 1 rank\), ([\d.]+)% of it waiting for data"
    for line in lines:  # 16 images, batch 8, one rank
        match = re.fullmatch(pattern, line)
        assert match is not None, line
        seconds, rate, share = (float(group) for group in match.groups())
        # Both figures are rounded to 0.1: on a loaded machine (14 s for the epoch) the rate's rounding matters too.
        assert 16 / (seconds + 0.05) - 0.05 <= rate <= 16 / max(seconds - 0.05, 1e-3) + 0.05
        assert 0 <= share <= 100


def test_train_writes_run_folder_and_finite_results(trained_run, tiny_data: Path) -> None:
    run_dir = trained_run.run_dir
    for name in ("weights/last.pt", "weights/best.pt", "weights/epoch1.pt", "results.csv", "opt.yaml", "hyp.yaml"):
        assert (run_dir / name).is_file(), name
    rows = _read_rows(run_dir / "results.csv")
    assert [row["epoch"] for row in rows] == ["1", "2"]
    for row in rows:
        for key in ("train/box_loss", "train/obj_loss", "train/cls_loss", "metrics/mAP50", "metrics/mAP50-95"):
            assert math.isfinite(float(row[key])), key
    assert set(trained_run.metrics) >= {"precision", "recall", "mAP50", "mAP50-95", "fitness"}
    options = yaml.safe_load((run_dir / "opt.yaml").read_text())
    assert options["epochs"] == 2 and options["batch_size"] == 8 and options["close_mosaic"] == 1
    assert options["data"] == str(tiny_data.resolve())  # given relative: val.py finds it from any folder
    closing = [m for m in ENGINE_LOG if m.startswith("Closing mosaic")]
    assert closing == ["Closing mosaic: the last 1 epoch(s) train on single letterboxed images"]


def test_auto_recipe_is_logged_once_and_recorded_in_the_run_folder(trained_run) -> None:
    # No --optimizer or --hyp: 16 images / batch 8 x 2 epochs is far below AUTO_SGD_MIN_STEPS, so AdamW.
    lines = [message for message in ENGINE_LOG if message.startswith("optimizer auto -> ")]
    assert len(lines) == 1, ENGINE_LOG
    assert lines[0].startswith(
        "optimizer auto -> AdamW lr0 0.001 nbs 16 (data/hyps/hyp.quickstart.yaml): 2 optimizer steps "
        "(16 images / batch 8 x 2 epochs); SGD at nominal batch 64 would get 2 < "
    )
    options = yaml.safe_load((trained_run.run_dir / "opt.yaml").read_text())
    assert options["optimizer"] == "AdamW" and options["hyp_path"] == str(QUICKSTART_HYP)
    hyp = yaml.safe_load((trained_run.run_dir / "hyp.yaml").read_text())
    assert hyp == load_hyp(QUICKSTART_HYP).to_dict()
    stored = torch.load(trained_run.last, map_location="cpu", weights_only=True)
    assert stored["train_config"]["optimizer"] == "AdamW" and stored["hyp"] == hyp


def test_train_writes_plots(trained_run) -> None:
    run_dir = trained_run.run_dir
    # 16 images in batches of 8: two first-epoch batches drawn, 8 tiles of 64 px in a 3 x 3 grid.
    assert sorted(p.name for p in run_dir.glob("train_batch*.jpg")) == ["train_batch0.jpg", "train_batch1.jpg"]
    assert cv2.imread(str(run_dir / "train_batch0.jpg")).shape == (3 * 64, 3 * 64, 3)
    for name in ("results.png", "PR_curve.png", "F1_curve.png", "P_curve.png", "R_curve.png", "confusion_matrix.png"):
        image = cv2.imread(str(run_dir / name))
        assert image is not None and image.std() > 0, name
    assert not list(run_dir.glob("mask_*")), "detection runs have no mask curves"


def test_checkpoints_load_weights_only_and_hold_state(trained_run) -> None:
    checkpoint = torch.load(trained_run.last, map_location="cpu", weights_only=True)
    assert checkpoint["epoch"] == 1 and checkpoint["task"] == "detect"
    assert checkpoint["names"] == list(SHAPE_NAMES)
    assert checkpoint["optimizer"] is not None and checkpoint["ema"] is not None
    assert not list(trained_run.last.parent.glob("*.tmp*")), "no temp files left behind"
    # best.pt is stripped at the end: fp16 EMA weights only, much smaller than the resumable last.pt.
    best = torch.load(trained_run.best, map_location="cpu", weights_only=True)
    assert best["optimizer"] is None and best["ema"]["head.convs.0.weight"].dtype == torch.float16
    assert trained_run.best.stat().st_size < trained_run.last.stat().st_size / 2


@pytest.mark.parametrize("layout", [[], ["--no-channels-last"]], ids=["nhwc", "nchw"])
def test_val_reproduces_training_metrics_on_best(trained_run, tiny_data: Path, tmp_path: Path, layout) -> None:
    # Training validates with global batch 2 x 8 = 16 rect batches; the same batch gives the same padding.
    # Training ran NHWC (the default); validating NCHW must give the same numbers.
    result = val.main(tiny_val_argv(trained_run.best, tiny_data, tmp_path, *layout))
    assert result.num_images == TINY.num_val
    assert result.as_dict()["mAP50-95"] == pytest.approx(trained_run.metrics["mAP50-95"], abs=0.02)
    assert set(result.speed_ms) == {"preprocess", "inference", "nms"}


@pytest.mark.parametrize("channels_last", [True, False])
def test_eval_model_layout_follows_flag(trained_run, channels_last: bool) -> None:
    model, _ = load_inference_model(trained_run.best, (DETECT).name, torch.device("cpu"), channels_last=channels_last)
    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Conv2d) and m.kernel_size == (3, 3)]
    assert weights and all(w.is_contiguous(memory_format=torch.channels_last) == channels_last for w in weights)
    assert all(w.is_contiguous() != channels_last for w in weights)


def test_resume_continues_from_saved_epoch(trained_run, tmp_path: Path) -> None:
    # Resume epoch1.pt in a copy of the run folder: it must run exactly epoch 2 and end like the original.
    copy = _copy_after_first_epoch(trained_run, tmp_path)
    saved = torch.load(copy / "weights" / "epoch1.pt", weights_only=True)["epoch_geometry"]
    assert saved["dataset_len"] == TINY.num_train and len(saved["dataset"]) == 40, "what a resume checks against"
    result = train.main(["--resume", str(copy / "weights" / "epoch1.pt"), "--device", "cpu", "--workers", "0"])
    assert result.run_dir == copy and result.epochs_run == 1
    assert [row["epoch"] for row in _read_rows(copy / "results.csv")] == ["1", "2"]
    _assert_same_final_weights(copy / "weights" / "last.pt", trained_run.last)


def test_compile_resumes_an_eager_run_to_the_same_weights_saved_unwrapped(trained_run, tmp_path: Path) -> None:
    # --compile may be given with --resume (how this attempt runs); epoch 2 compiled ends like epoch 2 eager.
    copy = _copy_after_first_epoch(trained_run, tmp_path)
    argv = ["--resume", str(copy / "weights" / "epoch1.pt"), "--device", "cpu", "--workers", "0", "--noplots"]
    with compile_without_codegen() as modes:
        result = train.main([*argv, "--compile", "max-autotune"])
    assert modes == ["max-autotune"] and result.epochs_run == 1
    resumed = _assert_same_final_weights(copy / "weights" / "last.pt", trained_run.last)
    assert resumed["train_config"]["compile_mode"] == "max-autotune"
    assert not [key for key in resumed["model"] if "_orig_mod" in key], "checkpoints hold the bare model's keys"


def test_static_loss_shapes_resume_a_run_to_the_same_weights(trained_run, tmp_path: Path) -> None:
    # How the loss is computed, not what: given with --resume, epoch 2 ends at the original's weights. So is
    # --noplots: the figures of the run's first attempt stay as they were, none is drawn again.
    copy = _copy_after_first_epoch(trained_run, tmp_path)
    drawn = {path.name: path.stat().st_mtime_ns for path in [*copy.glob("*.png"), *copy.glob("*.jpg")]}
    assert "results.png" in drawn and "labels.jpg" in drawn
    argv = ["--resume", str(copy / "weights" / "epoch1.pt"), "--device", "cpu", "--workers", "0"]
    result = train.main([*argv, "--static-loss-shapes", "--noplots"])
    assert result.epochs_run == 1
    resumed = _assert_same_final_weights(copy / "weights" / "last.pt", trained_run.last)
    assert resumed["train_config"]["static_loss_shapes"] is True and resumed["train_config"]["noplots"] is True
    assert {path.name: path.stat().st_mtime_ns for path in [*copy.glob("*.png"), *copy.glob("*.jpg")]} == drawn


def _copy_after_first_epoch(trained_run, tmp_path: Path) -> Path:
    """A copy of trained_run's folder whose results.csv stops after epoch 1, ready to resume epoch1.pt."""
    import shutil

    copy = tmp_path / "e2e"
    shutil.copytree(trained_run.run_dir, copy)
    rows = _read_rows(copy / "results.csv")[:1]
    with (copy / "results.csv").open("w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return copy


def _assert_same_final_weights(resumed_last: Path, original_last: Path) -> dict:
    """The resumed run's last.pt ends at the original's epoch with the original's weights; returns it."""
    resumed = torch.load(resumed_last, weights_only=True)
    original = torch.load(original_last, weights_only=True)
    assert resumed["epoch"] == original["epoch"] == 1
    assert resumed["model"].keys() == original["model"].keys()
    for key, tensor in original["model"].items():
        torch.testing.assert_close(resumed["model"][key], tensor, rtol=1e-4, atol=1e-5, msg=key)
    return resumed


def test_resume_of_finished_run_is_one_line_error(trained_run) -> None:
    with pytest.raises(ConfigError, match="already finished"):
        train.main(["--resume", str(trained_run.last), "--device", "cpu", "--workers", "0"])


def test_a_resume_on_another_batch_size_scales_weight_decay_to_it(trained_run, tmp_path: Path) -> None:
    # Weight decay is scaled to the batch and accumulation; the optimizer state loaded on resume must not
    # bring back the decay of the batch the run was started with.
    from utils.train.optim import accumulate_steps, scaled_weight_decay

    copy = _copy_after_first_epoch(trained_run, tmp_path)
    train.main(["--resume", str(copy / "weights" / "epoch1.pt"), "--device", "cpu", "--workers", "0",
                "--batch-size", "12", "--noplots"])  # fmt: skip
    hyp = torch.load(trained_run.last, weights_only=True)["hyp"]
    nbs = int(hyp["nbs"])

    def decays(path: Path) -> set[float]:
        groups = torch.load(path, weights_only=True)["optimizer"]["param_groups"]
        return {group["weight_decay"] for group in groups} - {0.0}

    wanted = scaled_weight_decay(hyp["weight_decay"], 12, accumulate_steps(12, nbs), nbs)
    assert decays(trained_run.last) == {scaled_weight_decay(hyp["weight_decay"], 8, accumulate_steps(8, nbs), nbs)}
    assert decays(copy / "weights" / "last.pt") == {wanted} and wanted not in decays(trained_run.last)


def _forced_fitness(monkeypatch: pytest.MonkeyPatch, scores: list[float]) -> None:
    """Make epoch k's fitness scores[k] (a tiny run's mAP is all zeros): early stopping gets something to act on."""
    import dataclasses

    from utils.train import engine

    real = engine._run_epoch

    def run_epoch(run, state, epoch):
        summary = real(run, state, epoch)
        state.best_fitness = max(scores[: epoch + 1])
        return dataclasses.replace(summary, metrics={**summary.metrics, "fitness": scores[epoch]})

    monkeypatch.setattr(engine, "_run_epoch", run_epoch)


def test_a_resumed_run_stops_early_where_the_uninterrupted_one_did(
    tiny_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shutil

    _forced_fitness(monkeypatch, [0.5, 0.1, 0.1, 0.1, 0.1])
    flags = ("--epochs", "5", "--patience", "2", "--save-period", "1", "--noplots", "--noval")
    whole = train.main(_train_args(tiny_data, tmp_path, "whole", *flags))
    assert whole.epochs_done == 3  # no better fitness in the 2 epochs after the first
    copy = tmp_path / "copy"
    shutil.copytree(whole.run_dir, copy)
    resumed = train.main(["--resume", str(copy / "weights" / "epoch2.pt"), "--device", "cpu", "--workers", "0"])
    assert (resumed.epochs_run, resumed.epochs_done) == (1, 3)
    assert [row["epoch"] for row in _read_rows(copy / "results.csv")] == ["1", "2", "3"]
    # The early-stopped run has nothing left to resume, unless a larger --patience (or none) trains it on.
    ended = f"--resume: {copy} stopped early after epoch 3 (best epoch 1, --patience 2); nothing to resume"
    with pytest.raises(ConfigError, match=re.escape(ended)):
        train.main(["--resume", str(copy / "weights" / "last.pt"), "--device", "cpu", "--workers", "0"])
    again = train.main(["--resume", str(copy / "weights" / "last.pt"), "--device", "cpu", "--workers", "0",
                        "--patience", "0"])  # fmt: skip
    assert (again.epochs_run, again.epochs_done) == (2, 5)


def test_a_torchrun_restart_of_a_resume_continues_what_the_job_trained(
    trained_run, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A job started with --resume epoch1.pt trains epoch 2 of 3, saves, then dies; torchrun restarts it with the
    # same command line, which must resume the job's own last.pt, not epoch1.pt again.
    copy = _copy_after_first_epoch(trained_run, tmp_path)
    argv = ["--resume", str(copy / "weights" / "epoch1.pt"), "--device", "cpu", "--workers", "0", "--epochs", "3",
            "--noplots"]  # fmt: skip
    from utils.train import engine

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    save_epoch = engine.save_epoch

    def save_then_die(run, state, epoch: int, fitness: float) -> None:
        save_epoch(run, state, epoch, fitness)
        if epoch == 1:
            raise RuntimeError("the node went away")

    with monkeypatch.context() as patch:
        patch.setattr(engine, "save_epoch", save_then_die)
        with pytest.raises(RuntimeError, match="the node went away"):
            train.main(argv)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    result = train.main(argv)
    assert result.run_dir == copy and (result.epochs_run, result.epochs_done) == (1, 3)
    assert [row["epoch"] for row in _read_rows(copy / "results.csv")] == ["1", "2", "3"]


def test_a_torchrun_restart_after_the_last_epochs_save_finishes_the_run(
    trained_run, tiny_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # The first attempt died after its last epoch was saved (in the final validation, say): the restart, the same
    # command line, finishes the run (best.pt stripped, validated) instead of failing at every restart.
    copy = _copy_run(trained_run, tmp_path)
    (copy / "weights" / "best.pt").write_bytes((copy / "weights" / "last.pt").read_bytes())  # not stripped yet
    (copy / ".torchelastic_run_id").write_text("job")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    with caplog.at_level(logging.INFO):
        result = train.main(_train_args(tiny_data, tmp_path, "e2e", "--epochs", "2"))
    assert result.run_dir == copy and (result.epochs_run, result.epochs_done) == (0, 2)
    assert f"{copy} already finished 2 of --epochs 2; finishing the run" in caplog.text
    assert torch.load(result.best, weights_only=True)["optimizer"] is None  # stripped
    assert set(result.metrics) >= {"mAP50", "mAP50-95"} and "Final (" in caplog.text
    assert [row["epoch"] for row in _read_rows(copy / "results.csv")] == ["1", "2"]


def test_resume_of_a_checkpoint_outside_a_weights_folder_is_one_line_error(trained_run, tmp_path: Path) -> None:
    # The run goes on in the folder above weights/: for a loose file that would be whatever folder holds its folder.
    loose = tmp_path / "downloads" / "last.pt"
    loose.parent.mkdir()
    loose.write_bytes(trained_run.last.read_bytes())
    with pytest.raises(ConfigError, match=re.escape(f"--resume {loose}: a run resumes in its own folder")):
        train.main(["--resume", str(loose), "--device", "cpu", "--workers", "0", "--epochs", "3"])
    assert sorted(path.name for path in tmp_path.rglob("*")) == ["downloads", "last.pt"]


def test_val_refuses_mismatched_class_count(trained_run, tmp_path: Path) -> None:
    data = yaml.safe_load(Path(trained_run.run_dir / "opt.yaml").read_text())["data"]
    other = tmp_path / "other.yaml"
    raw = yaml.safe_load(Path(data).read_text())
    raw["path"] = str((Path(data).parent / raw["path"]).resolve())
    raw["names"] = ["only"]
    other.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match="trained on 6 classes"):
        val.main(["--weights", str(trained_run.best), "--data", str(other), "--device", "cpu", "--workers", "0"])


def _copy_run(trained_run, tmp_path: Path) -> Path:
    import shutil

    copy = tmp_path / "e2e"
    shutil.copytree(trained_run.run_dir, copy)
    return copy


def test_resume_refuses_options_it_would_ignore_and_applies_epochs(trained_run, tmp_path: Path) -> None:
    from utils.train.config import train_config_from_argv
    from utils.train.plan import resolve_resume

    last = str(_copy_run(trained_run, tmp_path) / "weights" / "last.pt")
    allowed = (
        "--epochs, --batch-size, --patience, --callbacks, --mlflow, --wandb, --noplots, --device, --workers, "
        "--dist-timeout, --amp, --compile, --static-loss-shapes, --cuda-graph"
    )
    with pytest.raises(ConfigError, match=re.escape(f"--imgsz cannot be changed (allowed with --resume: {allowed})")):
        resolve_resume(train_config_from_argv(["--resume", last, "--imgsz", "128"]), DistContext())
    with pytest.raises(ConfigError, match="--label-smoothing cannot be changed"):
        resolve_resume(train_config_from_argv(["--resume", last, "--label-smoothing", "0.1"]), DistContext())
    resolve_resume(train_config_from_argv(["--resume", last, "--imgsz", "64"]), DistContext())  # the run's own value
    cfg, checkpoint = resolve_resume(train_config_from_argv(["--resume", last, "--epochs", "5"]), DistContext())
    assert cfg.epochs == 5 and cfg.imgsz == 64 and checkpoint["epoch"] == 1  # the run trained 2 of now 5 epochs
    cfg, _ = resolve_resume(train_config_from_argv(["--resume", last]), DistContext())
    assert (cfg.epochs, cfg.batch_size, cfg.noplots) == (2, 8, False)
    cfg, _ = resolve_resume(train_config_from_argv(["--resume", last, "--noplots"]), DistContext())
    assert (cfg.noplots, cfg.imgsz) == (True, 64)  # figures off for the rest of the run; what it trains is the same
    # The run's recipe is restored, never chosen again: auto asks for exactly that, another optimizer is refused.
    assert (cfg.optimizer, cfg.hyp_path, cfg.hyp) == ("AdamW", QUICKSTART_HYP, load_hyp(QUICKSTART_HYP))
    cfg, _ = resolve_resume(
        train_config_from_argv(["--resume", last, "--optimizer", "auto", "--hyp", "auto"]), DistContext()
    )
    assert (cfg.optimizer, cfg.hyp_path) == ("AdamW", QUICKSTART_HYP)
    with pytest.raises(ConfigError, match="--optimizer cannot be changed"):
        resolve_resume(train_config_from_argv(["--resume", last, "--optimizer", "SGD"]), DistContext())


def test_resumed_batch_is_checked_against_the_new_world_size(trained_run, tmp_path: Path) -> None:
    from utils.train.config import train_config_from_argv
    from utils.train.plan import resolve_resume

    last = str(_copy_run(trained_run, tmp_path) / "weights" / "last.pt")
    three_ranks = DistContext(rank=0, world_size=3)  # no process group: collectives are local no-ops
    with pytest.raises(ConfigError, match=r"the run's stored --batch-size 8 is not divisible by 3 processes; pass"):
        resolve_resume(train_config_from_argv(["--resume", last]), three_ranks)
    cfg, _ = resolve_resume(train_config_from_argv(["--resume", last, "--batch-size", "9"]), three_ranks)
    assert cfg.batch_size == 9


def _resume_from_own_folder(ctx: DistContext, node_dirs: list[str], relative_last: str) -> dict[str, object]:
    """A rank of test_resume_needs_the_run_folder_on_rank_0_only: resume `relative_last` from its own folder."""
    import os

    from utils.train.config import train_config_from_argv
    from utils.train.plan import resolve_resume

    os.chdir(node_dirs[ctx.rank])  # each rank's "node" has its own disk; only rank 0's holds the run
    cfg, checkpoint = resolve_resume(train_config_from_argv(["--resume", relative_last]), ctx)
    first = next(iter(checkpoint["model"].values()))
    return {"epoch": checkpoint["epoch"], "imgsz": cfg.imgsz, "tensor": first.float().sum().item()}


@pytest.mark.distributed
def test_resume_needs_the_run_folder_on_rank_0_only(trained_run, tmp_path: Path) -> None:
    from tests.dist_helpers import run_distributed

    node0, node1 = tmp_path / "node0", tmp_path / "node1"
    node1.mkdir(parents=True)
    _copy_run(trained_run, node0)  # node0/e2e/weights/last.pt; node1 has no such file
    results = run_distributed(
        _resume_from_own_folder, 2, tmp_path / "dist", [str(node0), str(node1)], "e2e/weights/last.pt"
    )
    assert results[0] == results[1] and results[0]["epoch"] == 1 and results[0]["imgsz"] == 64


def test_a_damaged_last_pt_falls_back_to_the_newest_intact_checkpoint(trained_run, tmp_path: Path, caplog) -> None:
    from utils.train.config import train_config_from_argv
    from utils.train.plan import resolve_resume

    weights = _copy_run(trained_run, tmp_path) / "weights"
    for later in weights.glob("epoch*.pt"):  # keep one intact fallback: epoch1.pt
        if later.name != "epoch1.pt":
            later.unlink()
    data = (weights / "last.pt").read_bytes()
    (weights / "last.pt").write_bytes(data[: len(data) // 2])  # e.g. a copy cut short
    cfg, checkpoint = resolve_resume(train_config_from_argv(["--resume", str(weights / "last.pt")]), DistContext())
    assert cfg.resume == str(weights / "epoch1.pt") and checkpoint["epoch"] == 0
    assert "resuming from" in caplog.text and "epoch1.pt" in caplog.text


def test_bf16_autocast_trains_with_finite_losses(tiny_data: Path, tmp_path: Path) -> None:
    result = train.main(_train_args(tiny_data, tmp_path, "bf16", "--epochs", "1", "--amp", "bf16", "--noplots"))
    [row] = _read_rows(result.run_dir / "results.csv")
    assert all(math.isfinite(float(row[key])) for key in row if key.startswith("train/"))
    checkpoint = torch.load(result.last, weights_only=True)
    assert checkpoint["scaler"] is None  # bf16 needs no loss scaling
    assert checkpoint["train_config"]["amp"] == "bf16"


@pytest.mark.slow
def test_an_early_stop_under_nosave_saves_its_epoch_and_a_reused_folder_starts_clean(
    tiny_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from utils.train.results import EarlyStopper

    earlier = train.main(_train_args(tiny_data, tmp_path, "reuse", "--epochs", "1", "--save-period", "1"))
    assert earlier.best.is_file() and (earlier.run_dir / "weights" / "epoch1.pt").is_file()
    assert list(earlier.run_dir.glob("*.png")) and len(list(earlier.run_dir.glob("events.out.tfevents*"))) == 1
    # The same folder again (--exist-ok) under --nosave, stopped early after its second of 4 epochs: that epoch is
    # saved as the final one, and nothing of the earlier run's weights is validated or reported as this run's.
    monkeypatch.setattr(EarlyStopper, "should_stop", lambda self, epoch, fitness: epoch == 1)
    flags = ("--epochs", "4", "--exist-ok", "--nosave", "--patience", "1", "--noplots")
    with caplog.at_level(logging.INFO):
        result = train.main(_train_args(tiny_data, tmp_path, "reuse", *flags))
    assert result.run_dir == earlier.run_dir and result.epochs_run == 2
    assert "removed the earlier run's last.pt, best.pt, epoch1.pt" in caplog.text
    assert sorted(path.name for path in (result.run_dir / "weights").iterdir()) == ["best.pt", "last.pt"]
    # Nor its figures (MLflow and W&B upload the folder's as this run's) or TensorBoard events (one run, not two).
    assert not list(result.run_dir.glob("*.png")) and not list(result.run_dir.glob("*.jpg"))
    assert len(list(result.run_dir.glob("events.out.tfevents*"))) == 1
    last = torch.load(result.last, map_location="cpu", weights_only=True)
    assert last["epoch"] == 1  # this run's stop epoch (0-based), resumable
    validated = torch.load(result.best, map_location="cpu", weights_only=True)
    assert validated["train_config"]["epochs"] == 4  # this run's weights, not the earlier 1-epoch run's


@pytest.mark.slow  # reaches the resume's planning, not its training
def test_resuming_a_finished_run_is_refused_before_anything_is_set_up(
    trained_run, caplog: pytest.LogCaptureFixture
) -> None:
    before = sorted(path.name for path in trained_run.run_dir.rglob("*"))
    message = f"--resume: {trained_run.run_dir} already finished 2 of --epochs 2; nothing to resume"
    with caplog.at_level(logging.INFO), pytest.raises(ConfigError, match=re.escape(message)):
        train.main(["--resume", str(trained_run.last), "--device", "cpu", "--workers", "0"])
    assert "Resuming" not in caplog.text
    with pytest.raises(ConfigError, match="already finished 2 of --epochs 1"):  # fewer epochs: as finished
        train.main(["--resume", str(trained_run.last), "--device", "cpu", "--workers", "0", "--epochs", "1"])
    assert sorted(path.name for path in trained_run.run_dir.rglob("*")) == before  # no TensorBoard file, no cache


def test_a_p6_model_trains_at_sides_rounded_to_64_and_val_loads_its_best(tiny_data: Path, tmp_path: Path) -> None:
    # yolov5n6's largest stride is 64: --imgsz 96 (a multiple of 32) becomes 128 with one warning, in train and val.
    handler = MessageRecorder()
    logging.getLogger("utils.config").addHandler(handler)
    try:
        argv = _train_args(tiny_data, tmp_path, "p6", "--epochs", "1", "--batch-size", "4", "--noplots")
        argv[argv.index("yolov5n")] = "yolov5n6"
        argv[argv.index("64")] = "96"
        result = train.main(argv)
        checkpoint = torch.load(result.best, map_location="cpu", weights_only=True)
        assert checkpoint["train_config"]["imgsz"] == 128 and len(checkpoint["model_spec"]["anchors"]) == 4
        assert all(math.isfinite(value) for value in result.metrics.values())
        val_argv = ["--weights", str(result.best), "--data", str(tiny_data), "--imgsz", "96", "--batch-size", "8"]
        scored = val.main([*val_argv, "--workers", "0", "--device", "cpu", "--project", str(tmp_path / "val")])
    finally:
        logging.getLogger("utils.config").removeHandler(handler)
    assert scored.num_images == TINY.num_val
    rounded = [message for message in handler.messages if "sides must be multiples of 64" in message]
    assert len(rounded) == 2 and all("--imgsz 96" in message and "using 128" in message for message in rounded)
