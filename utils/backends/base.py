"""The inference backend seam: one interface for a model however it is stored (checkpoint, TorchScript, ONNX)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from utils.config import stride_multiples
from utils.distributed import unwrap_model
from utils.errors import ConfigError
from utils.families import decodes_end_to_end, family_named, family_of


@dataclass(frozen=True)
class BackendInfo:
    """What a loaded model says about itself: from a checkpoint, or from the metadata export.py wrote in a file.

    `imgsz` is the size to run at when no --imgsz is given (a checkpoint's trained size, a file's traced
    size); with `fixed_shape` it is the only size the file runs. `batch` is the one batch size the
    file runs, None when any works (the backend still runs any batch: see ExportedBackend).
    """

    path: Path | None  # None for a live model (training's evaluation)
    file_format: str  # "pytorch" | "torchscript" | "onnx" | "openvino" | "engine"
    task: str  # "detect" | "segment"
    family: str  # a model family name (utils/families.py)
    layout: str  # output0 as the file stores it (utils/backends/metadata.py: LAYOUTS); "rows" for a checkpoint
    names: tuple[str, ...]  # class names, index = class id; () for a live model
    imgsz: tuple[int, int]  # (height, width)
    fixed_shape: bool
    batch: int | None
    dtype: torch.dtype  # the input's dtype
    stride: int  # the largest model stride: input sides are multiples of it
    num_masks: int  # mask coefficients per row (0 for detection)
    end_to_end: bool  # rows need only the top scores (an end-to-end head), not NMS
    precision: str = "fp32"  # what computes inside: "fp32" | "fp16" | "int8" (an INT8 or FP16 IR takes FP32 input)
    trained_data: Path | None = None  # the dataset YAML a checkpoint of ours was trained on, as it recorded it


@dataclass(frozen=True)
class BackendRequest:
    """What the entry point asks of the model it loads; a backend that cannot give it refuses in one line."""

    task: str | None  # "detect" | "segment"; None (torch.hub) takes either
    script: str  # "val" | "predict" | "hub": the entry point, named in a wrong-task error
    device: torch.device
    half: bool = False  # fp16 inference (--half)
    channels_last: bool = True  # checkpoints only: NHWC memory layout
    nms: bool = False  # --nms: an end-to-end model's one-to-many head and NMS
    augment: bool = False  # --augment: test-time augmentation (utils/backends/augmented.py), detection only

    @classmethod
    def from_flags(cls, flags: Any, task: str, script: str, device: torch.device) -> BackendRequest:
        """The request of an entry point whose options (`flags`: ValConfig, PredictConfig) carry the inference flags."""
        inference = {name: getattr(flags, name) for name in ("half", "channels_last", "nms", "augment")}
        return cls(task=task, script=script, device=device, **inference)


class InferenceBackend(nn.Module):
    """A model ready for inference: images in, the eval model's outputs out, the same for every storage format.

    forward(images (B, 3, H, W) in [0, 1], `info.dtype`, on `device`) returns what a checkpoint's eval
    model returns: (decoded (B, N, no) rows in the ROWS layout, extra). For segmentation extra[1] is
    the prototypes (B, nm, H/4, W/4); a checkpoint's extra is its whole raw output (what the loss
    takes), an exported file's is (None, protos) or None. Detection selection (NMS, or an end-to-end
    head's top scores) is not part of it: every backend's rows go through the same `selector()`.
    H and W are multiples of `info.stride`, and `info.imgsz` when `info.fixed_shape`.
    """

    def __init__(self, info: BackendInfo) -> None:
        super().__init__()
        self.info = info

    @property
    def device(self) -> torch.device:
        """Where inputs go."""
        raise NotImplementedError

    @property
    def dtype(self) -> torch.dtype:
        """The dtype inputs must have."""
        return self.info.dtype

    def selector(self) -> Callable[..., list[torch.Tensor]]:
        """The family's detection selector for these rows (non_max_suppression's arguments and result)."""
        return family_named(self.info.family).detection_selector(self.info.end_to_end)


class ModuleBackend(InferenceBackend):
    """A PyTorch model in memory: a loaded checkpoint, a hub model, or the model training evaluates.

    The model is a submodule, so `eval()` / `train()` reach it, and its outputs pass through untouched
    (the raw part feeds training's validation loss). Device and dtype are read from its weights at
    each call, as the model may move.
    """

    def __init__(self, model: nn.Module, info: BackendInfo) -> None:
        super().__init__(info)
        self.model = model
        self.training = model.training  # the wrapper reports, and evaluate() restores, the model's own mode

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def selector(self) -> Callable[..., list[torch.Tensor]]:
        # Read from the model now: --nms (force_nms) or a caller may switch its head after loading.
        return family_of(self.model).detection_selector(decodes_end_to_end(self.model))

    def forward(self, images: torch.Tensor) -> Any:
        """The model's eval output (see InferenceBackend)."""
        return self.model(images)


def module_info(model: nn.Module, **known: Any) -> BackendInfo:
    """The BackendInfo of a PyTorch model; `known` fills what the model cannot say (path, task, names, imgsz)."""
    target = unwrap_model(model)
    parameter = next(target.parameters())
    fields: dict[str, Any] = {
        "path": None, "file_format": "pytorch", "task": "segment" if target.head.num_masks else "detect",
        "family": family_of(target).name, "layout": "rows", "names": (), "imgsz": (640, 640), "fixed_shape": False,
        "batch": None, "dtype": parameter.dtype, "stride": int(target.stride.max()),
        "num_masks": int(target.head.num_masks), "end_to_end": decodes_end_to_end(target),
        "precision": "fp16" if parameter.dtype == torch.float16 else "fp32",
    }  # fmt: skip
    return BackendInfo(**{**fields, **known})


def as_backend(model: nn.Module) -> InferenceBackend:
    """`model` itself when it is a backend, else a ModuleBackend around it (a live model: training, hub sizes)."""
    if isinstance(model, InferenceBackend):
        return model
    return ModuleBackend(model, module_info(model))


def resolve_imgsz(info: BackendInfo, requested: tuple[int, int] | None, flag: str = "--imgsz") -> tuple[int, int]:
    """The (h, w) to run at: `requested` (--imgsz), else `info.imgsz`.

    `requested` is rounded up to multiples of the model's largest stride (`info.stride`: 64 for a
    YOLOv5 P6 model) with one warning naming `flag`. A fixed-shape file runs only its own size:
    another --imgsz is a one-line ConfigError naming the file and the fix.
    """
    if requested is None:
        return info.imgsz
    requested = stride_multiples(requested, flag, info.stride)  # type: ignore[assignment]
    if info.fixed_shape and tuple(requested) != info.imgsz:
        given, fixed = "x".join(map(str, requested)), "x".join(map(str, info.imgsz))
        raise ConfigError(
            f"{info.path}: exported at a fixed {fixed}, cannot run --imgsz {given}; omit --imgsz, "
            f"or export again with --imgsz {' '.join(map(str, requested))} or --dynamic"
        )
    return tuple(requested)  # type: ignore[return-value]
