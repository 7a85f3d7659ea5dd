"""Tests for utils/checkpoint.py: bit-exact round trip, exact resume, rank-0 atomic save, clear load errors."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from utils.checkpoint import (
    FORMAT_VERSION,
    Checkpoint,
    RunInfo,
    build_checkpoint,
    check_checkpoint_task,
    find_last_checkpoint,
    git_hash,
    inference_weights,
    load_checkpoint,
    load_resume_checkpoint,
    plain_data,
    restore_training_state,
    save_checkpoint,
    strip_optimizer,
)
from utils.distributed import DistContext
from utils.errors import ConfigError
from utils.train.ema import ModelEMA
from utils.train.optim import build_optimizer

MAIN = DistContext()


@dataclasses.dataclass(frozen=True)
class _Config:
    """Stand-in for TrainConfig: a frozen dataclass with a path and a tuple."""

    data: Path = Path("data/synthetic.yaml")
    freeze: tuple[int, ...] = (0, 1)
    epochs: int = 3


class _Trainer:
    """A tiny model with BN, Nesterov SGD, an enabled CPU GradScaler and an EMA, trained on fixed batches."""

    def __init__(self, init_seed: int = 0) -> None:
        torch.manual_seed(init_seed)
        self.model = nn.Sequential(
            nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2)
        )
        self.optimizer = build_optimizer(self.model, "SGD", lr=0.05, momentum=0.9, weight_decay=1e-3)
        self.scaler = torch.amp.GradScaler("cpu", init_scale=256.0, growth_interval=2)
        self.ema = ModelEMA(self.model, decay=0.9, tau=2.0)

    def train(self, first_step: int, steps: int) -> None:
        """Run `steps` optimizer steps; batch `i` depends only on `i`, so runs are comparable."""
        self.model.train()
        for step in range(first_step, first_step + steps):
            generator = torch.Generator().manual_seed(step)
            images = torch.randn(4, 3, 8, 8, generator=generator)
            targets = torch.randn(4, 2, generator=generator)
            loss = ((self.model(images) - targets) ** 2).mean()
            self.optimizer.zero_grad()
            self.scaler.scale(loss).backward()
            self.scaler.step(self.optimizer)
            self.scaler.update()
            self.ema.update(self.model)

    def checkpoint(self, epoch: int) -> Checkpoint:
        run = RunInfo(
            task="detect",
            model_spec={"depth_multiple": 0.33, "anchors": ((10.0, 13.0),)},
            names=["a", "b"],
            train_config=_Config(),
            hyp={"lr0": 0.05},
        )
        return build_checkpoint(
            run=run,
            model=self.model,
            ema=self.ema,
            optimizer=self.optimizer,
            scaler=self.scaler,
            epoch=epoch,
            best_fitness=0.25,
        )


def _assert_same(a: Any, b: Any, where: str = "") -> None:
    """Recursively assert equality, tensors bit-exactly (values, dtype and shape)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), where
        for key in a:
            _assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for index, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{where}[{index}]")
    else:
        assert a == b, where


def test_round_trip_is_bit_exact_and_weights_only(tmp_path: Path) -> None:
    trainer = _Trainer()
    trainer.train(0, 3)
    state = trainer.checkpoint(epoch=2)
    assert state["optimizer"]["state"]  # momentum buffers exist
    path = tmp_path / "run" / "weights" / "last.pt"  # parents are created
    save_checkpoint(state, path, MAIN)
    loaded = load_checkpoint(path)
    raw = torch.load(path, weights_only=True)
    _assert_same(loaded, raw)
    for key in ("model", "ema", "optimizer", "scaler", "ema_updates", "epoch", "best_fitness", "names"):
        _assert_same(state[key], loaded[key], key)
    assert loaded["scaler"]["scale"] != 256.0  # the scaler has grown: its real state was saved
    assert loaded["ema_updates"] == 3 and loaded["epoch"] == 2
    assert loaded["format_version"] == FORMAT_VERSION and loaded["task"] == "detect"
    assert loaded["train_config"] == {"data": "data/synthetic.yaml", "freeze": [0, 1], "epochs": 3}
    assert loaded["model_spec"]["anchors"] == [[10.0, 13.0]]
    assert loaded["model"]["0.weight"].dtype == torch.float32
    assert os.listdir(path.parent) == ["last.pt"]
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask  # readable like any other file, not mkstemp's 0600


