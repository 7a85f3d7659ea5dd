"""Named training events for code that follows a run (loggers, trackers, notebooks): `Callbacks` and `TrainEvent`.

Events fire on rank 0 only, in this order (YOLOv5's names where it has the event):

    on_pretrain_routine_end   the run folder, options and data are ready; nothing trained yet
    on_train_epoch_start      before each epoch's batches
    on_train_epoch_end        after the epoch's batches (`row` holds the train losses and learning rates)
    on_val_end                after a validation (`metrics`), every validated epoch and the final one
    on_fit_epoch_end          the epoch's results.csv row is written (`row`)
    on_model_save             last.pt (and best.pt when it improved) were written (`path`: last.pt); also
                              after a mid-epoch save (`batch`: the batches of `epoch` it holds)
    on_figure                 a figure file was written (`path`: train_batch0.jpg, results.png, ...)
    on_train_end              the run finished (`result`: FitResult with best/last paths and final metrics)
    teardown                  always last, also when the run failed (`error`)

A callback takes one argument, the `TrainEvent`. One that raises is reported in one warning line
and the run goes on: what a callback does can never stop or corrupt training. `state` is a dict
kept in every checkpoint, so a resumed or restarted run gives a callback back what it stored
there (MLflow keeps its run id in it).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from utils.errors import ConfigError

LOGGER = logging.getLogger(__name__)
EVENTS = (
    "on_pretrain_routine_end",
    "on_train_epoch_start",
    "on_train_epoch_end",
    "on_val_end",
    "on_fit_epoch_end",
    "on_model_save",
    "on_figure",
    "on_train_end",
    "teardown",
)
Callback = Callable[["TrainEvent"], object]


@dataclass(frozen=True)
class TrainEvent:
    """What a callback is told. Fields an event does not concern are None (see the module docstring)."""

    name: str  # the event
    run_dir: Path
    options: Mapping[str, Any]  # the resolved training options, as opt.yaml holds them (hyp nested under "hyp")
    epochs: int  # the run's --epochs
    state: dict[str, Any]  # persisted in checkpoints: a callback's own records across resumes
    epoch: int | None = None  # 1-based, as results.csv counts
    row: Mapping[str, Any] | None = None  # results.csv columns (on_train_epoch_end: the train ones so far)
    metrics: Mapping[str, float] | None = None  # on_val_end: P, R, mAP50, mAP50-95 (and mask_*), fitness
    path: Path | None = None  # on_model_save: last.pt; on_figure: the file
    batch: int | None = None  # on_model_save of a mid-epoch save: the batches of `epoch` trained; else None
    result: Any = None  # on_train_end: the FitResult
    error: BaseException | None = None  # teardown: what ended the run, None when it finished
    final: bool = False  # on_val_end: the final validation of best.pt


@dataclass
class Callbacks:
    """Callbacks per event name. `fire` calls them (rank 0 only: `enabled` is False elsewhere)."""

    handlers: dict[str, list[Callback]] = field(default_factory=lambda: {name: [] for name in EVENTS})
    state: dict[str, Any] = field(default_factory=dict)
    enabled: bool = True

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, Callback | Iterable[Callback]] | None) -> Callbacks:
        """Build from {event: callable or list of callables}; an unknown event or a non-callable is a ConfigError."""
        callbacks = cls()
        for event, value in (mapping or {}).items():
            for function in [value] if callable(value) else list(value):
                callbacks.add(event, function)
        return callbacks

    def add(self, event: str, function: Callback) -> None:
        """Register `function` for `event` (after those already registered)."""
        if event not in self.handlers:
            raise ConfigError(f"callback event {event!r} is not one of {', '.join(EVENTS)}")
        if not callable(function):
            raise ConfigError(f"callback for {event} is a {type(function).__name__}, not a function")
        self.handlers[event].append(function)

    def add_object(self, target: object) -> None:
        """Register every attribute of `target` (a module or an object) named like an event and callable."""
        for event in EVENTS:
            function = getattr(target, event, None)
            if callable(function):
                self.handlers[event].append(function)

    def merge(self, other: Callbacks) -> None:
        """Register `other`'s callbacks after this one's."""
        for event, functions in other.handlers.items():
            self.handlers[event].extend(functions)

    def listening(self, event: str) -> bool:
        """Whether `fire(event)` would call anything (False off rank 0): callers skip building its fields."""
        return self.enabled and bool(self.handlers[event])

    def fire(self, event: str, **fields: Any) -> None:
        """Call `event`'s callbacks with a TrainEvent built from `fields`; each failure is one warning."""
        if not self.listening(event):
            return
        info = TrainEvent(name=event, state=self.state, **fields)
        for function in self.handlers[event]:
            try:
                function(info)
            except Exception as error:  # noqa: BLE001 - a follower of the run must not end it
                where = getattr(function, "__qualname__", repr(function))
                LOGGER.warning(f"callback {where} ({event}) failed, training goes on: {type(error).__name__}: {error}")


def load_callback_modules(names: Iterable[str]) -> Callbacks:
    """Import each module named on the command line (`pkg.module` or a path to a .py file) and register its events.

    A module registers its top-level functions named like an event, and every object in its
    `callbacks` list (objects with event-named methods, e.g. a logger class instance).
    """
    callbacks = Callbacks()
    for name in names:
        module = _import(name)
        callbacks.add_object(module)
        for target in getattr(module, "callbacks", ()):
            callbacks.add_object(target)
        if not any(callable(getattr(module, event, None)) for event in EVENTS) and not getattr(module, "callbacks", ()):
            raise ConfigError(f"--callbacks {name}: defines no function named like an event ({', '.join(EVENTS)})")
    return callbacks


def _import(name: str) -> Any:
    """Import module `name`, or the Python file at path `name`; a failure is a one-line ConfigError."""
    try:
        if name.endswith(".py"):
            path = Path(name)
            if not path.is_file():
                raise ConfigError(f"--callbacks {name}: file not found")
            spec = importlib.util.spec_from_file_location(f"_yolo_callbacks_{path.stem}", path)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module  # while it runs: dataclasses and typing look their module up there
            spec.loader.exec_module(module)
            return module
        return importlib.import_module(name)
    except ConfigError:
        raise
    except Exception as error:  # noqa: BLE001 - the user's module: report what failed, in one line
        line = str(error).splitlines()[0] if str(error) else ""
        raise ConfigError(f"--callbacks {name}: import failed: {type(error).__name__}: {line}") from error
    finally:
        sys.modules.pop(f"_yolo_callbacks_{Path(name).stem}", None)
