"""TensorBoardLogger: a run's results.csv columns per epoch and its figures as TensorBoard events (rank 0, optional)."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import cv2

from utils.data.cache import read_image
from utils.distributed import DistContext

if TYPE_CHECKING:
    from utils.callbacks import TrainEvent

LOGGER = logging.getLogger(__name__)
INSTALL_HINT = "TensorBoard: not installed (`pip install tensorboard` to log losses, metrics and plots for it)"


class TensorBoardLogger:
    """Write a training run's per-epoch scalars and its figures as TensorBoard events in the run folder.

    Rank 0 only, and only when the `tensorboard` package (which `torch.utils.tensorboard` needs)
    is installed: otherwise start-up logs one line saying how to enable it and every method does
    nothing, so the engine calls it unconditionally. A writer that cannot start is a warning, never
    a failed run. Training registers it as callbacks (`on_fit_epoch_end`, `on_figure`, `teardown`,
    which closes the writer, flushing its events, whether the run finished or failed); used
    directly, it is a context manager that closes the writer on exit.
    """

    def __init__(self, run_dir: Path, ctx: DistContext) -> None:
        self.writer: Any = _open_writer(run_dir) if ctx.is_main else None
        self.epoch = 0  # the step images are logged at: the last epoch logged (1-based), 0 before the first

    def log_epoch(self, row: dict[str, Any]) -> None:
        """Add every numeric column of a results.csv `row` as a scalar at step `row["epoch"]` (1-based).

        Tags are the results.csv column names (`train/box_loss`, `metrics/mAP50`, `lr/pg0`, ...);
        NaN values (metrics of an epoch that was not validated) are left out, not drawn as gaps.
        """
        if self.writer is None:
            return
        self.epoch = int(row["epoch"])
        for tag, value in row.items():
            if tag != "epoch" and isinstance(value, int | float) and math.isfinite(value):
                self.writer.add_scalar(tag, value, self.epoch)
        self.writer.flush()  # an epoch is minutes: show it now, not after the writer's 2-minute flush period

    def add_figure(self, path: Path) -> None:
        """Add image file `path` (train_batch0.jpg, results.png, ...) tagged by its stem, at the last epoch logged.

        A figure that cannot be read or added is a warning: this runs on rank 0 alone (inside the
        first training steps, too), where raising would leave the other ranks waiting.
        """
        if self.writer is None:
            return
        image = read_image(str(path))
        if image is None:
            LOGGER.warning(f"TensorBoard: could not read {path}; not logged")
            return
        try:
            self.writer.add_image(path.stem, cv2.cvtColor(image, cv2.COLOR_BGR2RGB), self.epoch, dataformats="HWC")
        except Exception as error:  # noqa: BLE001 - see the docstring
            LOGGER.warning(f"TensorBoard: {path.name} not logged: {type(error).__name__}: {error}")

    def add_figures(self, paths: Iterable[Path]) -> None:
        """`add_figure` each of `paths`."""
        for path in paths:
            self.add_figure(path)

    # Its events (utils/callbacks.py): the engine registers the logger's methods named like them.
    def on_fit_epoch_end(self, event: TrainEvent) -> None:
        """Log the epoch's results.csv row."""
        if event.row is not None:
            self.log_epoch(event.row)

    def on_figure(self, event: TrainEvent) -> None:
        """Add the figure just written."""
        if event.path is not None:
            self.add_figure(event.path)

    def teardown(self, event: TrainEvent) -> None:
        """Close the writer when the run ends, finished or failed."""
        self.close()

    def close(self) -> None:
        """Flush and close the writer; later calls do nothing."""
        if self.writer is not None:
            self.writer.close()
            self.writer = None

    def __enter__(self) -> TensorBoardLogger:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()


def _open_writer(run_dir: Path) -> Any:
    """Return a SummaryWriter on `run_dir`, or None (logged) when TensorBoard is missing or cannot start."""
    try:
        from torch.utils.tensorboard import SummaryWriter  # needs the optional `tensorboard` package

        writer = SummaryWriter(str(run_dir))
    except ImportError:
        LOGGER.info(INSTALL_HINT)
        return None
    except Exception as error:  # noqa: BLE001 - a broken install (e.g. a protobuf clash) must not fail the run
        LOGGER.warning(f"TensorBoard: not logging ({type(error).__name__}: {error})")
        return None
    LOGGER.info(f"TensorBoard: Start with 'tensorboard --logdir {run_dir.parent}', view at http://localhost:6006/")
    return writer
