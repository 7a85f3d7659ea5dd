"""Inference backends: load a checkpoint or an exported file behind one interface (`load_backend`).

    backend = load_backend(Path("best.onnx"), BackendRequest(task="detect", script="val", device=device))
    rows, extra = backend(images)                    # the eval model's outputs, whatever the file
    detections = backend.selector()(rows, 0.25, 0.45)  # the family's NMS / top scores, the same for all

val.py, detect.py, segment/val.py, segment/predict.py and torch.hub all load through here, so a
file export.py wrote is validated and deployed with exactly the code that scores its checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from utils.backends.base import BackendInfo, BackendRequest, InferenceBackend, as_backend, resolve_imgsz
from utils.backends.checkpoint import load_checkpoint_backend
from utils.backends.onnx_runtime import OnnxBackend
from utils.backends.torchscript import TorchScriptBackend
from utils.errors import ConfigError

__all__ = ["BackendInfo", "BackendRequest", "InferenceBackend", "as_backend", "load_backend", "resolve_imgsz"]

# Exported files by suffix; any other file is read as a checkpoint. Another runtime is one ExportedBackend
# subclass (utils/backends/exported.py) with a `load(path, request)` classmethod, registered here: a TensorRT
# `.engine` by its suffix, an OpenVINO model folder (`best_openvino_model/`) in `loader_for`'s folder branch.
EXPORTED_LOADERS: dict[str, Callable[[Path, BackendRequest], InferenceBackend]] = {
    ".torchscript": TorchScriptBackend.load,
    ".onnx": OnnxBackend.load,
}


def loader_for(path: Path) -> Callable[[Path, BackendRequest], InferenceBackend]:
    """The loader of `path`: an exported file's by suffix, else the checkpoint loader; a bad path is one line."""
    if path.is_dir():
        raise ConfigError(f"{path} is a folder; give a .pt checkpoint or a file export.py wrote (.torchscript, .onnx)")
    if not path.is_file():
        raise ConfigError(f"{path}: file not found")
    return EXPORTED_LOADERS.get(path.suffix.lower(), load_checkpoint_backend)


def load_backend(path: Path | str, request: BackendRequest) -> InferenceBackend:
    """Load `path` (checkpoint, .torchscript or .onnx) for inference as `request` asks, in eval mode.

    Task, half precision and --nms are checked against what the file holds (one-line ConfigErrors
    naming it); the size to run at is checked by the caller with `resolve_imgsz`.
    """
    path = Path(path)
    return loader_for(path)(path, request).eval()