def test_resumed_run_continues_identically(tmp_path: Path) -> None:
    uninterrupted = _Trainer()
    uninterrupted.train(0, 3)
    path = tmp_path / "last.pt"
    save_checkpoint(uninterrupted.checkpoint(epoch=0), path, MAIN)
    uninterrupted.train(3, 2)

    resumed = _Trainer(init_seed=123)  # different initial weights: everything must come from the file
    start_epoch = restore_training_state(
        load_checkpoint(path, for_resume=True), resumed.model, resumed.optimizer, resumed.scaler, resumed.ema
    )
    assert start_epoch == 1
    resumed.train(3, 2)
    _assert_same(uninterrupted.model.state_dict(), resumed.model.state_dict(), "model")
    _assert_same(uninterrupted.ema.state_dict(), resumed.ema.state_dict(), "ema")
    _assert_same(uninterrupted.optimizer.state_dict(), resumed.optimizer.state_dict(), "optimizer")
    assert uninterrupted.scaler.state_dict() == resumed.scaler.state_dict()


def test_only_rank_zero_writes(tmp_path: Path) -> None:
    trainer = _Trainer()
    path = tmp_path / "weights" / "last.pt"
    other_rank = DistContext(rank=1, local_rank=1, world_size=2)
    save_checkpoint(trainer.checkpoint(epoch=0), path, other_rank)
    assert not path.parent.exists()
    save_checkpoint(trainer.checkpoint(epoch=0), path, MAIN)
    before = path.read_bytes()
    strip_optimizer(path, other_rank)
    assert path.read_bytes() == before


def test_crash_mid_save_keeps_previous_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    trainer = _Trainer()
    path = tmp_path / "last.pt"
    save_checkpoint(trainer.checkpoint(epoch=0), path, MAIN)
    before = path.read_bytes()

    def half_written_save(obj: Any, file: Any) -> None:
        file.write(b"PK\x03\x04 partial")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", half_written_save)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(trainer.checkpoint(epoch=1), path, MAIN)
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["last.pt"]  # no temp file left behind
    assert load_checkpoint(path)["epoch"] == 0


def test_save_refuses_values_weights_only_cannot_load(tmp_path: Path) -> None:
    state = _Trainer().checkpoint(epoch=0)
    state["train_config"]["data"] = Path("somewhere")
    with pytest.raises(TypeError, match=r"\['train_config'\]\['data'\] is a \w*Path"):
        save_checkpoint(state, tmp_path / "last.pt", MAIN)
    assert not (tmp_path / "last.pt").exists()


def test_torch_version_object_is_refused_but_git_hash_is_optional(tmp_path: Path) -> None:
    state = _Trainer().checkpoint(epoch=0)
    assert isinstance(state["torch_version"], str) and type(state["torch_version"]) is str
    state["torch_version"] = torch.__version__  # a TorchVersion (str subclass): weights-only loading refuses it
    with pytest.raises(TypeError, match="TorchVersion"):
        save_checkpoint(state, tmp_path / "last.pt", MAIN)
    state["torch_version"] = str(torch.__version__)
    del state["git_hash"]
    save_checkpoint(state, tmp_path / "last.pt", MAIN)
    assert "git_hash" not in load_checkpoint(tmp_path / "last.pt")


def test_plain_data_conversions() -> None:
    assert plain_data({"p": Path("a/b"), "t": (1, np.float32(0.5)), "c": _Config()}) == {
        "p": "a/b",
        "t": [1, 0.5],
        "c": {"data": "data/synthetic.yaml", "freeze": [0, 1], "epochs": 3},
    }
    with pytest.raises(TypeError, match="Linear"):
        plain_data({"model": nn.Linear(1, 1)})


