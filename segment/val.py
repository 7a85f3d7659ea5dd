"""Validate a segmentation checkpoint (boxes and masks): `python segment/val.py --weights best.pt`."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

# Run as a script, Python puts segment/ first on sys.path; the package imports need the project root instead.
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from segment.task import SEGMENT  # noqa: E402
from utils.cli.val import val_main, val_run  # noqa: E402
from utils.errors import exit_on_user_error  # noqa: E402
from utils.eval.evaluate import EvalResult  # noqa: E402


def main(argv: list[str] | None = None) -> EvalResult:
    """Parse the flags and run the shared val entry point with the segmentation task."""
    return val_main(argv, SEGMENT)


def run(**options: Any) -> EvalResult:
    """segment/val.py from Python, its flags as keywords (see the detection entry point's run())."""
    return val_run(options, SEGMENT)


if __name__ == "__main__":
    exit_on_user_error(main)
