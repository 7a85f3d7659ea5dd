"""Checkpoint schema, rank-0 atomic save, safe (weights-only) load, resume and final stripping."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import logging
import os
import re
import zipfile
from collections.abc import Mapping
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

import numpy as np
import torch
from torch import nn

from utils.distributed import DistContext, unwrap_model
from utils.errors import ConfigError

if TYPE_CHECKING:
    from utils.train.ema import ModelEMA

LOGGER = logging.getLogger(__name__)

# Bump when the schema changes incompatibly; load_checkpoint refuses versions it does not know.
FORMAT_VERSION = 1
SUPPORTED_VERSIONS = (1,)
TASKS = ("detect", "segment")
REPO_ROOT = Path(__file__).resolve().parent.parent  # utils/checkpoint.py -> the repository


class _RequiredCheckpoint(TypedDict):
    format_version: int
    task: str  # "detect" | "segment"
    model_spec: dict[str, Any]  # ModelSpec.to_dict()
    names: list[str]  # class names, index = class id
    model: dict[str, torch.Tensor]
    ema: dict[str, torch.Tensor] | None  # None only for a run without EMA
    ema_updates: int
    optimizer: dict[str, Any] | None
    scaler: dict[str, Any] | None  # None when AMP is off
    epoch: int
    best_fitness: float
    train_config: dict[str, Any]  # TrainConfig.to_dict(): resolved options, paths as strings
    hyp: dict[str, float]
    date: str  # ISO 8601
    torch_version: str  # str(torch.__version__): the TorchVersion object would not load weights-only


class Checkpoint(_RequiredCheckpoint, total=False):
    """What a .pt file holds: plain Python data and state dicts only, so torch.load(weights_only=True) reads it.

    `epoch` is the last *completed* epoch (0-based); a resume starts at `epoch + 1`.
    `model` is the raw model in fp32 (exact resume), `ema` the averaged weights that
    validation uses, `ema_updates` the EMA's update count. `git_hash` is optional.
    A stripped final checkpoint (`strip_optimizer`) has `optimizer` and `scaler` None and
    the EMA weights in fp16 as both `model` and `ema`: it is for inference, not resume.
    """

    git_hash: str | None
    model_family: str  # utils/families.py: which family's spec `model_spec` is; absent in older files = "yolov5"
    # Mid-epoch checkpoints only: batches of epoch + 1 already trained, and per rank (index = rank)
    # {"mean_loss": [...], "model_buffers": {...}, "ema_buffers": {...}} to continue exactly.
    batches_done: int
    rank_states: list[dict[str, Any]]
    callback_state: dict[str, Any]  # utils/callbacks.py: Callbacks.state, given back on resume
    early_stop: dict[str, Any]  # --patience's record: {"best_fitness", "best_epoch"} (utils/train/results.py)
    job: str  # the torchrun job (rendezvous id) whose run wrote it; "" outside torchrun


REQUIRED_KEYS = tuple(sorted(Checkpoint.__required_keys__))


@dataclasses.dataclass(frozen=True)
class RunInfo:
    """The parts of a checkpoint fixed for the whole run (task, model description, options)."""

    task: str
    model_spec: dict[str, Any]
    names: list[str]
    train_config: Any  # TrainConfig (converted with plain_data) or a plain dict
    hyp: Any  # Hyp or a plain dict
    model_family: str = "yolov5"  # the family whose spec `model_spec` is (utils/families.py)


def plain_data(value: Any) -> Any:
    """Convert `value` to data torch.load(weights_only=True) accepts: dicts, lists, str, numbers, None, tensors.

    Objects with `to_dict()` and dataclasses become dicts, paths strings, enums their value,
    tuples lists, numpy scalars/arrays Python numbers/lists, subclasses of str/int/float
    their base type. Anything else raises TypeError.
    """
    if value is None or isinstance(value, torch.Tensor):
        return value
    if isinstance(value, Enum):
        return plain_data(value.value)
    for base in (bool, int, float, str):  # also turns subclasses (torch's TorchVersion is a str) into the base
        if isinstance(value, base):
            return base(value)
    if hasattr(value, "to_dict"):
        return plain_data(value.to_dict())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return plain_data(dataclasses.asdict(value))
    if isinstance(value, Mapping):
        return {str(key): plain_data(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain_data(item) for item in value]
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, (np.generic, np.ndarray)):
        return value.tolist()
    raise TypeError(f"cannot store a value of type {type(value).__name__} in a checkpoint; convert it to plain data")


@functools.lru_cache(maxsize=1)
def git_hash(repo: Path = REPO_ROOT) -> str | None:
    """Return the checked-out commit of `repo`, or None outside a git checkout or before the first commit.

    Reads `.git/HEAD` and the ref it names (loose or packed) directly, so saving a
    checkpoint never starts a subprocess. A worktree or submodule, whose `.git` is a file naming
    its git folder, reads HEAD there and the refs in the repository's common folder.
    """
    git_dir = repo / ".git"
    try:
        if git_dir.is_file():  # "gitdir: <path>" (git worktree, submodule)
            git_dir = repo / git_dir.read_text().strip().removeprefix("gitdir:").strip()
        common = git_dir / (git_dir / "commondir").read_text().strip() if (git_dir / "commondir").is_file() else git_dir
        head = (git_dir / "HEAD").read_text().strip()
        if not head.startswith("ref: "):
            return head or None  # detached HEAD holds the hash itself
        ref = head[len("ref: ") :]
        for folder in (git_dir, common):
            if (folder / ref).is_file():
                return (folder / ref).read_text().strip() or None
        packed = (common / "packed-refs").read_text() if (common / "packed-refs").is_file() else ""
    except OSError:
        return None
    for line in packed.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1] == ref:
            return parts[0]
    return None


def build_checkpoint(
    *,
    run: RunInfo,
    model: nn.Module,
    ema: ModelEMA | None,
    optimizer: torch.optim.Optimizer | None,
    scaler: torch.amp.GradScaler | None,
    epoch: int,
    best_fitness: float,
) -> Checkpoint:
    """Assemble a Checkpoint from the live training objects (DDP wrappers are unwrapped).

    State dicts reference the live tensors, so save it at once. A disabled GradScaler is
    stored as None. `epoch` is the epoch just completed.
    """
    use_scaler = scaler is not None and scaler.is_enabled()
    return Checkpoint(
        format_version=FORMAT_VERSION,
        task=run.task,
        model_family=run.model_family,
        model_spec=plain_data(run.model_spec),
        names=[str(name) for name in run.names],
        model=unwrap_model(model).state_dict(),
        ema=ema.state_dict() if ema is not None else None,
        ema_updates=ema.updates if ema is not None else 0,
        optimizer=optimizer.state_dict() if optimizer is not None else None,
        scaler=scaler.state_dict() if use_scaler else None,
        epoch=int(epoch),
        best_fitness=float(best_fitness),
        train_config=plain_data(run.train_config),
        hyp=plain_data(run.hyp),
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        torch_version=str(torch.__version__),  # a TorchVersion object would not load weights-only
        git_hash=git_hash(),
    )


def _check_plain(value: Any, where: str) -> None:
    """Raise TypeError naming the key path of the first value weights-only loading would refuse."""
    # Exact types: a subclass of str or int pickles as its class, which weights-only loading refuses.
    if value is None or type(value) in (bool, int, float, str) or isinstance(value, (torch.Tensor, torch.dtype)):
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if type(key) not in (str, int):
                raise TypeError(f"checkpoint key {where}[{key!r}] is a {type(key).__name__}; keys must be str or int")
            _check_plain(item, f"{where}[{key!r}]")
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _check_plain(item, f"{where}[{index}]")
    else:
        raise TypeError(f"checkpoint value {where} is a {type(value).__name__}; store plain data (see plain_data)")


def save_checkpoint(state: Checkpoint, path: Path, ctx: DistContext) -> None:
    """Write `state` to `path` on rank 0; other ranks return at once (no collective inside).

    The file is written to a temp file in the same folder, fsync'ed, then renamed over
    `path` with os.replace, so a crash leaves either the old or the new file, never a
    truncated one; on an exception the temp file is removed. Parent folders are created.
    Values that weights-only loading would refuse (modules, dataclasses, paths) raise
    TypeError before anything is written.
    """
    if not ctx.is_main:
        return
    _check_plain(dict(state), "state")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Hidden, per-process name in the same folder (os.replace is atomic only within a file system);
    # plain open() keeps the usual umask permissions, unlike mkstemp's 0600.
    tmp_path = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp_path, "wb") as file:
            torch.save(state, file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp_path, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp_path)
        raise
    _fsync_dir(path.parent)


def _fsync_dir(folder: Path) -> None:
    """Persist the rename itself (POSIX); silently skipped where folders cannot be opened."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# What export.py writes, by suffix: given where a .pt checkpoint is needed, these get their own message.
