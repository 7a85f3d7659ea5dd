"""The checkpoint backend: our .pt (or a YOLOv5 / Ultralytics one, converted in memory) as a PyTorch model."""

from __future__ import annotations

import logging
from pathlib import Path

from utils import checkpoint as ckpt_io
from utils.backends.base import BackendRequest, ModuleBackend, module_info
from utils.convert import load_weights
from utils.inference_model import inference_model

LOGGER = logging.getLogger(__name__)


def load_checkpoint_backend(path: Path, request: BackendRequest) -> ModuleBackend:
    """Load checkpoint `path` as the fused eval model on `request.device` (utils/inference_model.py).

    A checkpoint of another task is a one-line ConfigError naming the entry point that takes it.
    --half runs fp16 on CUDA; elsewhere it warns once and runs FP32, as it always has for checkpoints.
    """
    checkpoint = load_weights(path)
    if request.task is not None:
        ckpt_io.check_checkpoint_task(checkpoint, request.task, path, request.script)
    if request.half and request.device.type != "cuda":
        LOGGER.warning("--half needs CUDA; running in FP32 on CPU")
    model = inference_model(checkpoint, request.device, request.half, request.channels_last, request.nms)
    stored = checkpoint["names"]
    names = tuple(str(stored[key]) for key in sorted(stored)) if isinstance(stored, dict) else tuple(map(str, stored))
    size = ckpt_io.trained_imgsz(checkpoint)
    recorded = (checkpoint.get("train_config") or {}).get("data")
    trained_data = Path(recorded) if isinstance(recorded, str) and recorded else None
    info = module_info(
        model, path=path, task=checkpoint["task"], names=names, imgsz=(size, size), trained_data=trained_data
    )
    return ModuleBackend(model, info)
