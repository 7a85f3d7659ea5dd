"""The OpenVINO backend: a model folder from export.py (best_openvino_model/), run on OpenVINO's CPU plugin."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from utils.backends.base import BackendInfo, BackendRequest
from utils.backends.exported import HostRuntimeBackend, Runner, check_request, exported_info
from utils.backends.metadata import read_openvino_metadata
from utils.errors import ConfigError, error_reason

LOGGER = logging.getLogger(__name__)


class OpenVinoBackend(HostRuntimeBackend):
    """An OpenVINO IR (FP32, FP16 or INT8) compiled for CPU; a static folder runs only its size (any batch)."""

    def __init__(self, info: BackendInfo, device: torch.device, compiled: Any) -> None:
        super().__init__(info, device)
        self.compiled = compiled  # an openvino.CompiledModel (compile_for_cpu)

    @classmethod
    def load(cls, path: Path, request: BackendRequest) -> OpenVinoBackend:
        """Compile the folder's .xml with its metadata.yaml for CPU; refuse what it cannot do, in one line.

        Outputs go back to `request.device`, so a CUDA run of val or detect takes the folder too, with
        inference on the CPU (one warning).
        """
        models = sorted(path.glob("*.xml"))
        if len(models) != 1:
            found = "no .xml model" if not models else f"{len(models)} .xml models"
            raise ConfigError(f"{path}: {found} in the folder; give the folder export.py --include openvino wrote")
        info = exported_info(path, read_openvino_metadata(path), "openvino")
        check_request(info, request)
        try:
            import openvino
        except ImportError as error:
            raise ConfigError(f"{path}: running OpenVINO models needs openvino: pip install openvino") from error
        if request.device.type != "cpu":
            LOGGER.warning(f"{path}: OpenVINO runs on the CPU here; outputs are moved to {request.device}")
        try:
            compiled = compile_for_cpu(openvino.Core(), models[0])
        except RuntimeError as error:  # OpenVINO reports a bad IR as RuntimeError; add the folder
            raise ConfigError(f"{path}: OpenVINO cannot read it ({error_reason(error)})") from error
        return cls(info, request.device, compiled)

    def input_array(self, images: torch.Tensor) -> np.ndarray:
        return host_float_array(images)

    def run_array(self, array: np.ndarray) -> list[np.ndarray]:
        return run_compiled(self.compiled, array)


def compile_for_cpu(core: object, xml_path: Path) -> object:
    """The model at `xml_path` compiled for OpenVINO's CPU plugin, FP32 compute on torch's thread count."""
    # One thread count for both runtimes: PyTorch and OpenVINO timings are then compared on equal cores. FP32
    # compute: on CPUs with AMX or AVX512-BF16 the plugin would otherwise run FP32 and FP16 IRs in bfloat16
    # (8 mantissa bits), which moves boxes by pixels; speed there is a trade a flag could offer later.
    config = {"INFERENCE_NUM_THREADS": torch.get_num_threads(), "INFERENCE_PRECISION_HINT": "f32"}
    return core.compile_model(str(xml_path), "CPU", config)  # type: ignore[attr-defined]


def openvino_runner(compiled: object) -> Runner:
    """A runner of a compiled OpenVINO model: images in, its outputs (output0 [, output1]) as numpy arrays."""

    def run(images: torch.Tensor) -> list[np.ndarray]:
        return run_compiled(compiled, host_float_array(images))

    return run


def host_float_array(images: torch.Tensor) -> np.ndarray:
    """`images` as a C-contiguous float32 host array: every IR we write takes FP32 input (FP16 and INT8 too)."""
    return np.ascontiguousarray(images.detach().cpu().float().numpy())


def run_compiled(compiled: Any, array: np.ndarray) -> list[np.ndarray]:
    """The compiled model's outputs (output0 [, output1]) for the host array `array`."""
    result = compiled(array)
    return [result[output] for output in compiled.outputs]