EXPORTED_SUFFIXES = {".onnx": "ONNX", ".torchscript": "TorchScript", ".engine": "TensorRT", ".xml": "OpenVINO"}
_NEEDS_PT = "give the .pt checkpoint it was exported from (e.g. weights/best.pt)"


def checkpoint_path_problem(path: Path) -> str | None:
    """Why `path` cannot be a .pt checkpoint although it exists (a folder, an exported model), or None.

    The words complete a sentence naming the path ("checkpoint X ...", "--weights X ..."). Without
    them a run folder reads as "does not exist" and an .onnx file as "corrupt or truncated",
    both of which send the user looking for the wrong fault. A missing path gives None: the
    caller's "not found" says it.
    """
    if path.is_dir():
        if any(path.glob("*.xml")):
            return f"is an exported OpenVINO model folder, not a .pt checkpoint; {_NEEDS_PT}"
        inside = [path / "weights" / "last.pt", path / "last.pt"]
        found = next((candidate for candidate in inside if candidate.is_file()), None)
        hint = f"give a checkpoint in it, e.g. {found}" if found else "give a .pt checkpoint file"
        return f"is a folder, not a checkpoint file; {hint}"
    kind = EXPORTED_SUFFIXES.get(path.suffix.lower())
    if kind is not None and path.is_file():
        return f"is an exported {kind} model, not a .pt checkpoint; {_NEEDS_PT}"
    return None


