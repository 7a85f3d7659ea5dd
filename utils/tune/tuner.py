"""tune.py's run: the base recipe and search space, then workers that train trials until the study has --trials.

Each worker owns a slot of this machine (a GPU group and a share of the CPU cores) and loops: ask a
trial, write its hyp file, run train.py in a fresh process (torchrun with --nproc-per-trial ranks),
tell the outcome, rewrite the results. SIGINT/SIGTERM stop every running trial (each saves last.pt),
mark them interrupted and leave the study to be resumed by the same command.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna
import torch

from utils.config import ROOT
from utils.distributed import DistContext, gpu_indices
from utils.errors import ConfigError, StudyFailed, StudyStopped
from utils.train.plan import RunPlan, plan_run
from utils.train.records import TrainingTask
from utils.tune.config import TuneConfig
from utils.tune.results import StudySummary, prune_weights, write_results
from utils.tune.space import SearchSpace, load_space
from utils.tune.study import (
    HEARTBEAT_S,
    AskedTrial,
    ask_next,
    counted_trials,
    fail_lost_trials,
    open_study,
    requeue,
)
from utils.tune.trial import (
    COMPLETE,
    FAILED,
    INTERRUPTED,
    PRUNED,
    TrialCommand,
    TrialOutcome,
    TrialRecipe,
    TrialWatch,
    recorded_run_dir,
    run_trial,
)

LOGGER = logging.getLogger(__name__)
TRAIN_SCRIPTS = {"detect": ROOT / "train.py", "segment": ROOT / "segment" / "train.py"}
FITNESS_KEYS = {"detect": "mAP50-95", "segment": "mask_mAP50-95"}
POLL_S = 1.0  # how often a running trial's results.csv is read
PLOT_EVERY_S = 300.0  # the figures are redrawn at most this often while the study runs, and at its end


@dataclass(frozen=True)
class Slot:
    """Where one worker's trials run: the --device they get, extra environment, and CPU cores."""

    device: str
    env: dict[str, str] = field(default_factory=dict)
    cpus: tuple[int, ...] = ()


@dataclass
class StudyRun:
    """What the workers share: options, base plan, space, the study, its lock and the stop event."""

    cfg: TuneConfig
    plan: RunPlan
    space: SearchSpace
    study: optuna.Study
    lock: threading.Lock = field(default_factory=threading.Lock)
    stop: threading.Event = field(default_factory=threading.Event)
    plotted_at: float = field(default_factory=time.monotonic)  # the last drawing of the figures (or the start)
    failures: list[str] = field(default_factory=list)  # why a worker thread ended before the study had its trials

    @property
    def fitness_key(self) -> str:
        return FITNESS_KEYS[self.cfg.task]

    @property
    def trials_dir(self) -> Path:
        return self.cfg.study_dir / "trials"


