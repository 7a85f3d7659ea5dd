"""TensorRT export: an `.engine` built from our ONNX graph, FP32, FP16 or INT8 (entropy calibration), with metadata.

NOT RUN in this project's development: it was written against TensorRT 10's documented Python API on a
machine without a GPU or TensorRT. Tests cover everything up to `import tensorrt` (the refusals, the
metadata header); the first export on a GPU machine is its first real test (docs/export.md).
"""

from __future__ import annotations

import logging
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from utils.backends.exported import Runner
from utils.backends.metadata import ExportMetadata, write_engine_file
from utils.backends.tensorrt_runtime import engine_runner
from utils.export.quantization import calibration_batches, head_output_convs

LOGGER = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class EngineSettings:
    """What export_engine needs beyond the graph: FP16 layers, INT8 calibration images, the ONNX opset."""

    half: bool
    calibration: torch.Tensor | None  # (N, 3, H, W) in [0, 1] for --int8, else None
    opset: int


def export_engine(
    wrapper: nn.Module, example: torch.Tensor, path: Path, metadata: ExportMetadata, settings: EngineSettings
) -> Runner:
    """Build a TensorRT engine for `example`'s shape on its GPU and write it to `path` after our metadata.

    The graph is the FP32 ONNX export of `wrapper` (a temporary file beside `path`), parsed by
    TensorRT's ONNX parser. --half lets TensorRT pick FP16 kernels; --int8 adds INT8 kernels calibrated
    with IInt8EntropyCalibrator2 on the calibration batches, and pins the head's output convolutions
    and its own decode layers to FP32 (`pin_head_to_fp32`). Returns a runner of the built engine.
    """
    import tensorrt as trt

    onnx_path = path.with_name(f"{path.name}.onnx")
    try:
        _write_onnx(wrapper, example, onnx_path, settings.opset)
        logger = trt.Logger(trt.Logger.WARNING)
        builder = trt.Builder(logger)
        network = builder.create_network(_network_flags(trt))
        parser = trt.OnnxParser(network, logger)
        if not parser.parse_from_file(str(onnx_path)):
            errors = "; ".join(str(parser.get_error(index)) for index in range(parser.num_errors))
            raise RuntimeError(f"TensorRT could not parse the ONNX graph: {errors}")
    finally:
        onnx_path.unlink(missing_ok=True)
    config = builder.create_builder_config()
    if settings.half or settings.calibration is not None:
        config.set_flag(trt.BuilderFlag.FP16)  # INT8 engines fall back to FP16, not FP32, where INT8 is slower
    calibrator = None
    if settings.calibration is not None:
        config.set_flag(trt.BuilderFlag.INT8)
        calibrator = make_calibrator(trt, calibration_batches(settings.calibration, int(example.shape[0])), example)
        config.int8_calibrator = calibrator
        pinned = pin_head_to_fp32(trt, network, head_output_convs(wrapper.model))
        config.set_flag(trt.BuilderFlag.PREFER_PRECISION_CONSTRAINTS)
        LOGGER.info(f"TensorRT INT8: {pinned} head layers pinned to FP32")
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise RuntimeError("TensorRT could not build the engine; its log above says why")
    write_engine_file(path, metadata, bytes(plan))
    engine = trt.Runtime(logger).deserialize_cuda_engine(bytes(plan))
    return engine_runner(trt, engine, example.device)


def _network_flags(trt: Any) -> int:
    """Network creation flags: explicit batch, which TensorRT 10 always uses and 8.x must be asked for."""
    if int(trt.__version__.split(".")[0]) >= 10:
        return 0
    return 1 << int(trt.NetworkDefinitionCreationFlag.EXPLICIT_BATCH)


def _write_onnx(wrapper: nn.Module, example: torch.Tensor, path: Path, opset: int) -> None:
    """The FP32 ONNX graph TensorRT parses: static shape, YOLOv5's input and output names."""
    output_names = ["output0", "output1"] if wrapper.with_protos else ["output0"]
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*legacy TorchScript-based ONNX export", category=DeprecationWarning)
        torch.onnx.export(
            wrapper, (example,), str(path), dynamo=False, opset_version=opset, do_constant_folding=True,
            input_names=["images"], output_names=output_names,
        )  # fmt: skip


def pin_head_to_fp32(trt: Any, network: Any, output_convs: list[str]) -> int:
    """Ask FP32 of the head's own layers and output convolutions; return how many layers were pinned.

    TensorRT names a parsed layer after its ONNX node, which torch names by module scope:
    "/model/head/Mul_2" for the head's own decode arithmetic, "/model/head/box_branches.0/box_branches.0.2/
    Conv" for an output convolution (`head_output_convs`' "box_branches.0.2").
    """
    own = re.compile(r"/model/head/[^/]+")
    convs = [re.compile(rf".*/{re.escape(name)}/[^/]+") for name in output_convs]
    pinned = 0
    for index in range(network.num_layers):
        layer = network.get_layer(index)
        if own.fullmatch(layer.name) or any(conv.fullmatch(layer.name) for conv in convs):
            layer.precision = trt.float32
            for output in range(layer.num_outputs):
                layer.set_output_type(output, trt.float32)
            pinned += 1
    return pinned


def make_calibrator(trt: Any, batches: list[torch.Tensor], example: torch.Tensor) -> Any:
    """An IInt8EntropyCalibrator2 that hands TensorRT the calibration batches, one CUDA copy at a time."""

    class EntropyCalibrator(trt.IInt8EntropyCalibrator2):  # type: ignore[misc, name-defined]
        def __init__(self) -> None:
            trt.IInt8EntropyCalibrator2.__init__(self)
            self.pending = list(batches)
            self.current: torch.Tensor | None = None  # kept alive while TensorRT reads its memory

        def get_batch_size(self) -> int:
            return int(example.shape[0])

        def get_batch(self, names: list[str]) -> list[int] | None:
            if not self.pending:
                return None
            self.current = self.pending.pop(0).to(example.device, torch.float32).contiguous()
            return [int(self.current.data_ptr())]

        def read_calibration_cache(self) -> bytes | None:
            return None  # calibrate afresh each export: the images may have changed

        def write_calibration_cache(self, cache: Any) -> None:
            return None

    return EntropyCalibrator()
