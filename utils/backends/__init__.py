"""Inference backends: load a checkpoint or an exported model behind one interface (`load_backend`).

    backend = load_backend(Path("best.onnx"), BackendRequest(task="detect", script="val", device=device))
    rows, extra = backend(images)                    # the eval model's outputs, whatever the file
    detections = backend.selector()(rows, 0.25, 0.45)  # the family's NMS / top scores, the same for all

val.py, detect.py, segment/val.py, segment/predict.py and torch.hub all load through here, so a
file export.py wrote is validated and deployed with exactly the code that scores its checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from utils.backends.augmented import AugmentedBackend
from utils.backends.base import BackendInfo, BackendRequest, InferenceBackend, as_backend, resolve_imgsz
from utils.backends.checkpoint import load_checkpoint_backend
from utils.backends.exported import leave_cores_to_runtime
from utils.backends.onnx_runtime import OnnxBackend
from utils.backends.openvino_runtime import OpenVinoBackend
from utils.backends.tensorrt_runtime import TensorRTBackend
from utils.backends.torchscript import TorchScriptBackend
from utils.errors import ConfigError

__all__ = [
    "AugmentedBackend",
    "BackendInfo",
    "BackendRequest",
    "InferenceBackend",
    "as_backend",
    "leave_cores_to_runtime",
    "load_backend",
    "resolve_imgsz",
]

# Exported files by suffix; any other file is read as a checkpoint, and a folder is an OpenVINO model
# (`best_openvino_model/`, `loader_for`'s folder branch). Another runtime is one ExportedBackend subclass
# (utils/backends/exported.py) with a `load(path, request)` classmethod, registered here.
EXPORTED_LOADERS: dict[str, Callable[[Path, BackendRequest], InferenceBackend]] = {
    ".torchscript": TorchScriptBackend.load,
    ".onnx": OnnxBackend.load,
    ".engine": TensorRTBackend.load,
}


def loader_for(path: Path) -> Callable[[Path, BackendRequest], InferenceBackend]:
    """The loader of `path`: an OpenVINO folder's, an exported file's by suffix, else the checkpoint loader.

    A folder without an OpenVINO model, or a missing path, is one line.
    """
    if path.is_dir():
        if any(path.glob("*.xml")):
            return OpenVinoBackend.load
        raise ConfigError(
            f"{path} is a folder without an OpenVINO model; give a .pt checkpoint or what export.py wrote "
            "(.torchscript, .onnx, .engine, *_openvino_model/)"
        )
    if not path.is_file():
        raise ConfigError(f"{path}: file not found")
    return EXPORTED_LOADERS.get(path.suffix.lower(), load_checkpoint_backend)


def load_backend(path: Path | str, request: BackendRequest) -> InferenceBackend:
    """Load `path` (checkpoint, .torchscript, .onnx, .engine or OpenVINO folder) for inference, in eval mode.

    Task, half precision, --nms and --augment are checked against what the file holds (one-line
    ConfigErrors naming it); the size to run at is checked by the caller with `resolve_imgsz`.
    """
    path = Path(path)
    if path.suffix.lower() == ".xml" and path.is_file():  # an OpenVINO model's .xml, as YOLOv5 takes it: its folder
        path = path.parent
    backend = loader_for(path)(path, request)
    return (AugmentedBackend(backend) if request.augment else backend).eval()