def _write_bad_files(folder: Path) -> dict[str, Path]:
    good = folder / "good.pt"
    save_checkpoint(_Trainer().checkpoint(epoch=0), good, MAIN)
    files = {
        "garbage": b"this is not a checkpoint",
        "truncated": good.read_bytes()[: good.stat().st_size // 2],
        "empty": b"",
    }
    paths = {name: folder / f"{name}.pt" for name in files}
    for name, content in files.items():
        paths[name].write_bytes(content)
    torch.save(nn.Linear(2, 2), folder / "pickled_module.pt")  # what YOLOv5 .pt files look like
    torch.save({"model": {}}, folder / "foreign.pt")
    future = torch.load(good, weights_only=True)
    future["format_version"] = 99
    torch.save(future, folder / "future.pt")
    for name in ("pickled_module", "foreign", "future"):
        paths[name] = folder / f"{name}.pt"
    return paths


def test_bad_files_give_one_line_errors(tmp_path: Path) -> None:
    paths = _write_bad_files(tmp_path)
    expected = {
        "garbage": "cannot be read",
        "truncated": "cannot be read",
        "empty": "cannot be read",
        "pickled_module": "cannot be read",
        "foreign": "not a checkpoint",
        "future": "format_version 99",
    }
    for name, phrase in expected.items():
        with pytest.raises(ValueError) as error:
            load_checkpoint(paths[name])
        message = str(error.value)
        assert phrase in message and str(paths[name]) in message and "\n" not in message, (name, message)
    with pytest.raises(FileNotFoundError, match="missing.pt does not exist"):
        load_checkpoint(tmp_path / "missing.pt")


def test_folders_and_exported_models_are_named_as_such_not_as_missing_or_corrupt(tmp_path: Path) -> None:
    run = tmp_path / "exp"
    (run / "weights").mkdir(parents=True)
    last = run / "weights" / "last.pt"
    last.write_bytes(b"")
    onnx = tmp_path / "best.onnx"
    onnx.write_bytes(b"\x08\x07onnx")
    openvino = tmp_path / "best_openvino_model"
    openvino.mkdir()
    (openvino / "best.xml").write_text("<net/>")
    empty = tmp_path / "empty"
    empty.mkdir()
    expected = {
        run: f"checkpoint {run} is a folder, not a checkpoint file; give a checkpoint in it, e.g. {last}",
        empty: f"checkpoint {empty} is a folder, not a checkpoint file; give a .pt checkpoint file",
        onnx: f"checkpoint {onnx} is an exported ONNX model, not a .pt checkpoint; give the .pt checkpoint it was",
        openvino: f"checkpoint {openvino} is an exported OpenVINO model folder, not a .pt checkpoint",
    }
    for path, message in expected.items():
        with pytest.raises(ConfigError) as error:
            load_checkpoint(path)
        assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_resume_of_a_run_folder_names_its_last_pt_and_takes_no_fallback(tmp_path: Path) -> None:
    trainer = _Trainer()
    run = tmp_path / "exp"
    save_checkpoint(trainer.checkpoint(epoch=0), tmp_path / "other.pt", MAIN)  # beside the folder: no fallback
    (run / "weights").mkdir(parents=True)
    save_checkpoint(trainer.checkpoint(epoch=0), run / "weights" / "last.pt", MAIN)
    with pytest.raises(ConfigError) as error:
        load_resume_checkpoint(run)
    wanted = f"--resume {run} is a folder, not a checkpoint file; give a checkpoint in it, e.g. {run}/weights/last.pt"
    assert str(error.value) == wanted


def test_strip_optimizer_keeps_fp16_ema_weights(tmp_path: Path) -> None:
    trainer = _Trainer()
    trainer.train(0, 2)
    path = tmp_path / "best.pt"
    save_checkpoint(trainer.checkpoint(epoch=1), path, MAIN)
    size_before = path.stat().st_size
    strip_optimizer(path, MAIN)
    stripped = load_checkpoint(path)
    assert stripped["optimizer"] is None and stripped["scaler"] is None
    assert path.stat().st_size < size_before
    storages = [name for name in zipfile.ZipFile(path).namelist() if "/data/" in name and not name.endswith(".pkl")]
    assert len(storages) == len(stripped["model"])  # `model` and `ema` share storage: the weights are stored once
    ema_state = trainer.ema.state_dict()
    _assert_same(stripped["model"], stripped["ema"])
    _assert_same(inference_weights(stripped), stripped["ema"])
    for key, value in stripped["model"].items():
        if ema_state[key].is_floating_point():
            assert value.dtype == torch.float16
            assert torch.equal(value, ema_state[key].half()), key
        else:
            assert torch.equal(value, ema_state[key]), key  # integer buffers unchanged
    fresh = _Trainer(init_seed=7).model
    fresh.load_state_dict(stripped["model"])  # fp16 storage loads into an fp32 model
    assert fresh[0].weight.dtype == torch.float32
    with pytest.raises(ValueError, match="resume from a last.pt"):
        load_checkpoint(path, for_resume=True)


def test_find_last_checkpoint(tmp_path: Path) -> None:
    assert find_last_checkpoint(tmp_path) is None
    older = tmp_path / "train" / "exp" / "weights" / "last.pt"
    newer = tmp_path / "train" / "exp2" / "weights" / "last.pt"
    for index, path in enumerate((newer, older)):
        path.parent.mkdir(parents=True)
        path.write_bytes(b"x")
        os.utime(path, (1000 - index, 1000 - index))
    (tmp_path / "train" / "exp2" / "weights" / "best.pt").write_bytes(b"x")
    assert find_last_checkpoint(tmp_path) == newer


def test_git_hash_reads_loose_packed_and_detached_heads(tmp_path: Path) -> None:
    git_dir = tmp_path / ".git"
    (git_dir / "refs" / "heads").mkdir(parents=True)
    (git_dir / "HEAD").write_text("ref: refs/heads/main\n")
    assert git_hash(tmp_path) is None  # no commit yet
    (git_dir / "packed-refs").write_text("# pack-refs\n" + "b" * 40 + " refs/heads/main\n")
    git_hash.cache_clear()
    assert git_hash(tmp_path) == "b" * 40
    (git_dir / "refs" / "heads" / "main").write_text("a" * 40 + "\n")
    git_hash.cache_clear()
    assert git_hash(tmp_path) == "a" * 40
    (git_dir / "HEAD").write_text("c" * 40 + "\n")
    git_hash.cache_clear()
    assert git_hash(tmp_path) == "c" * 40
    git_hash.cache_clear()
    assert git_hash(tmp_path / "elsewhere") is None
    # A worktree: `.git` is a file naming its git folder, whose HEAD names a ref of the common folder.
    worktree, own = tmp_path / "tree", git_dir / "worktrees" / "tree"
    own.mkdir(parents=True)
    worktree.mkdir()
    (worktree / ".git").write_text(f"gitdir: {own}\n")
    (own / "HEAD").write_text("ref: refs/heads/main\n")
    (own / "commondir").write_text("../..\n")
    git_hash.cache_clear()
    assert git_hash(worktree) == "a" * 40


def test_git_hash_of_this_checkout_is_its_commit() -> None:
    root = Path(__file__).resolve().parents[1]
    if not (root / ".git").exists():
        pytest.skip("not a git checkout")
    git_hash.cache_clear()
    head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, check=False)
    if head.returncode != 0:
        pytest.skip("git is not available")
    assert git_hash() == head.stdout.strip()  # the default is this repository (a checkpoint's git_hash)
    git_hash.cache_clear()


