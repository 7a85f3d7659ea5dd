"""Export a checkpoint to TorchScript, ONNX, OpenVINO or TensorRT with its metadata, checked against PyTorch."""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import datetime
import importlib
import itertools
import logging
import math
import os
import shutil
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from utils.backends.exported import Runner
from utils.backends.metadata import (
    CHANNELS_FIRST,
    END_TO_END,
    ROWS,
    ExportMetadata,
)
from utils.boxes import best_detections
from utils.checkpoint import trained_imgsz
from utils.config import IMGSZ_FROM_CHECKPOINT_HELP, shipped_file, stride_multiples
from utils.convert import load_weights
from utils.distributed import DistContext
from utils.errors import ConfigError
from utils.export.openvino import OpenVinoSettings, export_openvino, openvino_folder
from utils.export.parity import (
    FP16_TOLERANCE,
    FP32_TOLERANCE,
    ExportMismatchError,
    Parity,
    Tolerance,
    check_agreement,
    check_parity,
    match_detection_rows,
)
from utils.export.quantization import (
    MIN_AGREEMENT,
    Agreement,
    CalibrationSet,
    calibration_batches,
    load_calibration_images,
)
from utils.export.tensorrt import EngineSettings, export_engine
from utils.export.torch_formats import export_onnx, export_torchscript, trace_export_graph
from utils.families import decodes_end_to_end, family_of, spec_from_checkpoint
from utils.inference_model import inference_model
from utils.tasks import Task

# What other modules and tests import from here (the parity check and writers live in the package's modules).
__all__ = [
    "FP16_TOLERANCE", "FP32_TOLERANCE", "ExportConfig", "ExportMismatchError", "ExportWrapper", "ExportedFile",
    "Tolerance", "build_export_parser", "check_export_dependencies", "check_parity", "export_checkpoint",
    "export_config_from_args", "export_metadata", "export_onnx", "export_path", "export_torchscript",
    "match_detection_rows",
]  # fmt: skip

LOGGER = logging.getLogger(__name__)

# YOLOv5's file names: best.pt -> best.torchscript, best.onnx, best.engine; OpenVINO writes a folder (openvino_folder).
SUFFIXES = {"torchscript": ".torchscript", "onnx": ".onnx", "openvino": "_openvino_model", "engine": ".engine"}
HALF_INPUT_FORMATS = ("torchscript", "onnx")  # --half makes their input FP16; OpenVINO and TensorRT keep FP32 input
INT8_FORMATS = ("openvino", "engine")
DEFAULT_CALIB_IMAGES = 300
DEFAULT_OPSET = 17  # YOLOv5's default
# The TorchScript-based ONNX exporter (dynamo=False) that we use writes opsets up to 20 in torch 2.14.
OPSET_RANGE = (11, 20)


@dataclass(frozen=True)
class ExportConfig:
    """Options of export.py, resolved once from the command line (YOLOv5's flag names and defaults)."""

    weights: Path
    include: tuple[str, ...] = ("torchscript",)  # any of SUFFIXES
    imgsz: tuple[int, int] | None = None  # (height, width) of the traced input, stride multiples; None: trained size
    batch_size: int = 1
    device: str = "cpu"
    half: bool = False  # fp16 weights and input; CUDA only
    dynamic: bool = False  # ONNX: batch, height and width are free axes
    simplify: bool = False  # ONNX: run onnxsim on the graph
    opset: int = DEFAULT_OPSET
    nms: bool = False  # end-to-end models: export the one-to-many head's rows (for NMS) instead of final detections
    int8: bool = False  # OpenVINO / TensorRT: post-training INT8 quantization, calibrated on `data`'s train images
    data: Path | None = None  # dataset YAML for --int8 calibration
    calib_images: int = DEFAULT_CALIB_IMAGES


