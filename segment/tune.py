"""Tune a YOLO segmentation model's hyperparameters: `python segment/tune.py --data my-seg.yaml --trials 30`."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

# Run as a script, Python puts segment/ first on sys.path; the package imports need the project root instead.
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from segment.training import SEGMENT_TRAINING  # noqa: E402
from utils.cli.tune import tune_main, tune_run  # noqa: E402
from utils.errors import exit_on_user_error  # noqa: E402

if TYPE_CHECKING:
    from utils.tune.results import StudySummary


def main(argv: list[str] | None = None) -> StudySummary:
    """Parse the flags and run (or resume) the study; each trial is segment/train.py in a fresh process."""
    return tune_main(argv, SEGMENT_TRAINING)


def run(**options: Any) -> StudySummary:
    """segment/tune.py from Python, its flags as keywords (see the detection entry point's run())."""
    return tune_run(options, SEGMENT_TRAINING)


if __name__ == "__main__":
    exit_on_user_error(main)
