"""The ONNX backend: an `.onnx` file from export.py, run with onnxruntime (its CUDA provider when it can)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from utils.backends.base import BackendInfo, BackendRequest
from utils.backends.exported import HostRuntimeBackend, check_request, exported_info
from utils.backends.metadata import parse_onnx_metadata
from utils.errors import ConfigError, error_reason

LOGGER = logging.getLogger(__name__)
CUDA_PROVIDER = "CUDAExecutionProvider"


def onnx_providers(device: torch.device, available: list[str]) -> list[str | tuple[str, dict[str, int]]]:
    """onnxruntime's providers for `device`: CUDA (on the device's index) first when torch runs on CUDA
    and the installed onnxruntime has the provider (onnxruntime-gpu), the CPU provider always."""
    if device.type == "cuda" and CUDA_PROVIDER in available:
        return [(CUDA_PROVIDER, {"device_id": device.index or 0}), "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


class OnnxBackend(HostRuntimeBackend):
    """An ONNX export in an onnxruntime session; a static file runs only its own size (and batch, in chunks)."""

    def __init__(self, info: BackendInfo, device: torch.device, session: Any) -> None:
        super().__init__(info, device)
        self.session = session  # an onnxruntime.InferenceSession
        self.input_name = session.get_inputs()[0].name

    @classmethod
    def load(cls, path: Path, request: BackendRequest) -> OnnxBackend:
        """Open `path` with onnxruntime and read its metadata_props; refuse what it cannot do, in one line."""
        try:
            import onnxruntime
        except ImportError as error:
            raise ConfigError(f"{path}: running ONNX files needs onnxruntime: pip install onnxruntime") from error
        providers = onnx_providers(request.device, onnxruntime.get_available_providers())
        if request.device.type == "cuda" and len(providers) == 1:
            LOGGER.warning(f"{path}: onnxruntime has no CUDA provider here (pip install onnxruntime-gpu); runs on CPU")
        try:
            session = onnxruntime.InferenceSession(str(path), providers=providers)
        except Exception as error:  # onnxruntime raises its own exception types; add the file and re-raise as ours
            raise ConfigError(f"{path}: onnxruntime cannot open it ({error_reason(error)})") from error
        info = exported_info(path, parse_onnx_metadata(session.get_modelmeta().custom_metadata_map), "onnx")
        check_request(info, request)
        return cls(info, request.device, session)

    def run_array(self, array: np.ndarray) -> list[np.ndarray]:
        # Through host memory: simple and the same for both providers; IO binding could keep CUDA inputs on the GPU.
        return self.session.run(None, {self.input_name: array})
