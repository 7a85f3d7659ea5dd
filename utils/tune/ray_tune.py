"""tune.py --ray ADDRESS: the study's trials on a Ray cluster through Ray Tune, with Optuna as its search algorithm.

The study is the same Optuna study in the same storage as without Ray: Ray's OptunaSearch asks and
tells it (our sampler, the base recipe queued first, interrupted trials queued again), so trials.csv,
best_hyp.yaml, the plots, the summary and resuming by running the same command work as they do for
local trials. Each Ray trial runs the same train.py command in a fresh process on the worker Ray
places it on (`--nproc-per-trial` GPUs, or one CPU share), and reports each epoch's mAP50-95; Ray's
scheduler prunes on it (median: MedianStoppingRule, halving: ASHA). A trial Ray stops is recorded as
pruned, a crash / OOM / NaN as failed with its reason, as locally.
The worker's side, run_ray_trial, is utils/tune/ray_trial.py: Ray's workers import only that.

Every node needs the project at the same path and the study folder (runs/tune/NAME) on a disk they
all reach; the storage is written by this process only.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import pickle
import signal
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import optuna

from utils.config import ROOT
from utils.errors import ConfigError
from utils.tune.ray_trial import FITNESS, NUMBER, SCORE, RayTrialJob, run_ray_trial
from utils.tune.study import (
    HEARTBEAT_S,
    counted_trials,
    fail_lost_trials,
    first_prunable_epoch,
    make_sampler,
    mark_worker,
    open_storage,
    requeue,
    suggest,
)
from utils.tune.trial import COMPLETE, TrialRecipe, recorded_run_dir

if TYPE_CHECKING:
    from utils.tune.tuner import StudyRun

LOGGER = logging.getLogger(__name__)


def require_ray() -> None:
    """One line when Ray Tune is not installed (before any work)."""
    try:
        import ray.tune  # noqa: F401
        from ray.tune.search.optuna import OptunaSearch  # noqa: F401
    except ImportError:
        raise ConfigError("--ray needs Ray Tune: pip install 'ray[tune]'") from None


def _optuna_search_class() -> type:
    """StudySearch, defined once Ray is importable (it subclasses Ray's OptunaSearch)."""
    from ray.tune.search.optuna import OptunaSearch

    class StudySearch(OptunaSearch):
        """Ray's OptunaSearch on our study: trial numbers in the config, per-epoch scores as intermediate values,
        and each end recorded as the local tuner records it (complete, pruned, failed with its reason)."""

        def __init__(self, run: StudyRun, **kwargs: Any) -> None:
            self.run = run
            self.asked: dict[str, optuna.trial.Trial] = {}  # Ray trial id -> Optuna trial
            self.reported: dict[str, int] = {}  # Ray trial id -> the last epoch reported to its Optuna trial
            self._just_asked: optuna.trial.Trial | None = None
            self.lock = threading.Lock()
            super().__init__(space=self._define, **kwargs)

        def __getstate__(self) -> dict[str, Any]:
            # Ray Tune pickles its searcher with the experiment's state; the study is resumed from its storage
            # instead, so the live study, trials and lock stay behind.
            state = dict(self.__dict__)
            state.update(run=None, asked={}, _just_asked=None, lock=None)
            return state

        def __setstate__(self, state: dict[str, Any]) -> None:
            self.__dict__.update(state, lock=threading.Lock())

        def save(self, checkpoint_path: str) -> None:
            """Ray's experiment checkpoint of the searcher: nothing, as the study resumes from its own storage
            (running tune.py again), never through Ray's Tuner.restore."""
            with open(checkpoint_path, "wb") as file:
                pickle.dump({}, file)

        def restore(self, checkpoint_path: str) -> None:
            raise NotImplementedError("resume a --ray study by running the same tune.py command again")

        def _define(self, trial: optuna.trial.Trial) -> dict[str, Any]:
            """Define-by-run space: the search space's distributions; the trial number goes in the config."""
            suggest(trial, self.run.space)
            mark_worker(trial)
            self._just_asked = trial
            return {NUMBER: trial.number}

        def suggest(self, trial_id: str) -> dict[str, Any] | None:
            params = super().suggest(trial_id)
            if params is not None:
                with self.lock:
                    self.asked[trial_id] = self._just_asked
            return params

        def on_trial_result(self, trial_id: str, result: dict[str, Any]) -> None:
            trial = self.asked.get(trial_id)
            epoch = int(result.get("epoch", 0))
            # Epochs in order, each once: the final result (with `state`) brings the last epoch's score, which
            # run_ray_trial leaves out of the per-epoch results, and repeats it otherwise.
            if (
                trial is None
                or epoch <= self.reported.get(trial_id, 0)
                or not math.isfinite(result.get(SCORE, math.nan))
            ):
                return
            self.reported[trial_id] = epoch
            trial.report(float(result[SCORE]), epoch)
            trial.set_user_attr("heartbeat", time.time())

        def on_trial_complete(self, trial_id: str, result: dict[str, Any] | None = None, error: bool = False) -> None:
            if result:  # the result Ray's scheduler stopped the trial on, or the final one: reported if new
                self.on_trial_result(trial_id, result)
            with self.lock:
                trial = self.asked.pop(trial_id, None)
                self.reported.pop(trial_id, None)
            if trial is None:
                return
            result = result or {}
            state = result.get("state")
            epochs = int(result.get("epoch", 0))
            run_dir = self.run.trials_dir / f"trial_{trial.number:04d}"
            attrs = {"epochs": epochs, "study": self.run.cfg.train.name, "run_dir": recorded_run_dir(run_dir)}
            if result.get("best"):
                attrs["best"] = result["best"]
            if error:
                attrs["reason"] = "ray: the trial's function raised (see its error.txt in the Ray run folder)"
            elif state is None:
                attrs["reason"] = f"pruned after epoch {epochs}"
            elif result.get("reason"):
                attrs["reason"] = result["reason"]
            for key, value in attrs.items():
                trial.set_user_attr(key, value)
            if state == COMPLETE and not error:
                super().on_trial_complete(trial_id, {FITNESS: float(result[FITNESS])})
            elif state is None and not error:
                super().on_trial_complete(trial_id, None)  # no value, no error: Ray's OptunaSearch records PRUNED
            else:
                super().on_trial_complete(trial_id, None, error=True)  # FAIL

        def beat(self) -> None:
            """Heartbeats for the running trials, so workers on other machines do not take them for lost."""
            with self.lock:
                running = list(self.asked.values())
            for trial in running:
                trial.set_user_attr("heartbeat", time.time())

        def interrupted(self) -> list[optuna.trial.Trial]:
            """The trials still open when Ray Tune returned (a stop signal): to be failed and queued again."""
            with self.lock:
                left, self.asked = list(self.asked.values()), {}
            return left

    return StudySearch


def _scheduler(run: StudyRun) -> Any:
    """--pruner through Ray: median -> MedianStoppingRule, halving -> ASHA, both after a third of the epochs."""
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler, MedianStoppingRule

    cfg = run.cfg
    first = first_prunable_epoch(cfg)
    if cfg.pruner == "median":
        return MedianStoppingRule(time_attr="epoch", metric=SCORE, mode="max", grace_period=first,
                                  min_samples_required=4)  # fmt: skip
    if cfg.pruner == "halving":
        # max_t one past the last epoch: ASHA stops a trial that reaches max_t, which would cut off its final report.
        return ASHAScheduler(time_attr="epoch", metric=SCORE, mode="max", max_t=cfg.train.epochs + 1,
                             grace_period=first, reduction_factor=3)  # fmt: skip
    return FIFOScheduler()


def _connect(address: str) -> None:
    """Join the cluster at `address` ("local" starts one here); workers import the project from ROOT."""
    import ray

    if ray.is_initialized():
        return
    runtime_env = {"env_vars": {"PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}}
    if address == "local":
        ray.init(runtime_env=runtime_env, include_dashboard=False, logging_level=logging.WARNING)
    else:
        ray.init(address=address, runtime_env=runtime_env, logging_level=logging.WARNING)


def tune_on_ray(run: StudyRun, recipe: TrialRecipe, poll_s: float) -> None:
    """Run the study's remaining trials through Ray Tune on the cluster at --ray; returns when they are done or Ray
    was stopped (Ctrl-C), with the trials left open failed as interrupted and queued again."""
    import ray
    from ray import tune

    cfg = run.cfg
    _connect(cfg.ray)
    fail_lost_trials(run.study)
    counted, _ = counted_trials(run.study)
    remaining = cfg.trials - counted
    if remaining <= 0:
        return
    on_gpu = cfg.train.device.strip().lower() not in ("cpu", "mps") and ray.cluster_resources().get("GPU", 0) > 0
    device = ",".join(str(i) for i in range(cfg.nproc_per_trial)) if on_gpu else "cpu"
    resources = {"cpu": 1, "gpu": cfg.nproc_per_trial if on_gpu else 0}
    job = RayTrialJob(recipe, device, f"metrics/{run.fitness_key}", run.fitness_key, poll_s, cfg.train.epochs)
    storage = open_storage(cfg)
    storage = optuna.storages.RDBStorage(storage) if isinstance(storage, str) else storage  # Ray wants an object
    search = _optuna_search_class()(
        run, metric=FITNESS, mode="max", study_name=cfg.train.name, storage=storage,
        sampler=make_sampler(cfg, cfg.train.seed + 1000 * counted),
    )  # fmt: skip
    tuner = tune.Tuner(
        tune.with_resources(tune.with_parameters(run_ray_trial, job=job), resources),
        tune_config=tune.TuneConfig(
            search_alg=search,
            scheduler=_scheduler(run),
            num_samples=remaining,
            max_concurrent_trials=cfg.parallel or (None if on_gpu else 1),
        ),  # fmt: skip
        run_config=tune.RunConfig(
            name="ray",
            storage_path=str((cfg.study_dir).resolve()),
            verbose=0,
            failure_config=tune.FailureConfig(max_failures=0, fail_fast=False),
        ),  # fmt: skip
    )
    LOGGER.info(f"tune: {remaining} trials through Ray Tune at {cfg.ray} ({ray.cluster_resources()}), "
                f"each on {resources}")  # fmt: skip
    stop_beating = threading.Event()
    beater = threading.Thread(target=_beat, args=(search, stop_beating), name="tune-ray-heartbeat", daemon=True)
    beater.start()
    try:
        with _sigterm_as_sigint():
            tuner.fit()
    finally:
        stop_beating.set()
        for trial in search.interrupted():
            trial.set_user_attr("reason", "interrupted: the study was stopped")
            requeue(run.study, run.study.tell(trial.number, state=optuna.trial.TrialState.FAIL))
            run.stop.set()


@contextlib.contextmanager
def _sigterm_as_sigint() -> Iterator[None]:
    """SIGTERM (how Slurm and Kubernetes stop a job) stops Ray Tune as Ctrl-C does, gracefully: its trials end and
    the study is written, where Ray's own SIGTERM handler ended the process without results."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: signal.raise_signal(signal.SIGINT))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _beat(search: Any, stop: threading.Event) -> None:
    while not stop.wait(HEARTBEAT_S):
        search.beat()
