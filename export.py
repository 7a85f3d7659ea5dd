"""Export a checkpoint to TorchScript and ONNX: `python export.py --weights best.pt --include torchscript onnx`."""

from __future__ import annotations

from segment.task import SEGMENT
from utils.cli import exit_on_user_error, export_main
from utils.export import ExportedFile
from utils.tasks import DETECT


def main(argv: list[str] | None = None) -> list[ExportedFile]:
    """Parse the flags and export; the task (detect or segment) is read from the checkpoint itself."""
    return export_main(argv, {DETECT.name: DETECT, SEGMENT.name: SEGMENT})


if __name__ == "__main__":
    exit_on_user_error(main)
