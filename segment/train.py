"""Train instance segmentation: `python segment/train.py`, or `torchrun --nproc_per_node N segment/train.py`."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

# Run as a script, Python puts segment/ first on sys.path; the package imports need the project root instead.
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from segment.training import SEGMENT_TRAINING  # noqa: E402
from utils.cli.train import train_main, train_run  # noqa: E402
from utils.errors import exit_on_user_error  # noqa: E402
from utils.train.state import FitResult  # noqa: E402


def main(argv: list[str] | None = None) -> FitResult:
    """Parse the flags and run the shared train entry point with the segmentation task."""
    return train_main(argv, SEGMENT_TRAINING)


def run(callbacks: Any = None, **options: Any) -> FitResult:
    """segment/train.py from Python, its flags as keywords (see the detection entry point's run())."""
    return train_run(options, SEGMENT_TRAINING, callbacks)


if __name__ == "__main__":
    exit_on_user_error(main)