@pytest.mark.parametrize(
    ("stored", "wanted", "script", "entry"),
    [
        ("segment", "detect", "val", "segment/val.py"),
        ("detect", "segment", "train", "train.py"),
        ("segment", "detect", "predict", "segment/predict.py"),
        ("detect", "segment", "predict", "detect.py"),
    ],
)
def test_checkpoint_of_another_task_is_refused_naming_the_right_script(stored, wanted, script, entry) -> None:
    ckpt = _Trainer().checkpoint(epoch=0)
    ckpt["task"] = stored
    with pytest.raises(ConfigError, match=f"w.pt is a {stored} checkpoint, not a {wanted} one; use {entry}"):
        check_checkpoint_task(ckpt, wanted, "w.pt", script)
    check_checkpoint_task(ckpt, stored, "w.pt", script)  # the same task passes


def test_stale_temp_files_of_killed_saves_are_removed(tmp_path: Path) -> None:
    from utils.checkpoint import remove_stale_temp_files

    (tmp_path / ".last.pt.1234.tmp").write_bytes(b"half a checkpoint")
    (tmp_path / "last.pt").write_bytes(b"kept")
    removed = remove_stale_temp_files(tmp_path)
    assert [p.name for p in removed] == [".last.pt.1234.tmp"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.pt"]
