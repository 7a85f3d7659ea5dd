"""Export a checkpoint to TorchScript and ONNX: `python export.py --weights best.pt --include torchscript onnx`."""

from __future__ import annotations

from typing import Any

from segment.task import SEGMENT
from utils.cli.export import export_main, export_run
from utils.errors import exit_on_user_error
from utils.export import ExportedFile
from utils.tasks import DETECT

TASKS = {DETECT.name: DETECT, SEGMENT.name: SEGMENT}  # a checkpoint's `task` field -> its Task


def main(argv: list[str] | None = None) -> list[ExportedFile]:
    """Parse the flags and export; the task (detect or segment) is read from the checkpoint itself."""
    return export_main(argv, TASKS)


def run(**options: Any) -> list[ExportedFile]:
    """Export from Python with export.py's flags as keywords: `export.run(weights="best.pt", include=["onnx"])`."""
    return export_run(options, TASKS)


if __name__ == "__main__":
    exit_on_user_error(main)
