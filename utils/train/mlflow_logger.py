"""MLflowLogger: a run's options, per-epoch results.csv columns and files in MLflow (rank 0, optional package).

On with `--mlflow`, or when `MLFLOW_TRACKING_URI` is set. Runs go to the tracking URI in
`MLFLOW_TRACKING_URI` (a server, or e.g. `sqlite:///mlflow.db`), else to MLflow's own default
local store (MLflow 3: `./mlflow.db`, artifacts under `./mlruns`), in the experiment named by
`MLFLOW_EXPERIMENT_NAME`, else the run folder's parent (`train`, `train-seg`). The MLflow run is
named like the run folder; its id and store are kept in every checkpoint (callback state), so `--resume`
and elastic restarts continue the same MLflow run, in that store when `MLFLOW_TRACKING_URI` is not set;
options a resume changes (`--epochs`...) become `resumed/<key>` tags, as MLflow's params cannot change.
MLflow never costs the training run: a missing package, an unreachable server or a failed call is one
warning and logging stops.
"""

from __future__ import annotations

import logging
import math
import os
import re
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from utils.errors import Preempted
from utils.runs import FIGURE_SUFFIXES
from utils.train.trackers import import_tracker, server_answers

if TYPE_CHECKING:
    from utils.callbacks import TrainEvent

LOGGER = logging.getLogger(__name__)
STATE_KEY = "mlflow"  # its entry in the callbacks' checkpointed state: {"run_id": ..., "tracking_uri": ...}
# Fail fast instead of MLflow's default of 7 retries with backoff (minutes on rank 0 while the others wait).
HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_TIMEOUT": "20"}
MAX_PARAM_LENGTH = 6000  # MLflow's limit on a param value
RESUMED_TAG = "resumed/"  # a continued run's options that differ from its (immutable) params: resumed/epochs, ...


def mlflow_wanted(flag: bool) -> bool:
    """Whether to log to MLflow: `--mlflow`, or a tracking URI in the environment."""
    return flag or bool(os.environ.get("MLFLOW_TRACKING_URI"))


class MLflowLogger:
    """Training callbacks (utils/callbacks.py) that log the run to MLflow through an `MlflowClient`.

    A client object, not MLflow's module-level active run: nothing is left set in the process
    after the run, and two runs in one process do not mix.
    """

    def __init__(self, explicit: bool) -> None:
        self.explicit = explicit  # --mlflow given: a missing package is a warning, not an info line
        self.client: Any = None
        self.run_id = ""
        self._saved_env: dict[str, str | None] = {}

    def on_pretrain_routine_end(self, event: TrainEvent) -> None:
        """Connect, then start a new MLflow run (logging the options as params) or continue the checkpoint's."""
        tracking = import_tracker("mlflow.tracking", "MLflow", "mlflow", self.explicit, LOGGER)
        if tracking is None:
            return
        uri = os.environ.get("MLFLOW_TRACKING_URI", "")
        stored_uri = (event.state.get(STATE_KEY) or {}).get("tracking_uri", "")
        if not uri and stored_uri:  # a resume without the variable: the store the run is in, not MLflow's default
            uri = stored_uri
            LOGGER.info(f"MLflow: MLFLOW_TRACKING_URI is not set; continuing in the checkpoint's store {uri}")
        unreachable = "MLflow: no tracking server at {url} ({reason}); training goes on without MLflow"
        if uri.startswith(("http://", "https://")) and not server_answers(uri, "/health", unreachable, LOGGER):
            return
        self._set_http_defaults()
        self._call("start", lambda: self._start(tracking.MlflowClient(uri or None), event))

    def on_fit_epoch_end(self, event: TrainEvent) -> None:
        """Every numeric, finite results.csv column of the epoch as a metric at step = epoch."""
        if self.client is None or event.row is None:
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [
            Metric(metric_name(key), float(value), now, int(event.row["epoch"]))
            for key, value in event.row.items()
            if key != "epoch" and isinstance(value, int | float) and math.isfinite(value)
        ]
        self._call("log metrics", lambda: self.client.log_batch(self.run_id, metrics=metrics))

    def on_train_end(self, event: TrainEvent) -> None:
        """best.pt, results.csv, opt.yaml, hyp.yaml and the figures as artifacts; the final metrics too."""
        if self.client is None:
            return
        from mlflow.entities import Metric

        run_dir = event.run_dir
        best = getattr(event.result, "best", None)
        files = [run_dir / name for name in ("results.csv", "opt.yaml", "hyp.yaml")]
        files += sorted(path for path in run_dir.iterdir() if path.suffix in FIGURE_SUFFIXES)
        now = int(time.time() * 1000)
        # At the run's epoch count: a run resumed to train more epochs logs its new final scores after the old.
        step = int(getattr(event.result, "epochs_done", 0))
        final = [Metric(metric_name(f"final/{key}"), float(v), now, step) for key, v in (event.metrics or {}).items()]

        def log() -> None:
            self.client.log_batch(self.run_id, metrics=final)
            for path in files:
                if path.is_file():
                    self.client.log_artifact(self.run_id, str(path))
            if best is not None and Path(best).is_file():
                self.client.log_artifact(self.run_id, str(best), "weights")

        self._call("log artifacts", log)

    def teardown(self, event: TrainEvent) -> None:
        """End the MLflow run: FINISHED, KILLED (preempted or interrupted; a resume continues it) or FAILED."""
        try:
            if self.client is not None:
                status = "FINISHED" if event.error is None else _failed_status(event.error)
                self._call("end the run", lambda: self.client.set_terminated(self.run_id, status))
        finally:
            self.client = None
            self._restore_env()

    def _start(self, client: Any, event: TrainEvent) -> None:
        """Continue the checkpoint's MLflow run when it exists on this server, else create one with the options."""
        stored = event.state.get(STATE_KEY) or {}
        run_id, where = stored.get("run_id", ""), absolute_store_uri(client.tracking_uri)
        found = _find_run(client, run_id) if run_id else None
        if found is not None:
            client.update_run(run_id, status="RUNNING")
            _tag_changed_options(client, found, event.options)
            LOGGER.info(f"MLflow: continuing run {run_id} at {where}")
        else:
            if run_id:
                logged_to = stored.get("tracking_uri") or "another store"
                LOGGER.warning(
                    f"MLflow: run {run_id} of the checkpoint (logged to {logged_to}) is not on {where}; "
                    "starting a new one"
                )
            name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or event.run_dir.parent.name
            experiment = client.get_experiment_by_name(name)
            experiment_id = experiment.experiment_id if experiment is not None else client.create_experiment(name)
            run = client.create_run(experiment_id, run_name=event.run_dir.name, tags={"run_dir": str(event.run_dir)})
            run_id = run.info.run_id
            for chunk in _chunks(list(params(event.options)), 100):  # MLflow takes at most 100 params per call
                client.log_batch(run_id, params=chunk)
            LOGGER.info(f"MLflow: logging run {run_id} ({event.run_dir.name}) to {where}, experiment {name}")
        self.client, self.run_id = client, run_id
        event.state[STATE_KEY] = {"run_id": run_id, "tracking_uri": str(where)}

    def _call(self, what: str, action: Any) -> None:
        """Run `action`; a failure is one warning and stops MLflow logging for the rest of the run."""
        try:
            action()
        except Exception as error:  # noqa: BLE001 - the tracker must never cost the training run
            message = str(error).splitlines()[0] if str(error) else ""
            LOGGER.warning(f"MLflow: could not {what}, not logging any more: {type(error).__name__}: {message}")
            self.client = None

    def _set_http_defaults(self) -> None:
        for key, value in HTTP_DEFAULTS.items():
            if key not in os.environ:
                self._saved_env[key] = None
                os.environ[key] = value

    def _restore_env(self) -> None:
        for key in self._saved_env:
            os.environ.pop(key, None)
        self._saved_env = {}