def load_checkpoint(path: Path | str, map_location: str | torch.device = "cpu", for_resume: bool = False) -> Checkpoint:
    """Read and validate a checkpoint with torch.load(weights_only=True); any rank may call it.

    Raises FileNotFoundError for a missing file and ConfigError (a ValueError; one line naming the
    file, which the entry points print as one error line) for a folder, an exported model, a file
    that is not readable, not one of our checkpoints, of an unknown format_version, or, with
    `for_resume`, stripped of its optimizer state.
    """
    path = Path(path)
    problem = checkpoint_path_problem(path)
    if problem is not None:
        raise ConfigError(f"checkpoint {path} {problem}")
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    if not zipfile.is_zipfile(path):
        raise ConfigError(f"checkpoint {path} cannot be read: not a PyTorch zip archive (corrupt or truncated)")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as error:  # corrupt zip, truncated file, pickled objects: all mean "not loadable"
        reason = _first_useful_line(error)
        if FOREIGN_MODEL_CLASS.search(reason):  # YOLOv5's or Ultralytics' pickled model
            raise ConfigError(
                f"checkpoint {path} is a YOLOv5 / Ultralytics checkpoint ({reason}): "
                f"fine-tune from it with --weights {path}; its run cannot be resumed here"
            ) from error
        raise ConfigError(
            f"checkpoint {path} cannot be read safely (corrupt, or not written by this project): {reason}"
        ) from error
    if not isinstance(state, dict) or "format_version" not in state:
        raise ConfigError(f"checkpoint {path} is not a checkpoint of this project (no format_version)")
    if state["format_version"] not in SUPPORTED_VERSIONS:
        raise ConfigError(
            f"checkpoint {path} has format_version {state['format_version']!r}; this code reads {SUPPORTED_VERSIONS}"
        )
    missing = [key for key in REQUIRED_KEYS if key not in state]
    if missing:
        raise ConfigError(f"checkpoint {path} lacks key(s) {', '.join(missing)}; the file is damaged or incomplete")
    if state["task"] not in TASKS:
        raise ConfigError(f"checkpoint {path} has unknown task {state['task']!r}; expected one of {TASKS}")
    if for_resume and state["optimizer"] is None:
        raise ConfigError(f"checkpoint {path} holds final weights without optimizer state; resume from a last.pt")
    return state  # type: ignore[return-value]


