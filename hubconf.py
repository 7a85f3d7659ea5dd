"""torch.hub entry points: `torch.hub.load("path/to/this/repo", "custom", path="best.pt", source="local")`.

`custom` loads a checkpoint (ours, or a YOLOv5 / Ultralytics .pt, converted in memory) or a
.torchscript / .onnx / .engine file or OpenVINO folder export.py wrote; the size
names (`yolov5n`, `yolov5s6`, `yolo11s`, `yolo26m_seg`, ...) build that model with random weights. Nothing is
ever downloaded. The returned model takes paths, numpy arrays or PIL images and returns
detections as data (utils/predict/hub.py; docs/python-api.md).
"""

from __future__ import annotations

dependencies = ["torch", "torchvision", "numpy", "cv2", "yaml", "pycocotools"]


def custom(path: str, device: str = "", nms: bool = False):  # noqa: ANN201 - a Detector; imported lazily
    """Load a checkpoint or exported file `path` on `device` ('' = GPU when present); `nms` as val.py --nms."""
    from segment.task import SEGMENT
    from utils.predict.hub import Detector
    from utils.tasks import DETECT

    return Detector.from_checkpoint(path, {DETECT.name: DETECT, SEGMENT.name: SEGMENT}, device, nms)


def _size_entry(name: str):  # noqa: ANN202
    def entry(pretrained: bool = False, classes: int = 80, device: str = ""):  # noqa: ANN202
        from segment.task import SEGMENT
        from utils.errors import ConfigError
        from utils.predict.hub import scratch_detector
        from utils.tasks import DETECT

        if pretrained:
            raise ConfigError(f"{name}: no weights are downloaded; load a file with custom(path=...)")
        return scratch_detector(name, SEGMENT if name.endswith("-seg") else DETECT, classes, device)

    entry.__name__ = name.replace("-", "_")
    entry.__doc__ = f"{name} with random weights and `classes` classes (pretrained weights: use custom(path=...))."
    return entry


_NAMES = [f"{layout}{size}{seg}" for layout in ("yolov5", "yolov8", "yolo11", "yolo26") for size in "nsmlx"
          for seg in ("", "-seg")]  # fmt: skip
_NAMES += [f"yolov5{size}6" for size in "nsmlx"]  # the P6 models: detection only
globals().update({name.replace("-", "_"): _size_entry(name) for name in _NAMES})