def params(options: Mapping[str, Any]) -> Iterator[Any]:
    """The resolved options as MLflow params; the hyp's values as `hyp/<key>`."""
    from mlflow.entities import Param

    for key, value in options.items():
        if key == "hyp" and isinstance(value, Mapping):
            for name, item in value.items():
                yield Param(f"hyp/{name}", str(item)[:MAX_PARAM_LENGTH])
        else:
            yield Param(key, str(value)[:MAX_PARAM_LENGTH])


def metric_name(column: str) -> str:
    """A results.csv column as an MLflow metric name (letters, digits, _ - . space / are allowed; others become _)."""
    return re.sub(r"[^\w\-. /]", "_", column)


def absolute_store_uri(uri: str) -> str:
    """`uri` with a relative local path made absolute (`sqlite:///mlflow.db`, `./mlruns`); others as they are.

    The checkpoint keeps this form, so a resume started in another folder finds the same store.
    """
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        return f"sqlite:///{Path(uri.removeprefix('sqlite:///')).resolve()}"
    if uri and uri != "databricks" and not urlparse(uri).scheme:  # a plain path: a file store
        return str(Path(uri).resolve())
    return uri


def _chunks(items: list[Any], size: int) -> Iterator[list[Any]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def _find_run(client: Any, run_id: str) -> Any:
    """The MLflow run `run_id` on the client's store, or None when it is not there."""
    try:
        return client.get_run(run_id)
    except Exception:  # noqa: BLE001 - MlflowException (not found), or a store of another kind
        return None


def _tag_changed_options(client: Any, run: Any, options: Mapping[str, Any]) -> None:
    """Set `resumed/<key>` tags for the options a continued run has that differ from its params.

    MLflow refuses a new value for a logged param, so the params keep what the run started with and
    a resume's other `--epochs`, `--batch-size`, `--patience`, `--device`... show as tags. Tags of an
    earlier resume that this one no longer differs in are deleted, so the tags always say what the
    latest attempt ran with.
    """
    from mlflow.entities import RunTag

    logged = run.data.params
    changed = {param.key: param.value for param in params(options) if logged.get(param.key) != param.value}
    tags = [RunTag(f"{RESUMED_TAG}{key}", value) for key, value in changed.items()]
    for chunk in _chunks(tags, 100):  # MLflow takes at most 100 tags per call
        client.log_batch(run.info.run_id, tags=chunk)
    for tag in run.data.tags:
        if tag.startswith(RESUMED_TAG) and tag.removeprefix(RESUMED_TAG) not in changed:
            client.delete_tag(run.info.run_id, tag)


def _failed_status(error: BaseException) -> str:
    """KILLED for a stop the run can resume from (preemption, Ctrl-C), FAILED for an error."""
    return "KILLED" if isinstance(error, Preempted | KeyboardInterrupt) else "FAILED"
