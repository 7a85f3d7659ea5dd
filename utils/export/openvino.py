"""OpenVINO export: the model as an IR folder (FP32, FP16 weights, or INT8 through NNCF) with its metadata.yaml."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml
from torch import nn

from utils.backends.exported import Runner
from utils.backends.metadata import OPENVINO_METADATA_FILE, ExportMetadata, without_torchscript_deprecation
from utils.backends.openvino_runtime import compile_for_cpu, openvino_runner
from utils.export.quantization import calibration_batches, head_output_convs

LOGGER = logging.getLogger(__name__)

FOLDER_SUFFIX = "_openvino_model"  # best.pt -> best_openvino_model/ (best_int8_openvino_model/ with --int8)
# OpenVINO's PyTorch frontend names each operation after the module that ran it: "__module.model.head.convs.0/
# aten::_convolution/Convolution", and "__module.model.head/aten::mul/Multiply" for the head's own arithmetic.
MODULE_PREFIX = "__module.model."


def openvino_folder(weights: Path, int8: bool) -> Path:
    """The model folder export writes for `weights`: best.pt -> best_openvino_model/ or best_int8_openvino_model/."""
    return weights.with_name(f"{weights.stem}{'_int8' if int8 else ''}{FOLDER_SUFFIX}")


@dataclass(frozen=True, eq=False)
class OpenVinoSettings:
    """What export_openvino needs beyond the graph: the IR's file name, FP16 weights, dynamic axes, INT8 images."""

    name: str  # best -> best.xml / best.bin
    half: bool
    dynamic: bool
    calibration: torch.Tensor | None  # (N, 3, H, W) in [0, 1] for --int8, else None


def export_openvino(
    wrapper: nn.Module,
    traced: torch.jit.ScriptModule,
    example: torch.Tensor,
    folder: Path,
    metadata: ExportMetadata,
    settings: OpenVinoSettings,
) -> Runner:
    """Convert `wrapper` (FP32, on CPU) to OpenVINO and save `folder`/<name>.xml, .bin and metadata.yaml.

    `traced` is `wrapper` traced at `example`'s shape (trace_export_graph; OpenVINO's frontend would trace
    it again); `settings.dynamic` frees batch, height and width. FP32
    keeps FP32 weights (OpenVINO would compress them to FP16 by default), `settings.half` stores FP16
    weights, and `settings.calibration` (N, 3, H, W images) quantizes to INT8 with NNCF, keeping the
    head's output convolutions, the DFL and the box decode in FP32 (`ignored_patterns`). Returns a
    runner of the saved model compiled for CPU.
    """
    import openvino as ov

    shape = [-1, 3, -1, -1] if settings.dynamic else list(example.shape)
    with torch.no_grad(), without_torchscript_deprecation():
        model = ov.convert_model(traced, example_input=example, input=[ov.PartialShape(shape)])
    model.inputs[0].get_tensor().set_names({"images"})
    for index, output in enumerate(model.outputs):
        output.get_tensor().set_names({f"output{index}"})  # YOLOv5's names, as in the ONNX file
    if settings.calibration is not None:
        model = quantize(model, wrapper, settings.calibration, int(example.shape[0]))
    folder.mkdir(parents=True)
    xml_path = folder / f"{settings.name}.xml"
    ov.save_model(model, str(xml_path), compress_to_fp16=settings.half)
    (folder / OPENVINO_METADATA_FILE).write_text(yaml.safe_dump(dict(metadata), sort_keys=False))
    return openvino_runner(compile_for_cpu(ov.Core(), xml_path))


def quantize(model: object, wrapper: nn.Module, images: torch.Tensor, batch_size: int) -> object:
    """INT8 post-training quantization of OpenVINO `model` with NNCF, calibrated on `images`.

    NNCF's MIXED preset (symmetric weights, asymmetric activations: SiLU outputs are mostly positive)
    over every calibration batch. The operations `ignored_patterns` names stay in FP32, and so do MatMuls:
    in these CNNs only attention has them (YOLO11's C2PSA, activations times activations, a wide range
    for one INT8 scale; measured: +0.001 mAP50-95 on a trained yolo11n). If none of the head's operations
    is found the operation names changed, and quantizing the decode would silently cost accuracy, so that
    is an error.
    """
    import nncf

    patterns = ignored_patterns(wrapper.model)
    names = [op.get_friendly_name() for op in model.get_ordered_ops()]  # type: ignore[attr-defined]
    kept = [name for name in names if any(re.fullmatch(pattern, name) for pattern in patterns)]
    if not any(name.startswith(f"{MODULE_PREFIX}head") for name in kept):
        raise RuntimeError("OpenVINO operation names no longer carry module paths; cannot keep the head in FP32")
    batches = calibration_batches(images, batch_size)
    dataset = nncf.Dataset([batch.numpy() for batch in batches])
    LOGGER.info(f"INT8: calibrating on {len(images)} images in {len(batches)} batches; {len(kept)} head ops stay FP32")
    nncf.set_log_level(logging.WARNING)  # otherwise one INFO line per operation it leaves alone
    return nncf.quantize(
        model,
        dataset,
        preset=nncf.QuantizationPreset.MIXED,
        subset_size=len(batches),
        ignored_scope=nncf.IgnoredScope(patterns=patterns, types=["MatMul"], validate=False),
    )


def ignored_patterns(model: nn.Module) -> list[str]:
    """Regular expressions of the operations INT8 keeps in FP32: the head's own arithmetic and its output convs.

    The head's own operations (the DFL softmax and expectation, grid offsets, stride scaling,
    sigmoids: everything the head computes outside a submodule) decode pixel coordinates, where an
    INT8 step would move boxes; the output convolutions (`head_output_convs`) give the values decoded.
    Operations outside the model (the export wrapper's transpose or top-k) are kept too.
    """
    head = re.escape(f"{MODULE_PREFIX}head")
    patterns = [f"{head}/.*", r"aten::.*"]
    patterns += [f"{head}\\.{re.escape(name)}/.*" for name in head_output_convs(model)]
    return patterns
