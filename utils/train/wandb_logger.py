"""WandbLogger: a run's options, per-epoch results.csv columns, best.pt and figures in Weights & Biases (rank 0).

On with `--wandb`, or when `WANDB_PROJECT` is set; W&B's own variables apply (`WANDB_MODE=offline`
writes the run under the run folder for a later `wandb sync`, `WANDB_ENTITY`, `WANDB_BASE_URL`, the
API key). The project is `WANDB_PROJECT`, else the run folder's parent (`train`, `train-seg`); the
W&B run is named like the run folder. Its id, project, entity and server are kept in every checkpoint
(callback state), so `--resume` and elastic restarts continue the same W&B run, also from a shell
without the first part's W&B variables. W&B never costs the training run: a missing
package, an unreachable server or a failed call is one warning and logging stops.
"""

from __future__ import annotations

import logging
import math
import os
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from utils.errors import Preempted
from utils.runs import FIGURE_SUFFIXES
from utils.train.trackers import import_tracker, server_answers

if TYPE_CHECKING:
    from utils.callbacks import TrainEvent

LOGGER = logging.getLogger(__name__)
STATE_KEY = "wandb"  # its entry in the callbacks' checkpointed state: {"run_id", "project", "entity", "base_url"}
DEFAULT_BASE_URL = "https://api.wandb.ai"  # when the installed wandb does not say (_default_server)


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
        target = wandb_target(event.state.get(STATE_KEY) or {}, os.environ, event.run_dir)
        server = target.base_url or _default_server(wandb)
        unreachable = ("W&B: no server at {url} ({reason}); training goes on without W&B (WANDB_MODE=offline keeps "
                       "the run locally)")  # fmt: skip
        if mode == "disabled" or (mode == "online" and not server_answers(server, "/healthz", unreachable, LOGGER)):
            return
        if mode == "online" and not _has_credentials(wandb, target.base_url):
            LOGGER.warning(
                "W&B: no API key (WANDB_API_KEY, or `wandb login` once); training goes on without W&B "
                "(WANDB_MODE=offline keeps the run locally)"
            )
            return
        self._call("start", lambda: self._start(wandb, event, target))

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

    def _start(self, wandb: Any, event: TrainEvent, target: WandbTarget) -> None:
        """wandb.init with the checkpoint's run id when it has one (resume="allow"), else a new id."""
        stored = event.state.get(STATE_KEY) or {}
        for warning in target.warnings:
            LOGGER.warning(warning)
        run = wandb.init(
            project=target.project, entity=target.entity, name=event.run_dir.name, id=target.run_id, resume="allow",
            dir=str(event.run_dir), config=dict(event.options), reinit="create_new",
            settings=wandb.Settings(silent=True, **({"base_url": target.base_url} if target.base_url else {})),
        )  # fmt: skip
        run.define_metric("epoch")
        run.define_metric("*", step_metric="epoch")
        self.run = run
        # What W&B used: the account's default entity and `wandb login --host`'s server when none was named
        entity = getattr(run, "entity", None) or target.entity
        base_url = getattr(run.settings, "base_url", None) or target.base_url
        event.state[STATE_KEY] = {"run_id": target.run_id, "project": target.project, "entity": entity,
                                  "base_url": base_url}  # fmt: skip
        verb = "continuing" if stored.get("run_id") else "logging"
        where = f"project {f'{entity}/' if entity else ''}{target.project}"
        LOGGER.info(f"W&B: {verb} run {target.run_id} ({event.run_dir.name}), {where}, mode {run.settings.mode}")

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


@dataclass(frozen=True)
class WandbTarget:
    """Where a run logs: W&B run id, project, entity and server (None: W&B's own default for the account)."""

    run_id: str
    project: str
    entity: str | None
    base_url: str | None
    warnings: tuple[str, ...] = ()  # where a resumed run's environment sends it elsewhere than its first part


# What the checkpoint keeps of each, and the environment variable that names it
TARGET_VARIABLES = (("project", "WANDB_PROJECT"), ("entity", "WANDB_ENTITY"), ("base_url", "WANDB_BASE_URL"))


def wandb_target(stored: Mapping[str, Any], environ: Mapping[str, str], run_dir: Path) -> WandbTarget:
    """Where to log: W&B's variables when set, else what the checkpoint recorded, else the defaults.

    A run continued with `--resume` (or an elastic restart) in a shell without the first part's
    WANDB_PROJECT / WANDB_ENTITY / WANDB_BASE_URL goes on logging to that W&B run, not to a new one
    on the default server and project. A variable that names another place than the recorded one
    wins (the run id is kept there) and is one warning: the earlier epochs stay where they were.
    """
    chosen, warnings = {}, []
    defaults = {"project": run_dir.parent.name, "entity": None, "base_url": None}
    for key, variable in TARGET_VARIABLES:
        given, recorded = environ.get(variable) or None, stored.get(key) or None
        chosen[key] = given or recorded or defaults[key]
        if given and recorded and given.rstrip("/") != recorded.rstrip("/"):
            warnings.append(
                f"W&B: {variable}={given}, but this run's earlier epochs were logged with {key} {recorded}; they "
                f"stay there and run {stored.get('run_id')} goes on under {given} (unset {variable} to continue there)"
            )
    run_id = stored.get("run_id") or uuid.uuid4().hex[:8]  # W&B's own ids: 8 lowercase letters and digits
    return WandbTarget(run_id=run_id, warnings=tuple(warnings), **chosen)


def _default_server(wandb: Any) -> str:
    """The server the installed wandb logs to when nothing names one: its Settings' default (wandb 0.31's is
    https://api.forge.coreweave.com, not api.wandb.ai), so the probe asks the server wandb.init would use."""
    try:
        return str(wandb.Settings().base_url)
    except Exception:  # noqa: BLE001 - a wandb without Settings or that field: the long-standing default
        return DEFAULT_BASE_URL


def _has_credentials(wandb: Any, host: str | None) -> bool:
    """Whether W&B has an API key for `host` (environment, settings or .netrc), asked without a prompt: wandb.init
    would otherwise prompt for one on a terminal, and wait there (the other ranks until --dist-timeout) or, with
    stdin closed, end the run with a KeyboardInterrupt."""
    try:
        return bool(wandb.login(prompt=False, verify=False, **({"host": host} if host else {})))
    except TypeError:  # a wandb without `prompt`: wandb.init decides, as before
        return True
    except Exception:  # noqa: BLE001 - a settings file it cannot read: no key to use
        return False


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _first_line(error: BaseException) -> str:
    return str(error).splitlines()[0] if str(error) else ""