# The entry points of each job: (detection's, segmentation's).
ENTRY_SCRIPTS = {
    "train": ("train.py", "segment/train.py"),
    "val": ("val.py", "segment/val.py"),
    "predict": ("detect.py", "segment/predict.py"),
}


def check_checkpoint_task(ckpt: Checkpoint, task_name: str, path: Path | str, script: str) -> None:
    """Raise a one-line ConfigError when `ckpt` was trained for another task than `task_name`.

    `script` is "train", "val" or "predict": the message names the entry point that takes this
    checkpoint (a segmentation checkpoint given to val.py points at segment/val.py, one given to
    detect.py at segment/predict.py, and so on).
    """
    stored = ckpt["task"]
    if stored != task_name:
        entry = ENTRY_SCRIPTS[script][stored == "segment"]
        raise ConfigError(f"{path} is a {stored} checkpoint, not a {task_name} one; use {entry}")


# A pickled model class of YOLOv5 (models.yolo.DetectionModel) or Ultralytics (ultralytics.nn.tasks...) named by
# torch's safe unpickler: such a file fine-tunes through --weights (utils/safe_pickle.py), it never resumes.
FOREIGN_MODEL_CLASS = re.compile(r"GLOBAL (models\.(yolo|common)|ultralytics)\.")


def _first_useful_line(error: Exception) -> str:
    """Return the informative line of a torch.load error (the unpickler's reason, not its advice)."""
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line).strip() for line in str(error).splitlines()]
    lines = [line for line in lines if line]
    for i, line in enumerate(lines):
        if "WeightsUnpickler error" in line:
            following = lines[i + 1] if i + 1 < len(lines) else ""
            detail = line.split("WeightsUnpickler error:", 1)[-1].strip() or following
            detail = detail.split(" Please use", 1)[0].strip()  # torch's advice to allow the class: not ours to give
            return f"WeightsUnpickler error: {detail}"[:200]
    return (lines[0] if lines else type(error).__name__)[:200]


def restore_training_state(
    ckpt: Checkpoint,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler | None,
    ema: ModelEMA | None,
) -> int:
    """Load model, optimizer, scaler and EMA from `ckpt` in place and return the epoch to start at.

    Every rank calls it (each loads the same file), so DDP starts from identical weights.
    Build the optimizer with the same model and options first: group order and sizes must
    match. A scaler saved as None (AMP off) leaves `scaler` as it is.
    """
    unwrap_model(model).load_state_dict(ckpt["model"])
    if ckpt["optimizer"] is not None:
        optimizer.load_state_dict(ckpt["optimizer"])
    if scaler is not None and ckpt["scaler"] is not None:
        scaler.load_state_dict(ckpt["scaler"])
    if ema is not None and ckpt["ema"] is not None:
        ema.load_state_dict(ckpt["ema"], ckpt["ema_updates"])
    return ckpt["epoch"] + 1


# Converted YOLOv5 / Ultralytics weights record no training size; both projects train at 640 by default.
UNRECORDED_IMGSZ = 640


