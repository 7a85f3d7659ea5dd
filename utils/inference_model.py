"""Load a checkpoint or foreign weights into an inference-ready model: what the checkpoint backend and export share."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from models.model_info import memory_format
from utils import checkpoint as ckpt_io
from utils.convert import load_weights
from utils.families import build_model, decodes_end_to_end, family_of, spec_from_checkpoint

LOGGER = logging.getLogger(__name__)


def load_inference_model(
    path: Path | str,
    task_name: str,
    device: torch.device,
    half: bool = False,
    channels_last: bool = True,
    nms: bool = False,
    script: str = "val",
) -> tuple[nn.Module, dict[str, Any]]:
    """Build the model stored in checkpoint `path` for inference on `device`; return it with the checkpoint.

    A YOLOv5 / Ultralytics .pt is converted in memory (utils/convert.py). A checkpoint of another
    task than `task_name` (segment vs detect) is a one-line ConfigError naming the `script` ("val" or
    "predict") that takes it. See `inference_model` for the rest.
    """
    checkpoint = load_weights(path)
    ckpt_io.check_checkpoint_task(checkpoint, task_name, path, script)
    return inference_model(checkpoint, device, half, channels_last, nms), checkpoint


def inference_model(
    checkpoint: dict[str, Any],
    device: torch.device,
    half: bool = False,
    channels_last: bool = True,
    nms: bool = False,
) -> nn.Module:
    """The inference model of a loaded checkpoint: EMA weights (or raw ones), fused, eval mode, on `device`.

    Laid out NHWC when `channels_last` (see memory_format); fp16 with `half` on CUDA (ignored elsewhere).
    `nms` (--nms) makes an end-to-end model decode its one-to-many head, for NMS, as other models do;
    for any other model it is warned about, as it changes nothing.
    """
    model = build_model(spec_from_checkpoint(checkpoint))
    if nms and not decodes_end_to_end(model):
        LOGGER.warning("--nms changes nothing here: only end-to-end models (yolo26) have an NMS-free head to turn off")
    if nms:
        family_of(model).force_nms(model)
    model.load_state_dict(checkpoint.get("ema") or checkpoint["model"])
    model = model.fuse().eval().to(device, memory_format=memory_format(channels_last))
    if half and device.type == "cuda":
        model = model.half()
    return model