def tune(cfg: TuneConfig, training: TrainingTask) -> StudySummary:
    """Run (or resume, or join) the study and return its summary; raises StudyStopped after a stop signal."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError("tune.py (and --evolve) runs without torchrun; --nproc-per-trial K runs each trial on K GPUs")
    plan = plan_run(cfg.train, training, DistContext())
    space = load_space(cfg.space or plan.family.search_space, plan.cfg.hyp, plan.family.hyp_keys)
    slots = [] if cfg.ray else trial_slots(cfg)  # a --device that cannot work is refused before the study is made
    run = StudyRun(cfg, plan, space, open_study(cfg, space, study_settings(cfg, plan, space)))
    fail_lost_trials(run.study)  # before counting: a killed tuner's trials are lost, not "already in it"
    where = f"on Ray at {cfg.ray}" if cfg.ray else f"{len(slots)} at once"
    LOGGER.info(
        f"tune: study '{cfg.train.name}' in {cfg.study_dir}, {cfg.trials} trials of {cfg.train.epochs} epochs, "
        f"{len(space.keys)} keys searched ({space.path}), sampler {cfg.sampler}, pruner {cfg.pruner}, "
        f"{where}; {counted_trials(run.study)[0]} trials already in it"  # not the queued base recipe
    )
    if cfg.ray:  # Ray Tune runs the trials on its cluster; Ctrl-C stops it (Ray's own handler)
        from utils.tune.ray_tune import tune_on_ray

        tune_on_ray(run, trial_recipe(run), POLL_S)
        if counted_trials(run.study)[0] < cfg.trials:
            run.stop.set()
        if not cfg.keep_weights:
            prune_weights(run.study, run.trials_dir)
    else:
        workers = [threading.Thread(target=_work, args=(run, slot), name=f"tune-{i}") for i, slot in enumerate(slots)]
        with _stop_on_signals(run.stop):
            for worker in workers:
                worker.start()
            for worker in workers:
                while worker.is_alive():
                    worker.join(0.5)  # the main thread wakes for signals
    summary = write_results(run.study, space, cfg.study_dir, run.fitness_key, plots=not cfg.train.noplots)
    LOGGER.info(summary.line(run.fitness_key))
    if run.stop.is_set():
        raise StudyStopped(f"study '{cfg.train.name}' stopped; run the same command to resume it ({cfg.study_dir})")
    if run.failures and counted_trials(run.study)[0] < cfg.trials:
        more = f" (and {len(run.failures) - 1} more)" if len(run.failures) > 1 else ""
        raise StudyFailed(f"study '{cfg.train.name}' has {counted_trials(run.study)[0]} of its {cfg.trials} trials: "
                          f"{run.failures[0]}{more}; run the same command to go on ({cfg.study_dir})")  # fmt: skip
    return summary


# Training options every trial must share besides data, model, size, batch, epochs and optimizer: each changes
# what a trial learns (the seed its draws, --rect the batches, ...). Machine options (device, workers, AMP,
# compile) and outputs (plots, saving, loggers) may differ between the tuners of one study.
TRIAL_OPTIONS = (
    "seed", "deterministic", "rect", "cos_lr", "close_mosaic", "freeze", "single_cls", "multi_scale",
    "noautoanchor", "sync_bn", "multi_label", "patience", "overlap_mask", "mask_ratio", "cache_order",
    "noval", "nosave",  # what the final validation scores: best.pt of per-epoch fitness, or last.pt
)  # fmt: skip


def study_settings(cfg: TuneConfig, plan: RunPlan, space: SearchSpace) -> dict[str, Any]:
    """What makes two trials comparable; a study resumed or joined with other settings is refused."""
    train = plan.cfg
    options = train.to_dict()
    # Of the caches, --cache shm samples each epoch in one shared order, the others per rank's shard.
    options["cache_order"] = "shared" if train.cache == "shm" else "per rank"
    return {
        **{key: options[key] for key in TRIAL_OPTIONS},
        "nproc_per_trial": cfg.nproc_per_trial,  # the world size: shards, per-rank orders and augmentation streams
        "task": cfg.task,
        "data": str(Path(train.data).resolve()),
        "model": str(train.weights) if train.weights else str(train.model),
        "epochs": train.epochs,
        "imgsz": train.imgsz,
        "batch_size": train.batch_size,
        "optimizer": train.optimizer,
        "base_hyp": train.hyp.to_dict(),
        "space": [[d.key, d.low, d.high, d.scale] for d in space.dimensions],
        "fitness": FITNESS_KEYS[cfg.task],
    }


def trial_slots(cfg: TuneConfig) -> list[Slot]:
    """One slot per trial run at once: GPU groups of --nproc-per-trial (CUDA_VISIBLE_DEVICES), or CPU shares."""
    device = cfg.train.device.strip().lower().replace("cuda:", "")  # read as train.py reads it (select_device)
    on_gpu = device != "cpu" and (device != "" or torch.cuda.is_available())
    if on_gpu and not torch.cuda.is_available():
        raise ConfigError(f"--device {cfg.train.device} asks for CUDA but no CUDA device is available; use cpu")
    if on_gpu:
        every = device in ("", "cuda")
        ids = list(map(str, range(torch.cuda.device_count()) if every else gpu_indices(cfg.train.device, device)))
        groups = [ids[i : i + cfg.nproc_per_trial] for i in range(0, len(ids), cfg.nproc_per_trial)]
        groups = [group for group in groups if len(group) == cfg.nproc_per_trial]
        count = cfg.parallel or len(groups)
        if not groups or count > len(groups):
            raise ConfigError(
                f"--parallel {count} x --nproc-per-trial {cfg.nproc_per_trial}: more than the {len(ids)} GPUs given"
            )
        local = ",".join(str(i) for i in range(cfg.nproc_per_trial))
        slots = [Slot(local, {"CUDA_VISIBLE_DEVICES": ",".join(group)}) for group in groups[:count]]
    else:
        slots = [Slot("cpu") for _ in range(cfg.parallel or 1)]
    if len(slots) > 1 and hasattr(os, "sched_getaffinity"):
        cores = sorted(os.sched_getaffinity(0))
        count = len(cores)  # every core in one share; more slots than cores share them round the slots
        shares = [tuple(cores[i * count // len(slots) : (i + 1) * count // len(slots)]) or (cores[i % count],)
                  for i in range(len(slots))]  # fmt: skip
        slots = [Slot(slot.device, slot.env, cpus) for slot, cpus in zip(slots, shares, strict=True)]
    return slots


def trial_recipe(run: StudyRun) -> TrialRecipe:
    """What every trial of this study runs (the same for trials started here and on Ray's workers)."""
    cfg, env = run.cfg, {}
    if cfg.train.mlflow or os.environ.get("MLFLOW_TRACKING_URI"):  # every trial a run of the study's experiment
        env["MLFLOW_EXPERIMENT_NAME"] = os.environ.get("MLFLOW_EXPERIMENT_NAME") or f"tune-{cfg.train.name}"
    return TrialRecipe(TRAIN_SCRIPTS[cfg.task], cfg.train_argv, run.plan.cfg.optimizer, cfg.callbacks, run.trials_dir,
                       run.space, cfg.nproc_per_trial, env)  # fmt: skip


def trial_command(run: StudyRun, asked: AskedTrial, slot: Slot) -> TrialCommand:
    """The trial's train.py command on `slot`'s devices and cores.

    The trial dies with the worker thread that started it: a tuner killed outright (SIGKILL, out of
    memory) leaves no trial training on as an orphan on devices the next tuner hands out again.
    """
    return trial_recipe(run).command(asked.number, asked.params, slot.device, slot.env, slot.cpus, die_with_parent=True)


def _work(run: StudyRun, slot: Slot) -> None:
    """One worker: ask, train, tell, write results, until the study has its trials or a stop is asked.

    An error (the storage unreachable, a trial another tuner recorded meanwhile) ends this worker with
    one line and is kept in `run.failures`: tune() then fails unless the study has its trials anyway.
    """
    try:
        _work_on(run, slot)
    except Exception as error:
        message = str(error).strip().splitlines()[0] if str(error).strip() else ""
        failure = f"a worker stopped on {type(error).__name__}: {message}"
        LOGGER.error(f"tune: {failure}")
        run.failures.append(failure)


def _work_on(run: StudyRun, slot: Slot) -> None:
    while not run.stop.is_set():
        asked = ask_next(run.study, run.space, run.cfg.trials, run.lock)
        if asked is None:
            return
        command = trial_command(run, asked, slot)
        LOGGER.info(f"tune: trial {asked.number} started ({command.log})")
        outcome = _run_guarded(run, asked, command)
        _tell(run, asked, command, outcome)
        with run.lock:
            plots = not run.cfg.train.noplots and time.monotonic() - run.plotted_at >= PLOT_EVERY_S
            run.plotted_at = time.monotonic() if plots else run.plotted_at
            summary = write_results(run.study, run.space, run.cfg.study_dir, run.fitness_key, plots)
            if not run.cfg.keep_weights:
                prune_weights(run.study, run.trials_dir)
        fitness = f"{outcome.fitness:.4f}" if outcome.fitness is not None else "-"
        reason = f"; {outcome.reason}" if outcome.reason else ""
        LOGGER.info(f"tune: trial {asked.number} {outcome.state} after {outcome.epochs} epochs, {run.fitness_key} "
                    f"{fitness}{reason} | {summary.line(run.fitness_key)}")  # fmt: skip


def _run_guarded(run: StudyRun, asked: AskedTrial, command: TrialCommand) -> TrialOutcome:
    """run_trial, with a tuner-side error recorded as the trial's failure rather than ending the worker."""

    def report(epoch: int, score: float) -> bool:
        asked.trial.report(score, epoch)
        # After its last epoch a trial is only validating best.pt: stopping it then would save nothing and lose its
        # final score, so it is never pruned there.
        return epoch < run.cfg.train.epochs and asked.trial.should_prune()

    watch = TrialWatch(
        report=report,
        heartbeat=lambda: asked.trial.set_user_attr("heartbeat", time.time()),
        stop=run.stop,
        score_column=f"metrics/{run.fitness_key}",
        fitness_key=run.fitness_key,
        poll_s=POLL_S,
        heartbeat_s=HEARTBEAT_S,
    )
    try:
        return run_trial(command, watch)
    except Exception as error:
        return TrialOutcome(FAILED, None, 0, f"tuner: {type(error).__name__}: {error}")


def _tell(run: StudyRun, asked: AskedTrial, command: TrialCommand, outcome: TrialOutcome) -> None:
    """Record the outcome in the study: value and state, epochs, why it ended, where it ran."""
    trial = asked.trial
    attrs = {"epochs": outcome.epochs, "run_dir": recorded_run_dir(command.run_dir), "study": run.cfg.train.name}
    if outcome.reason:
        attrs["reason"] = outcome.reason
    if outcome.best:
        attrs["best"] = outcome.best
    for key, value in attrs.items():
        trial.set_user_attr(key, value)
    if outcome.state == COMPLETE:
        run.study.tell(trial, outcome.fitness)
    elif outcome.state == PRUNED:
        run.study.tell(trial, state=optuna.trial.TrialState.PRUNED)
    else:
        assert outcome.state in (FAILED, INTERRUPTED)
        frozen = run.study.tell(trial, state=optuna.trial.TrialState.FAIL)
        if outcome.state == INTERRUPTED:
            requeue(run.study, frozen)


@contextlib.contextmanager
def _stop_on_signals(stop: threading.Event) -> Iterator[None]:
    """SIGINT and SIGTERM set `stop` (workers stop their trials) while the block runs in the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: object) -> None:
        if not stop.is_set():
            LOGGER.warning(f"tune: {signal.Signals(signum).name}: stopping the running trials (each saves last.pt)")
        stop.set()

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