@dataclass(frozen=True)
class ExportedFile:
    """One written file, how long writing it took, and how far its outputs are from PyTorch's."""

    file_format: str  # "torchscript" | "onnx" | "openvino" | "engine"
    path: Path  # a file, or the model folder for OpenVINO
    export_seconds: float
    max_abs_diff: float | None  # None when parity could not be run (ONNX without onnxruntime) or for INT8
    tolerance_share: float | None = None  # the largest |diff| / (atol + rtol * |value|): <= 1 passes
    agreement: float | None = None  # INT8 only: share of PyTorch's detections the file also finds; NaN: it found none


class ExportWrapper(nn.Module):
    """The graph an exported file holds: the eval model's decoded predictions, without the raw training output.

    images: (B, 3, H, W) in [0, 1], H and W multiples of the largest stride. Detection returns decoded (B, N, 5 + nc):
    xywh in input pixels, objectness and class probabilities (YOLOv5's `output0`). Segmentation returns
    (decoded (B, N, 5 + nc + nm) with raw mask coefficients, protos (B, nm, H/4, W/4)) (`output0`, `output1`).
    The model family's output layout (utils/families.py) decides the columns (no objectness for
    anchor-free heads: (B, 4 + nc [+ nm], N), channels first, as Ultralytics' consumers read it). An
    end-to-end model decoding its one-to-one head returns its final detections instead:
    (B, max_det, 6 [+ nm]) rows [x1, y1, x2, y2, score, class], best first, no NMS needed.
    """

    def __init__(self, model: nn.Module, max_det: int = 300) -> None:
        super().__init__()
        self.model = model
        head = model.head
        self.with_protos = head.num_masks > 0
        self.channels_first = family_of(model).channels_first
        self.end_to_end = decodes_end_to_end(model)
        self.num_classes = head.num_classes
        self.max_det = max_det
        self.layout = END_TO_END if self.end_to_end else CHANNELS_FIRST if self.channels_first else ROWS

    def forward(self, images: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Run the model and keep what deployment needs (see the class docstring)."""
        decoded, raw = self.model(images)
        if self.end_to_end:
            decoded = best_detections(decoded, self.num_classes, self.max_det)
        elif self.channels_first:
            decoded = decoded.transpose(1, 2)
        return (decoded, raw[1]) if self.with_protos else decoded


def build_export_parser() -> argparse.ArgumentParser:
    """Return the argparse parser of export.py (YOLOv5's flags for the formats we write)."""
    parser = argparse.ArgumentParser(description="Export a detection or segmentation checkpoint for deployment")
    parser.add_argument("--weights", type=Path, required=True, help="checkpoint path (best.pt / last.pt)")
    parser.add_argument("--include", nargs="+", default=["torchscript"], help="torchscript onnx openvino engine")
    parser.add_argument(
        "--imgsz", "--img", "--img-size", nargs="+", type=int, help=f"(h [w]) {IMGSZ_FROM_CHECKPOINT_HELP}"
    )
    parser.add_argument("--batch-size", type=int, default=1, help="batch size of the traced input")
    parser.add_argument("--device", default="cpu", help="cpu or a cuda device, e.g. 0")
    parser.add_argument("--half", action="store_true", help="FP16 export (CUDA but for openvino; no --dynamic)")
    parser.add_argument("--int8", action="store_true", help="openvino / engine: INT8 quantization (needs --data)")
    parser.add_argument("--data", type=shipped_file, help="dataset YAML whose train images calibrate --int8")
    parser.add_argument(
        "--calib-images", type=int, default=DEFAULT_CALIB_IMAGES, help="--int8: number of calibration images"
    )
    parser.add_argument("--dynamic", action="store_true", help="ONNX: dynamic batch, height and width")
    parser.add_argument("--simplify", action="store_true", help="ONNX: simplify the graph (needs onnxsim)")
    parser.add_argument("--opset", type=int, default=DEFAULT_OPSET, help="ONNX opset version")
    parser.add_argument(
        "--nms", action="store_true", help="end-to-end models (yolo26): write the one-to-many head's rows for NMS"
    )
    return parser


def export_config_from_args(args: argparse.Namespace) -> ExportConfig:
    """Build the frozen ExportConfig from parsed flags; a bad value is a one-line ConfigError naming the flag."""
    include = tuple(dict.fromkeys(name.lower() for name in args.include))  # unique, in the given order
    unknown = [name for name in include if name not in SUFFIXES]
    if unknown:
        raise ConfigError(f"--include {unknown[0]} is not supported; choose from {', '.join(SUFFIXES)}")
    if args.imgsz is not None and len(args.imgsz) not in (1, 2):
        raise ConfigError(f"--imgsz {' '.join(map(str, args.imgsz))}: give one side or two (height width)")
    imgsz = stride_multiples(args.imgsz) if args.imgsz is not None else None
    if args.batch_size < 1:
        raise ConfigError(f"--batch-size {args.batch_size} must be at least 1")
    if not OPSET_RANGE[0] <= args.opset <= OPSET_RANGE[1]:
        raise ConfigError(f"--opset {args.opset} must be within {OPSET_RANGE[0]}..{OPSET_RANGE[1]}")
    if args.half and args.dynamic:  # YOLOv5 refuses the pair too (it traces dynamic graphs on CPU, which lacks fp16)
        raise ConfigError("--half and --dynamic cannot be combined; use one of them")
    check_int8_flags(args, include, imgsz)
    if "engine" in include and args.dynamic:
        raise ConfigError("--dynamic is not supported for engine: TensorRT builds for one --imgsz and --batch-size")
    return ExportConfig(
        weights=args.weights,
        include=include,
        imgsz=None if imgsz is None else (imgsz[0], imgsz[-1]),
        batch_size=args.batch_size,
        device=args.device,
        half=args.half,
        dynamic=args.dynamic,
        simplify=args.simplify,
        opset=args.opset,
        nms=args.nms,
        int8=args.int8,
        data=args.data,
        calib_images=args.calib_images,
    )


def check_int8_flags(args: argparse.Namespace, include: tuple[str, ...], imgsz: tuple[int, ...] | None) -> None:
    """Refuse, in one line naming the flag, an --int8 export that cannot be calibrated or has no INT8 form.

    `imgsz`: --imgsz rounded to stride multiples (`60 64` is the square 64 64).
    """
    if not args.int8:
        return
    others = [name for name in include if name not in INT8_FORMATS]
    if others:
        raise ConfigError(f"--int8 applies to --include openvino / engine, not {others[0]}; export it in another run")
    if args.half:
        raise ConfigError("--half and --int8 cannot be combined; --int8 keeps the layers it does not quantize in float")
    if args.data is None:
        raise ConfigError("--int8 needs --data, a dataset YAML whose train images calibrate the quantization")
    if args.calib_images < 1:
        raise ConfigError(f"--calib-images {args.calib_images} must be at least 1")
    if imgsz is not None and imgsz[0] != imgsz[-1]:
        raise ConfigError("--int8 calibrates on square images, as val letterboxes them; give one --imgsz side")


def check_export_dependencies(cfg: ExportConfig, ctx: DistContext) -> None:
    """Refuse, in one line, what this machine cannot do: --half off CUDA (but for OpenVINO), a missing package,
    TensorRT without CUDA.

    onnxruntime is optional: without it the ONNX file is only checked structurally.
    """
    on_cuda = ctx.device.type == "cuda"
    if cfg.half and not on_cuda and any(name != "openvino" for name in cfg.include):
        raise ConfigError("--half needs a CUDA device (e.g. --device 0), except for --include openvino alone")
    if "onnx" in cfg.include or "engine" in cfg.include:
        _require_package("onnx", "ONNX export needs the 'onnx' package: pip install onnx")
        if cfg.simplify:
            _require_package("onnxsim", "--simplify needs the 'onnxsim' package: pip install onnxsim")
    if "openvino" in cfg.include:
        _require_package("openvino", "OpenVINO export needs the 'openvino' package: pip install openvino")
        if cfg.int8:
            _require_package("nncf", "--int8 OpenVINO export needs the 'nncf' package: pip install nncf")
    if "engine" in cfg.include:
        if not on_cuda:
            raise ConfigError("--include engine needs a CUDA device (e.g. --device 0): TensorRT builds for its GPU")
        _require_package("tensorrt", "TensorRT export needs the 'tensorrt' package: pip install tensorrt (CUDA only)")


def _require_package(name: str, message: str) -> None:
    """Raise ConfigError(message) when package `name` cannot be imported."""
    try:
        importlib.import_module(name)
    except ImportError as error:
        raise ConfigError(message) from error


def export_checkpoint(cfg: ExportConfig, tasks: Mapping[str, Task], ctx: DistContext) -> list[ExportedFile]:
    """Write `cfg.weights` in each format of `cfg.include` next to it and check each against PyTorch.

    Runs on rank 0 only; other ranks return [] at once (no collective inside). The task comes from
    the checkpoint's `task` field, looked up in `tasks` ({"detect": DETECT, "segment": SEGMENT}).
    Each file (an OpenVINO folder) is written to a temporary sibling, loaded back and run on random
    input at the traced batch size (and two more with --dynamic); only a file within tolerance
    replaces `best.<format>`. An INT8 file is compared on its calibration images instead: it must
    find MIN_AGREEMENT of PyTorch's detections. Raises ExportMismatchError (one line) otherwise.
    """
    if not ctx.is_main:
        return []
    if ctx.is_distributed:
        others = "rank 1 does" if ctx.world_size == 2 else f"ranks 1-{ctx.world_size - 1} do"
        LOGGER.info(f"Exporting on rank 0 only; {others} nothing")
    check_export_dependencies(cfg, ctx)
    checkpoint = load_weights(cfg.weights)  # read once; a YOLOv5 file is converted, its task included
    task = tasks[checkpoint["task"]]
    stride = spec_from_checkpoint(checkpoint, cfg.weights).max_stride  # 64 for a YOLOv5 P6 model
    imgsz = stride_multiples(cfg.imgsz, "--imgsz", stride) if cfg.imgsz else (trained_imgsz(checkpoint),) * 2
    cfg = dataclasses.replace(cfg, imgsz=imgsz)
    graphs: dict[tuple[torch.device, bool], ExportWrapper] = {}

    def graph(device: torch.device, half: bool) -> ExportWrapper:
        """The export graph on `device` in FP16 or FP32, built once per pair."""
        if (device, half) not in graphs:
            model = inference_model(checkpoint, device, half=half, channels_last=False, nms=cfg.nms)
            graphs[device, half] = ExportWrapper(model).eval()  # eval: exporters restore the wrapper's mode
        return graphs[device, half]

    traces: dict[tuple[int, torch.Size], torch.jit.ScriptModule] = {}

    def trace(wrapper: ExportWrapper, example: torch.Tensor) -> torch.jit.ScriptModule:
        """`wrapper` traced at `example`'s shape, once: TorchScript saves and OpenVINO converts the same trace."""
        key = (id(wrapper), example.shape)  # a wrapper's device and dtype are its own (see graph)
        if key not in traces:
            traces[key] = trace_export_graph(wrapper, example)
        return traces[key]

    calibration = None
    if cfg.int8:
        model = graph(ctx.device, False).model
        spec = CalibrationSet(cfg.data, cfg.calib_images, cfg.imgsz[0], int(model.stride.max()), model.head.num_classes)
        calibration = load_calibration_images(spec, ctx)
    exported = []
    for file_format in cfg.include:
        # OpenVINO converts a CPU model; TensorRT parses an FP32 ONNX graph and lowers precision itself.
        device = torch.device("cpu") if file_format == "openvino" else ctx.device
        wrapper = graph(device, cfg.half and file_format in HALF_INPUT_FORMATS)
        metadata = export_metadata(wrapper, checkpoint["names"], task, cfg, file_format)
        exported.append(_export_format(file_format, wrapper, metadata, cfg, calibration, trace))
    return exported


def export_metadata(
    wrapper: ExportWrapper, names: list[str], task: Task, cfg: ExportConfig, file_format: str
) -> ExportMetadata:
    """What `file_format`'s file records about `wrapper` (see ExportMetadata)."""
    model = wrapper.model
    family = family_of(model).name
    return ExportMetadata(
        stride=int(model.stride.max()),
        names=dict(enumerate(names)),
        task=task.name,
        imgsz=list(cfg.imgsz),
        batch=cfg.batch_size,
        dynamic=cfg.dynamic,
        half=cfg.half and file_format in HALF_INPUT_FORMATS,
        precision="int8" if cfg.int8 else "fp16" if cfg.half else "fp32",
        end2end=wrapper.end_to_end,
        channels=3,
        family=family,
        layout=wrapper.layout,
        num_masks=int(model.head.num_masks),
        description=f"{task.name} model ({family}) exported from {cfg.weights.name}",
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    )


def export_path(weights: Path, file_format: str, int8: bool) -> Path:
    """Where `file_format` is written for `weights`: best.onnx, best.engine, best[_int8]_openvino_model/."""
    if file_format == "openvino":
        return openvino_folder(weights, int8)
    return weights.with_suffix(SUFFIXES[file_format])


def _export_format(
    file_format: str,
    wrapper: ExportWrapper,
    metadata: ExportMetadata,
    cfg: ExportConfig,
    calibration: torch.Tensor | None,
    trace: Tracer,
) -> ExportedFile:
    """Write one format to a temporary sibling, check it against PyTorch, and move it into place."""
    dtype = next(wrapper.parameters()).dtype
    example = torch.zeros(cfg.batch_size, 3, *cfg.imgsz, device=next(wrapper.parameters()).device, dtype=dtype)
    batch_sizes = [cfg.batch_size, cfg.batch_size + 2] if cfg.dynamic else [cfg.batch_size]
    tolerance = FP16_TOLERANCE if cfg.half else FP32_TOLERANCE
    path = export_path(cfg.weights, file_format, cfg.int8)
    with _temporary_sibling(path) as tmp_path:
        start = time.perf_counter()
        runner = _writer(file_format, cfg, calibration, trace)(wrapper, example, tmp_path, metadata)
        seconds = time.perf_counter() - start
        parity = agreement = None
        if runner is not None and calibration is not None:
            batches = calibration_batches(calibration, cfg.batch_size)
            agreement = check_agreement(wrapper, runner, batches, metadata, path)
        elif runner is not None:
            inputs = [_random_images(batch, cfg.imgsz, example) for batch in batch_sizes]
            parity = check_parity(_parity_reference(wrapper, file_format, cfg), runner, inputs, tolerance, path)
        _replace(tmp_path, path)
    recall = None if agreement is None else agreement.recall if agreement.measured else math.nan
    exported = ExportedFile(file_format, path, seconds, *_parity_fields(parity), agreement=recall)
    _log_export(exported, batch_sizes, tolerance, parity, agreement)
    return exported


# A writer saves the graph to a path and returns a runner of the saved file (None: it cannot be run here).
Writer = Callable[[nn.Module, torch.Tensor, Path, ExportMetadata], Runner | None]
# The graph traced at an example's shape, once per export (export_checkpoint's `trace`).
Tracer = Callable[[nn.Module, torch.Tensor], torch.jit.ScriptModule]


def _writer(file_format: str, cfg: ExportConfig, calibration: torch.Tensor | None, trace: Tracer) -> Writer:
    """The function that writes `file_format` with `cfg`'s options (and `calibration` images for --int8)."""
    if file_format == "torchscript":
        return lambda wrapper, example, path, metadata: export_torchscript(trace(wrapper, example), example, path,
                                                                           metadata)  # fmt: skip
    if file_format == "openvino":
        settings = OpenVinoSettings(cfg.weights.stem, cfg.half, cfg.dynamic, calibration)
        return lambda wrapper, example, path, metadata: export_openvino(wrapper, trace(wrapper, example), example,
                                                                        path, metadata, settings)  # fmt: skip
    if file_format == "engine":
        engine = EngineSettings(cfg.half, calibration, cfg.opset)
        return lambda wrapper, example, path, metadata: export_engine(wrapper, example, path, metadata, engine)
    return lambda wrapper, example, path, metadata: export_onnx(wrapper, example, path, metadata, cfg)


def _replace(tmp_path: Path, path: Path) -> None:
    """Move the written `tmp_path` onto `path`; an existing model folder is removed first (rename needs that)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    os.replace(tmp_path, path)


@contextlib.contextmanager
def _temporary_sibling(path: Path) -> Iterator[Path]:
    """Yield a hidden temporary path beside `path` and remove it afterwards if it is still there."""
    tmp_path = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        yield tmp_path
    finally:
        if tmp_path.is_dir():
            shutil.rmtree(tmp_path, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.unlink(tmp_path)


def _parity_reference(wrapper: ExportWrapper, file_format: str, cfg: ExportConfig) -> nn.Module:
    """What the written file must match: the export graph, or for an FP16 OpenVINO IR (FP16 weights, FP32 compute
    on CPUs) the graph with every weight rounded to FP16 as the IR stores it, so the check measures the runtime
    and not the rounding (val.py measures what the rounding costs in mAP)."""
    if file_format != "openvino" or not cfg.half:
        return wrapper
    rounded = copy.deepcopy(wrapper)
    with torch.no_grad():
        for tensor in itertools.chain(rounded.parameters(), rounded.buffers()):
            if tensor.is_floating_point():
                tensor.copy_(tensor.half().float())
    return rounded


def _random_images(batch: int, imgsz: tuple[int, int], like: torch.Tensor) -> torch.Tensor:
    """(batch, 3, H, W) uniform [0, 1) images, the same for every call with the same shape."""
    generator = torch.Generator().manual_seed(batch)
    return torch.rand(batch, 3, *imgsz, generator=generator).to(like.device, like.dtype)


def _parity_fields(parity: Parity | None) -> tuple[float | None, float | None]:
    """(max_abs_diff, tolerance_share) of an ExportedFile; both None when no comparison ran."""
    return (None, None) if parity is None else (parity.max_abs_diff, parity.tolerance_share)


def _log_export(
    item: ExportedFile, batch_sizes: list[int], tolerance: Tolerance, parity: Parity | None, agreement: Agreement | None
) -> None:
    """Log one line per file: path, size, time, and the parity result with its margin (INT8: the agreement)."""
    files = [item.path] if item.path.is_file() else [path for path in item.path.iterdir() if path.is_file()]
    size_mb = sum(path.stat().st_size for path in files) / 1e6
    if agreement is not None and not agreement.measured:
        result = (
            f"INT8 agreement not measured (PyTorch finds no detection on the calibration images; the file gives "
            f"{agreement.found}); val.py gives its mAP"
        )
    elif agreement is not None:
        result = (
            f"INT8 finds {agreement.matched} of PyTorch's {agreement.expected} detections ({agreement.recall:.1%}; "
            f"refused below {MIN_AGREEMENT:.0%}) on the calibration images at conf 0.25, IoU 0.5; it gives "
            f"{agreement.found}. val.py gives its mAP"
        )
    elif parity is None:
        result = "onnx.checker passed; not compared with PyTorch (see above)"
    else:
        sizes = ", ".join(map(str, batch_sizes))
        result = (
            f"matches PyTorch at batch {sizes}: max |diff| {parity.max_abs_diff:.1e}, {parity.tolerance_share:.2f} "
            f"of the tolerance {tolerance.atol:g} + {tolerance.rtol:g} * |value| (closest at a value of "
            f"{parity.worst_value:.3g})"
        )
    LOGGER.info(f"{item.file_format}: {item.path} ({size_mb:.1f} MB) in {item.export_seconds:.1f} s; {result}")