def trained_imgsz(ckpt: Mapping[str, Any]) -> int:
    """Return the image size `ckpt` was trained at: what val, detect, export and the hub model use without --imgsz.

    Our checkpoints record it in `train_config` (TrainConfig.imgsz). A model predicts best at the
    size it learned its object scales at, and a 224-px model run at 640 px finds shapes that are
    not there and takes 8x the time. Files without a usable record (converted YOLOv5 / Ultralytics
    weights, hand-built checkpoints) give UNRECORDED_IMGSZ.
    """
    imgsz = (ckpt.get("train_config") or {}).get("imgsz")
    if isinstance(imgsz, int) and not isinstance(imgsz, bool) and imgsz >= 32 and imgsz % 32 == 0:
        return imgsz
    return UNRECORDED_IMGSZ


def inference_weights(ckpt: Checkpoint) -> dict[str, torch.Tensor]:
    """Return the weights to evaluate or deploy: the EMA when the checkpoint has one, else `model`."""
    return ckpt["ema"] if ckpt["ema"] is not None else ckpt["model"]


def strip_optimizer(path: Path, ctx: DistContext) -> None:
    """Rewrite `path` on rank 0 as final inference weights: the EMA in fp16, no optimizer or scaler.

    `model` and `ema` both become the fp16 EMA weights (the same tensors, which torch.save
    stores once), so readers of either key get the weights that were validated; the file
    shrinks several times. fp16 is only the storage format: `model.load_state_dict` casts
    back to the model's dtype; integer buffers keep theirs. The result loads with
    `load_checkpoint` but refuses `for_resume`.
    """
    if not ctx.is_main:
        return
    ckpt = load_checkpoint(path)
    weights = {
        key: value.half() if value.is_floating_point() else value for key, value in inference_weights(ckpt).items()
    }
    ckpt.update(model=weights, ema=weights, optimizer=None, scaler=None)
    save_checkpoint(ckpt, path, ctx)
    LOGGER.info("stripped optimizer from %s (%.1f MB)", path, path.stat().st_size / 1e6)


def load_resume_checkpoint(path: Path) -> tuple[Path, Checkpoint]:
    """Load `path` for --resume; when it is damaged, fall back to the newest intact checkpoint beside it.

    A kill during a save cannot truncate `last.pt` (saves are atomic), but a disk error or a
    copy can. The fallback candidates are the run's other resumable checkpoints in
    `weights/` (epochN.pt, newest first by modification time); choosing one is a warning
    naming both files. Raises the original error when none loads (and FileNotFoundError for
    a missing `path`). Call it on one rank and broadcast the choice.
    """
    problem = checkpoint_path_problem(path)
    if problem is not None:  # a wrong path, not a damaged file: its neighbours are no fallback
        raise ConfigError(f"--resume {path} {problem}")
    try:
        return path, load_checkpoint(path, for_resume=True)
    except ConfigError as error:
        damaged = error
    siblings = [p for p in path.parent.glob("*.pt") if p.name != path.name and not p.name.startswith(".")]
    for candidate in sorted(siblings, key=lambda p: p.stat().st_mtime, reverse=True):
        try:
            checkpoint = load_checkpoint(candidate, for_resume=True)
        except ConfigError:
            continue
        LOGGER.warning(f"{damaged}; resuming from {candidate} (epoch {checkpoint['epoch'] + 1}) instead")
        return candidate, checkpoint
    raise damaged


def remove_stale_temp_files(folder: Path) -> list[Path]:
    """Delete the hidden temp files of saves that were killed midway (`.name.pid.tmp`); return what was removed.

    Call on rank 0 at the start of a run, before any save of this run can be in flight.
    """
    removed = []
    for tmp in folder.glob(".*.tmp"):
        with contextlib.suppress(OSError):
            tmp.unlink()
            removed.append(tmp)
    if removed:
        LOGGER.info(f"removed {len(removed)} temp file(s) of interrupted saves in {folder}")
    return removed


def find_last_checkpoint(search_dir: Path | str) -> Path | None:
    """Return the most recently modified `last.pt` anywhere under `search_dir`, or None (for bare --resume)."""
    candidates = list(Path(search_dir).rglob("last.pt"))
    return max(candidates, key=lambda candidate: candidate.stat().st_mtime) if candidates else None
