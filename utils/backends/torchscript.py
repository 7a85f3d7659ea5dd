"""The TorchScript backend: a `.torchscript` file from export.py, run with torch.jit."""

from __future__ import annotations

from pathlib import Path

import torch

from utils.backends.base import BackendInfo, BackendRequest
from utils.backends.exported import ExportedBackend, check_request, exported_info
from utils.backends.metadata import (
    TORCHSCRIPT_METADATA_FILE,
    parse_torchscript_metadata,
    without_torchscript_deprecation,
)
from utils.errors import ConfigError, error_reason


class TorchScriptBackend(ExportedBackend):
    """A traced export: runs any batch and any multiple-of-stride size, in the dtype it was traced in."""

    def __init__(self, info: BackendInfo, device: torch.device, module: torch.jit.ScriptModule) -> None:
        super().__init__(info, device)
        self.module = module.eval()

    @classmethod
    def load(cls, path: Path, request: BackendRequest) -> TorchScriptBackend:
        """Load `path` onto `request.device` with its metadata (config.txt); refuse what it cannot do, in one line."""
        extra_files = {TORCHSCRIPT_METADATA_FILE: ""}
        try:
            with without_torchscript_deprecation():
                module = torch.jit.load(str(path), _extra_files=extra_files, map_location=request.device)
        except (RuntimeError, ValueError) as error:
            reason = error_reason(error)
            raise ConfigError(f"{path}: not a TorchScript file torch can load ({reason})") from error
        info = exported_info(path, parse_torchscript_metadata(extra_files[TORCHSCRIPT_METADATA_FILE]), "torchscript")
        check_request(info, request)
        return cls(info, request.device, module)

    def run_file(self, images: torch.Tensor) -> list[torch.Tensor]:
        with torch.no_grad():
            outputs = self.module(images)
        return list(outputs) if isinstance(outputs, tuple | list) else [outputs]
