"""The callbacks every tune trial trains with (`--callbacks utils.tune.report`): its outcome in trial.json.

The tuner reads the trial's per-epoch scores from results.csv while it runs; what results.csv does
not hold is written here, on rank 0, into the trial's run folder: the final validation of best.pt
(the fitness), the epochs run and best.pt's path when the run finishes, or the error that ended it.
The file is replaced atomically, so the tuner never reads half of it. Nothing here imports Optuna:
the trial is a plain training run.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from utils.callbacks import TrainEvent

RESULT_FILE = "trial.json"


def on_train_end(event: TrainEvent) -> None:
    """The run finished: its final metrics (best.pt validated once more), epochs run and weights."""
    result = event.result
    _write(event.run_dir, {"metrics": dict(result.metrics), "epochs": result.epochs_done, "best": str(result.best)})


def teardown(event: TrainEvent) -> None:
    """The run failed: the error's type and message (a finished run keeps what on_train_end wrote)."""
    if event.error is not None:
        message = " ".join(str(event.error).split()) or "no message"
        _write(event.run_dir, {"error": f"{type(event.error).__name__}: {message}"})


def read_trial_result(run_dir: Path) -> dict[str, Any] | None:
    """What a trial's run folder says about its end; None when it wrote nothing (killed, or never started)."""
    path = Path(run_dir) / RESULT_FILE
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _write(run_dir: Path, content: dict[str, Any]) -> None:
    """Write trial.json atomically (a temporary file renamed over it)."""
    tmp = run_dir / f".{RESULT_FILE}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(content, default=float), encoding="utf-8")
    os.replace(tmp, run_dir / RESULT_FILE)
