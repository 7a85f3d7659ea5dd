"""The TensorRT backend: an `.engine` from export.py, run on the CUDA device it was built for.

NOT RUN in this project's development (no GPU or TensorRT where it was written); see utils/export_tensorrt.py.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from utils.backends.base import BackendInfo, BackendRequest
from utils.backends.exported import ExportedBackend, Runner, check_request, exported_info
from utils.backends.metadata import split_engine_file
from utils.errors import ConfigError


class TensorRTBackend(ExportedBackend):
    """A TensorRT engine: one fixed size and batch (larger batches run in padded chunks), FP32 input."""

    def __init__(
        self, info: BackendInfo, device: torch.device, execute: Callable[[torch.Tensor], list[torch.Tensor]]
    ) -> None:
        super().__init__(info, device)
        self.execute = execute

    @classmethod
    def load(cls, path: Path, request: BackendRequest) -> TensorRTBackend:
        """Deserialize `path` on `request.device` after checking its metadata; refuse in one line what cannot run.

        The metadata is read before tensorrt is imported, so a wrong task or a CPU device is refused
        the same way on machines without TensorRT.
        """
        metadata, plan = split_engine_file(path)
        info = exported_info(path, metadata, "engine")
        check_request(info, request)
        if request.device.type != "cuda":
            raise ConfigError(f"{path}: a TensorRT engine runs on CUDA only; use --device 0")
        try:
            import tensorrt
        except ImportError as error:
            raise ConfigError(f"{path}: running TensorRT engines needs tensorrt: pip install tensorrt") from error
        engine = tensorrt.Runtime(tensorrt.Logger(tensorrt.Logger.WARNING)).deserialize_cuda_engine(plan)
        if engine is None:
            raise ConfigError(f"{path}: TensorRT cannot load it (built by another TensorRT version or for another GPU)")
        return cls(info, request.device, engine_executor(tensorrt, engine, request.device))

    def run_file(self, images: torch.Tensor) -> list[torch.Tensor]:
        return self.execute(images)


def engine_runner(trt: Any, engine: Any, device: torch.device) -> Runner:
    """A runner of a deserialized engine: images in, its outputs in engine order as numpy arrays."""
    execute = engine_executor(trt, engine, device)

    def run(images: torch.Tensor) -> list[np.ndarray]:
        return [output.float().cpu().numpy() for output in execute(images)]

    return run


def engine_executor(trt: Any, engine: Any, device: torch.device) -> Callable[[torch.Tensor], list[torch.Tensor]]:
    """Run `engine` on CUDA tensors with TensorRT 10's named-tensor API; outputs come back as torch tensors.

    The engine's shapes are fixed (export refuses --dynamic), so output buffers are allocated once;
    each call copies the input into the engine's dtype, enqueues on torch's current stream and waits.
    """
    context = engine.create_execution_context()
    names = sorted(engine.get_tensor_name(index) for index in range(engine.num_io_tensors))  # output0, output1
    inputs = [name for name in names if engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT]
    outputs = {
        name: torch.empty(
            tuple(engine.get_tensor_shape(name)),
            dtype=torch.from_numpy(np.empty(0, dtype=trt.nptype(engine.get_tensor_dtype(name)))).dtype,
            device=device,
        )
        for name in names
        if name not in inputs
    }
    input_dtype = torch.from_numpy(np.empty(0, dtype=trt.nptype(engine.get_tensor_dtype(inputs[0])))).dtype
    for name, buffer in outputs.items():
        context.set_tensor_address(name, int(buffer.data_ptr()))

    def execute(images: torch.Tensor) -> list[torch.Tensor]:
        batch = images.to(device, input_dtype).contiguous()
        context.set_tensor_address(inputs[0], int(batch.data_ptr()))
        stream = torch.cuda.current_stream(device)
        if not context.execute_async_v3(stream.cuda_stream):
            raise RuntimeError("TensorRT failed to run the engine")
        stream.synchronize()
        return [buffer.clone() for buffer in outputs.values()]

    return execute
