"""WandbLogger: a run's options, per-epoch results.csv columns, best.pt and figures in Weights & Biases (rank 0).

On with `--wandb`, or when `WANDB_PROJECT` is set; W&B's own variables apply (`WANDB_MODE=offline`
writes the run under the run folder for a later `wandb sync`, `WANDB_ENTITY`, `WANDB_BASE_URL`, the
API key). The project is `WANDB_PROJECT`, else the run folder's parent (`train`, `train-seg`); the
W&B run is named like the run folder. Its id is kept in every checkpoint (callback state), so
`--resume` and elastic restarts continue the same W&B run. W&B never costs the training run: a missing
package, an unreachable server or a failed call is one warning and logging stops.
"""

from __future__ import annotations

import logging
import math
import os
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from utils.errors import Preempted
from utils.runs import FIGURE_SUFFIXES
from utils.train.trackers import import_tracker, server_answers

if TYPE_CHECKING:
    from utils.callbacks import TrainEvent

LOGGER = logging.getLogger(__name__)
STATE_KEY = "wandb"  # its entry in the callbacks' checkpointed state: {"run_id": ..., "project": ...}
DEFAULT_BASE_URL = "https://api.wandb.ai"


def wandb_wanted(flag: bool) -> bool:
    """Whether to log to W&B: `--wandb`, or a project named in the environment."""
    return flag or bool(os.environ.get("WANDB_PROJECT"))


class WandbLogger:
    """Training callbacks (utils/callbacks.py) that log the run to W&B through its `Run` object.

    The Run returned by `wandb.init(reinit="create_new")`, never W&B's module-level run, so two
    training runs in one process do not mix. Metrics are logged against `epoch` (not W&B's own step),
    so a resumed run that repeats an epoch is logged, not dropped.
    """

    def __init__(self, explicit: bool) -> None:
        self.explicit = explicit  # --wandb given: a missing package is a warning, not an info line
        self.run: Any = None

    def on_pretrain_routine_end(self, event: TrainEvent) -> None:
        """Connect, then start a W&B run with the options as its config, or continue the checkpoint's."""
        wandb = import_tracker("wandb", "W&B", "wandb", self.explicit, LOGGER)
        if wandb is None:
            return
        mode = os.environ.get("WANDB_MODE", "online")
        server = os.environ.get("WANDB_BASE_URL") or DEFAULT_BASE_URL
        unreachable = ("W&B: no server at {url} ({reason}); training goes on without W&B (WANDB_MODE=offline keeps "
                       "the run locally)")  # fmt: skip
        if mode == "disabled" or (mode == "online" and not server_answers(server, "/healthz", unreachable, LOGGER)):
            return
        if mode == "online" and not _has_credentials(wandb):
            LOGGER.warning(
                "W&B: no API key (WANDB_API_KEY, or `wandb login` once); training goes on without W&B "
                "(WANDB_MODE=offline keeps the run locally)"
            )
            return
        self._call("start", lambda: self._start(wandb, event))

    def on_fit_epoch_end(self, event: TrainEvent) -> None:
        """Every numeric, finite results.csv column of the epoch, against the epoch."""
        if self.run is None or event.row is None:
            return
        row = {key: float(value) for key, value in event.row.items() if _finite(value)}
        self._call("log metrics", lambda: self.run.log(row))

    def on_train_end(self, event: TrainEvent) -> None:
        """Final metrics in the summary; best.pt as a model artifact; results.csv, opt/hyp.yaml, figures as another."""
        if self.run is None:
            return
        import wandb

        run_dir, best = event.run_dir, getattr(event.result, "best", None)

        def log() -> None:
            for key, value in (event.metrics or {}).items():
                self.run.summary[f"final/{key}"] = float(value)
            if best is not None and Path(best).is_file():
                model = wandb.Artifact(f"model-{self.run.id}", type="model", metadata=dict(event.metrics or {}))
                model.add_file(str(best), name="best.pt")
                self.run.log_artifact(model, aliases=["best", "latest"])
            files = [run_dir / name for name in ("results.csv", "opt.yaml", "hyp.yaml")]
            files += sorted(path for path in run_dir.iterdir() if path.suffix in FIGURE_SUFFIXES)
            results = wandb.Artifact(f"results-{self.run.id}", type="results")
            for path in files:
                if path.is_file():
                    results.add_file(str(path))
            self.run.log_artifact(results)

        self._call("log artifacts", log)

    def teardown(self, event: TrainEvent) -> None:
        """Finish the W&B run: exit code 0 when the run finished, else 1 (preempted runs are marked so)."""
        run, self.run = self.run, None
        if run is None:
            return
        if isinstance(event.error, Preempted | KeyboardInterrupt):
            self.run = run
            self._call("mark the run preempted", run.mark_preempting)
            self.run = None
        try:
            run.finish(exit_code=0 if event.error is None else 1)
        except Exception as error:  # noqa: BLE001 - the tracker must never cost the training run
            LOGGER.warning(f"W&B: could not finish the run: {type(error).__name__}: {_first_line(error)}")

    def _start(self, wandb: Any, event: TrainEvent) -> None:
        """wandb.init with the checkpoint's run id when it has one (resume="allow"), else a new id."""
        stored = event.state.get(STATE_KEY) or {}
        run_id = stored.get("run_id") or uuid.uuid4().hex[:8]  # W&B's own ids: 8 lowercase letters and digits
        project = os.environ.get("WANDB_PROJECT") or stored.get("project") or event.run_dir.parent.name
        run = wandb.init(
            project=project, name=event.run_dir.name, id=run_id, resume="allow", dir=str(event.run_dir),
            config=dict(event.options), reinit="create_new", settings=wandb.Settings(silent=True),
        )  # fmt: skip
        run.define_metric("epoch")
        run.define_metric("*", step_metric="epoch")
        self.run = run
        event.state[STATE_KEY] = {"run_id": run_id, "project": project}
        verb = "continuing" if stored.get("run_id") else "logging"
        LOGGER.info(f"W&B: {verb} run {run_id} ({event.run_dir.name}), project {project}, mode {run.settings.mode}")

    def _call(self, what: str, action: Any) -> None:
        """Run `action`; a failure is one warning and stops W&B logging for the rest of the run."""
        try:
            action()
        except Exception as error:  # noqa: BLE001 - the tracker must never cost the training run
            reason = f"{type(error).__name__}: {_first_line(error)}"
            LOGGER.warning(f"W&B: could not {what}, not logging any more: {reason}")
            run, self.run = self.run, None
            if run is not None:
                try:
                    run.finish(exit_code=1)
                except Exception:  # noqa: BLE001 - already broken; nothing more to say
                    pass


def _has_credentials(wandb: Any) -> bool:
    """Whether W&B has an API key (environment, settings or .netrc), asked without a prompt: wandb.init would
    otherwise prompt for one on a terminal, and wait there (the other ranks until --dist-timeout) or, with
    stdin closed, end the run with a KeyboardInterrupt."""
    try:
        return bool(wandb.login(prompt=False, verify=False))
    except TypeError:  # a wandb without `prompt`: wandb.init decides, as before
        return True
    except Exception:  # noqa: BLE001 - a settings file it cannot read: no key to use
        return False


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _first_line(error: BaseException) -> str:
    return str(error).splitlines()[0] if str(error) else ""
