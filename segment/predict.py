"""Predict with a segmentation checkpoint (boxes and masks): `python segment/predict.py --source dir`."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

# Run as a script, Python puts segment/ first on sys.path; the package imports need the project root instead.
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from segment.task import SEGMENT  # noqa: E402
from utils.cli.predict import predict_main, predict_run  # noqa: E402
from utils.errors import exit_on_user_error  # noqa: E402
from utils.predict.predictor import PredictResult  # noqa: E402


def main(argv: list[str] | None = None) -> PredictResult:
    """Parse the flags and run the shared predict entry point with the segmentation task (runs/predict-seg/exp)."""
    return predict_main(argv, SEGMENT)


def run(**options: Any) -> PredictResult:
    """segment/predict.py from Python, its flags as keywords (see the detection entry point's run())."""
    return predict_run(options, SEGMENT)


if __name__ == "__main__":
    exit_on_user_error(main)
