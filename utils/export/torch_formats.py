"""TorchScript and ONNX writers of export.py: trace or export the graph, save it with its metadata, run it back."""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from utils.backends.exported import Runner
from utils.backends.metadata import (
    TORCHSCRIPT_METADATA_FILE,
    ExportMetadata,
    onnx_metadata_value,
    without_torchscript_deprecation,
)

if TYPE_CHECKING:  # the config is defined by the package that calls these writers
    from utils.export import ExportConfig

LOGGER = logging.getLogger(__name__)


def trace_export_graph(wrapper: nn.Module, example: torch.Tensor) -> torch.jit.ScriptModule:
    """Trace `wrapper` on `example` (as YOLOv5 does): the graph TorchScript saves and OpenVINO converts.

    Tracing records tensor sizes as values of the graph, so DetectHead's grid cache (keyed by size)
    misses and the grids are built in the graph from the input's size: the trace runs at any batch
    size and any stride-multiple image size. Tracing takes seconds for a nano model on a CPU, so
    export_checkpoint traces each graph once for both formats; neither changes the traced module.
    """
    with torch.no_grad(), without_torchscript_deprecation():
        # check_trace would trace a second time; check_parity compares the saved file's outputs instead.
        return torch.jit.trace(wrapper, example, check_trace=False)


def export_torchscript(
    traced: torch.jit.ScriptModule, example: torch.Tensor, path: Path, metadata: ExportMetadata
) -> Runner:
    """Save `traced` (trace_export_graph's, at `example`) to `path` with metadata as `config.txt`.

    Returns a runner of the saved file.
    """
    with torch.no_grad(), without_torchscript_deprecation():
        traced.save(str(path), _extra_files={TORCHSCRIPT_METADATA_FILE: json.dumps(metadata)})
        loaded = torch.jit.load(str(path), map_location=example.device)

    def run(images: torch.Tensor) -> list[np.ndarray]:
        with torch.no_grad():
            outputs = loaded(images)
        return [t.float().cpu().numpy() for t in (outputs if isinstance(outputs, tuple) else (outputs,))]

    return run


def export_onnx(
    wrapper: nn.Module, example: torch.Tensor, path: Path, metadata: ExportMetadata, cfg: ExportConfig
) -> Runner | None:
    """Export `wrapper` to ONNX at `path` with YOLOv5's input/output names and metadata_props; check it.

    Uses the TorchScript-based exporter (`dynamo=False`): it needs only the `onnx` package, writes the
    graph YOLOv5 users expect, and is several times faster here than the dynamo exporter, which also
    needs onnxscript. Returns an onnxruntime runner, or None when onnxruntime is not installed.
    """
    import onnx

    output_names = ["output0", "output1"] if wrapper.with_protos else ["output0"]
    dynamic_axes = None
    if cfg.dynamic:
        points_axis = {} if wrapper.end_to_end else {2 if wrapper.channels_first else 1: "anchors"}
        dynamic_axes = {"images": {0: "batch", 2: "height", 3: "width"}, "output0": {0: "batch", **points_axis}}
        if wrapper.with_protos:
            dynamic_axes["output1"] = {0: "batch", 2: "mask_height", 3: "mask_width"}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*legacy TorchScript-based ONNX export", category=DeprecationWarning)
        torch.onnx.export(
            wrapper,
            (example,),
            str(path),
            dynamo=False,
            opset_version=cfg.opset,
            do_constant_folding=True,
            input_names=["images"],
            output_names=output_names,
            dynamic_axes=dynamic_axes,
        )
    model_proto = onnx.load(str(path))
    if dynamic_axes is not None:
        with torch.no_grad():
            outputs = wrapper(example)
        _state_fixed_output_sizes(model_proto, outputs if isinstance(outputs, tuple) else (outputs,), dynamic_axes)
    if cfg.simplify:
        model_proto = _simplify(model_proto)
    for key, value in metadata.items():
        model_proto.metadata_props.add(key=key, value=onnx_metadata_value(value))
    onnx.checker.check_model(model_proto)
    onnx.save(model_proto, str(path))
    return _onnxruntime_runner(path, example)


def _state_fixed_output_sizes(model_proto: Any, outputs: tuple[torch.Tensor, ...], dynamic: dict[str, Any]) -> None:
    """Write the sizes of the outputs' axes that are not dynamic (the row width, max_det, the prototype count).

    The exporter names every output axis it cannot prove constant (`Concatoutput0_dim_1`): readers that
    take the class count or the row width from the output's shape would get a name instead of a number.
    """
    for graph_output, tensor in zip(model_proto.graph.output, outputs, strict=True):
        axes = dynamic.get(graph_output.name, {})
        for axis, dim in enumerate(graph_output.type.tensor_type.shape.dim):
            if axis not in axes:
                dim.dim_value = int(tensor.shape[axis])


def _simplify(model_proto: Any) -> Any:
    """Return onnxsim's simplified graph, or the original when onnxsim cannot verify it."""
    import onnxsim

    simplified, is_valid = onnxsim.simplify(model_proto)
    if not is_valid:
        LOGGER.warning("onnxsim could not verify the simplified graph; keeping the original")
        return model_proto
    return simplified


def _onnxruntime_runner(path: Path, example: torch.Tensor) -> Runner | None:
    """Open `path` in onnxruntime (its CUDA provider for a CUDA example when present); None when it cannot run it."""
    try:
        import onnxruntime
    except ImportError:
        LOGGER.info("onnxruntime is not installed (pip install onnxruntime): parity not run, ONNX file checked only")
        return None
    providers = ["CPUExecutionProvider"]
    if example.device.type == "cuda" and "CUDAExecutionProvider" in onnxruntime.get_available_providers():
        providers.insert(0, "CUDAExecutionProvider")
    elif example.dtype == torch.float16:  # the CPU provider lacks fp16 kernels for most operators
        LOGGER.warning("onnxruntime has no CUDA provider here (onnxruntime-gpu): parity of the FP16 file not run")
        return None
    session = onnxruntime.InferenceSession(str(path), providers=providers)

    def run(images: torch.Tensor) -> list[np.ndarray]:
        return session.run(None, {"images": images.cpu().numpy()})

    return run
