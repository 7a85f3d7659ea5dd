"""The Optuna study behind tune.py: storage, sampler and pruner, and the workers that ask, run and tell trials.

Trials are asked and told by hand (Optuna's ask/tell), so the tuner decides how each end is recorded:
complete (fitness: the final mAP50-95 of the trial's best.pt), pruned (its last per-epoch score),
failed with its reason (a crash, out of memory, NaN), or interrupted. Trials interrupted by a stop
and trials lost with a killed worker do not count towards --trials, so running the same command again
finishes the study. Every worker, on this machine or another sharing the storage, writes a heartbeat
into its running trials; a running trial whose worker stopped beating (or died on this host) is
marked failed when any worker next looks.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna

from utils.errors import ConfigError
from utils.tune.config import TuneConfig
from utils.tune.space import SearchSpace

LOGGER = logging.getLogger(__name__)
optuna.logging.set_verbosity(optuna.logging.WARNING)  # the tuner logs each trial itself, in one line
HEARTBEAT_S = 30.0
STALE_AFTER_S = 5 * HEARTBEAT_S


def _pid_space() -> str:
    """This process's PID namespace on this boot of its machine ('' where unknown).

    Only there does a process id name the same process: containers sharing a host name (host
    networking) have their own, and a container restarted under its old name gets a new one.
    """
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{socket.gethostname()}/{boot}/{os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return ""


PID_SPACE = _pid_space()
# The name this tuner process writes into its running trials: host:pid, and a random part, as a host:pid is
# used again (PID 1 of a restarted container; process ids wrapping).
WORKER = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
# Why a failed trial does not count towards --trials: it never got to be a trial of its settings.
NOT_COUNTED = ("interrupted", "lost")


STATES = {"COMPLETE": "complete", "PRUNED": "pruned", "FAIL": "failed", "RUNNING": "running", "WAITING": "waiting"}


def state_name(trial: optuna.trial.FrozenTrial) -> str:
    """What became of a trial, for people: Optuna's state, with an interrupted or lost one named so, not "failed".

    Optuna records both as failed; their reason says which, and neither counts towards --trials.
    """
    reason = str(trial.user_attrs.get("reason", ""))
    if trial.state == optuna.trial.TrialState.FAIL and not reason:
        return "lost"  # failed by Optuna's own heartbeat check: its worker stopped answering (not counted either)
    if trial.state == optuna.trial.TrialState.FAIL and reason.startswith(NOT_COUNTED):
        return next(name for name in NOT_COUNTED if reason.startswith(name))
    return STATES.get(trial.state.name, trial.state.name.lower())


def open_storage(cfg: TuneConfig) -> optuna.storages.BaseStorage | str:
    """The study's storage: SQLite in the study folder by default, a journal file, or a database URL.

    The study folder (trials.csv, the plots, best_hyp.yaml) is made whichever storage holds the study.
    """
    cfg.study_dir.mkdir(parents=True, exist_ok=True)
    if not cfg.storage:
        return f"sqlite:///{(cfg.study_dir / 'study.db').resolve()}"
    if "://" in cfg.storage:
        try:  # opened here: a bad URL (unknown scheme, no driver, no server) is one line, not a traceback
            return optuna.storages.RDBStorage(cfg.storage)
        except Exception as error:  # SQLAlchemy raises many types for a URL it cannot use
            reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise ConfigError(f"--storage {cfg.storage}: cannot open it ({type(error).__name__}: {reason})") from None
    from optuna.storages.journal import JournalFileBackend

    journal = Path(cfg.storage)
    if journal.is_dir():
        raise ConfigError(f"--storage {journal}: a folder; give a journal file (made if missing) or a database URL")
    try:
        with journal.open("rb") as file:
            head = file.read(16)
    except FileNotFoundError:
        head = b""
    except OSError as error:
        raise ConfigError(f"--storage {journal}: cannot read it ({error.strerror or error})") from None
    if head.startswith(b"SQLite format 3"):
        raise ConfigError(f"--storage {journal}: an SQLite database, not a journal file; give sqlite:///{journal}")
    return optuna.storages.JournalStorage(JournalFileBackend(str(journal)))


def make_sampler(cfg: TuneConfig, seed: int) -> optuna.samplers.BaseSampler:
    """The --sampler: TPE (multivariate, with a constant liar for parallel trials), CMA-ES, genetic or random."""
    startup = max(3, min(10, cfg.trials // 3))  # random trials before the model-based ones start
    if cfg.sampler == "tpe":
        return optuna.samplers.TPESampler(seed=seed, n_startup_trials=startup, multivariate=True, constant_liar=True)
    if cfg.sampler == "cmaes":
        try:
            import cmaes  # noqa: F401  (Optuna's CMA-ES sampler needs it)
        except ImportError:
            raise ConfigError("--sampler cmaes needs the cmaes package: pip install cmaes") from None
        return optuna.samplers.CmaEsSampler(seed=seed, n_startup_trials=startup, warn_independent_sampling=False)
    if cfg.sampler == "ga":
        population = max(4, min(50, cfg.trials // 5))
        return optuna.samplers.NSGAIISampler(seed=seed, population_size=population)
    return optuna.samplers.RandomSampler(seed=seed)


def first_prunable_epoch(cfg: TuneConfig) -> int:
    """The first epoch after which a pruner may stop a trial: epochs 1 .. a third of them are never pruned."""
    return max(1, cfg.train.epochs // 3) + 1


def make_pruner(cfg: TuneConfig) -> optuna.pruners.BasePruner:
    """The --pruner: a trial is compared on its per-epoch mAP50-95, never during the first third of its epochs."""
    if cfg.pruner == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=4, n_warmup_steps=first_prunable_epoch(cfg))
    if cfg.pruner == "halving":
        return optuna.pruners.SuccessiveHalvingPruner(min_resource=first_prunable_epoch(cfg), reduction_factor=3)
    return optuna.pruners.NopPruner()


def suggest(trial: optuna.trial.Trial, space: SearchSpace) -> dict[str, float]:
    """Ask `trial` (define-by-run) for every searched key with its distribution; queued values come back as queued."""
    values: dict[str, float] = {}
    for key, dist in distributions(space).items():
        if isinstance(dist, optuna.distributions.IntDistribution):
            values[key] = trial.suggest_int(key, dist.low, dist.high, log=dist.log)
        else:
            values[key] = trial.suggest_float(key, dist.low, dist.high, log=dist.log)
    return values


def distributions(space: SearchSpace) -> dict[str, optuna.distributions.BaseDistribution]:
    """Optuna's distribution for each searched key."""
    found: dict[str, optuna.distributions.BaseDistribution] = {}
    for dim in space.dimensions:
        if dim.scale == "int":
            found[dim.key] = optuna.distributions.IntDistribution(int(dim.low), int(dim.high))
        else:
            found[dim.key] = optuna.distributions.FloatDistribution(dim.low, dim.high, log=dim.scale == "log")
    return found


def open_study(cfg: TuneConfig, space: SearchSpace, settings: dict[str, Any]) -> optuna.Study:
    """Create the study or load it; a study made with other settings is a one-line error, not a silent mix.

    `settings` are what makes trials comparable (data, model, epochs, size, batch, space): a new study
    records them and queues the base recipe as its first trial; a loaded one must have the same.
    """
    storage = open_storage(cfg)
    study_name = cfg.train.name
    try:
        probe = optuna.create_study(storage=storage, study_name=study_name, direction="maximize", load_if_exists=True)
    except (ValueError, OSError) as error:  # a journal file that is something else: not JSON lines, unreadable
        if not cfg.storage or "://" in cfg.storage:
            raise
        raise ConfigError(f"--storage {cfg.storage}: not an Optuna journal file ({type(error).__name__})") from None
    # A resumed or joined study seeds its sampler differently, so it does not ask again for the points
    # the first run's random start-up trials had (same seed, same random draws).
    seed = cfg.train.seed + 1000 * len(probe.trials) + (zlib.crc32(WORKER.encode()) if cfg.storage else 0)
    study = optuna.load_study(study_name=study_name, storage=storage, sampler=make_sampler(cfg, seed),
                              pruner=make_pruner(cfg))  # fmt: skip
    recorded = study.user_attrs.get("settings")
    if recorded is None:
        study.set_user_attr("settings", settings)
        outside = space.base_inside()
        if outside:
            LOGGER.warning(f"tune: the base recipe's {outside[0]} is outside its bounds in {space.path}; "
                           "the study starts without it")  # fmt: skip
        else:
            study.enqueue_trial(space.base_params, user_attrs={"baseline": True}, skip_if_exists=True)
    elif any(recorded[key] != settings.get(key) for key in recorded):  # keys an older study lacks are not checked
        # The first difference in the settings' own order (data and model before the hyp and space they imply).
        key = next(key for key in recorded if recorded[key] != settings.get(key))
        raise ConfigError(
            f"{cfg.study_dir}: study '{study_name}' was made with {_difference(key, recorded[key], settings.get(key))}"
            "; give the same flags to resume it, or another --name for a new study"
        )
    elif set(settings) - set(recorded):  # a study made before these keys were recorded: they hold from now on
        study.set_user_attr("settings", {**settings, **recorded})
    return study


def _difference(key: str, recorded: Any, given: Any) -> str:
    """'KEY OLD, this command gives NEW' for one setting; of a hyp or a space, only its first key that differs."""
    absent = None
    if key == "space" and isinstance(recorded, list) and isinstance(given, list):  # [[key, low, high, scale], ...]
        recorded, given = ({entry[0]: entry[1:] for entry in space} for space in (recorded, given))
        absent = "fixed"  # a key a space leaves out
    if not (isinstance(recorded, dict) and isinstance(given, dict)):
        return f"{key} {recorded!r}, this command gives {given!r}"
    sub = next(sub for sub in (*recorded, *given) if recorded.get(sub) != given.get(sub))
    return f"{key} {sub} {recorded.get(sub, absent)!r}, this command gives {given.get(sub, absent)!r}"


def counted_trials(study: optuna.Study) -> tuple[int, int]:
    """(trials that count towards --trials, of them still running): interrupted and lost ones do not count."""
    counted = running = 0
    for trial in study.get_trials(deepcopy=False):
        if state_name(trial) in ("waiting", *NOT_COUNTED):
            continue  # queued values, not a trial yet; or a trial interrupted or lost, to be run again
        counted += 1
        running += trial.state == optuna.trial.TrialState.RUNNING
    return counted, running


def requeue(study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
    """Queue an interrupted or lost trial's values again, so the resumed study trains that point (first)."""
    attrs = {"retry_of": trial.number}
    if trial.user_attrs.get("baseline"):
        attrs["baseline"] = True
    study.enqueue_trial(dict(trial.params), user_attrs=attrs)


def mark_worker(trial: optuna.trial.Trial) -> None:
    """Write into a trial this process runs who runs it, and its first heartbeat (see fail_lost_trials)."""
    trial.set_user_attr("worker", WORKER)
    trial.set_user_attr("pid", os.getpid())
    trial.set_user_attr("pid_space", PID_SPACE)
    trial.set_user_attr("heartbeat", time.time())


def fail_lost_trials(study: optuna.Study) -> None:
    """Mark failed the running trials whose worker is gone; queue them again.

    Gone: its process is dead in this PID namespace, or it wrote no heartbeat for STALE_AFTER_S (a
    worker elsewhere, or one that never got to name itself: its trial was created but the asking failed).
    """
    for trial in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        worker = str(trial.user_attrs.get("worker", ""))
        started = trial.datetime_start.timestamp() if trial.datetime_start else time.time()
        beat = float(trial.user_attrs.get("heartbeat", started))
        pid, space = trial.user_attrs.get("pid"), trial.user_attrs.get("pid_space")
        dead_here = bool(PID_SPACE) and space == PID_SPACE and isinstance(pid, int) and not _alive(pid)
        if worker != WORKER and (dead_here or time.time() - beat > STALE_AFTER_S):
            handle = optuna.trial.Trial(study, trial._trial_id)
            try:
                handle.set_user_attr("reason", f"lost: worker {worker or '(unnamed)'} stopped")
                study.tell(trial.number, state=optuna.trial.TrialState.FAIL)
            except (RuntimeError, ValueError):
                continue  # another worker marked it first (and queued it again), or its worker just ended it
            requeue(study, trial)
            LOGGER.warning(
                f"tune: trial {trial.number} was lost with worker {worker}; not counted, its values queued again"
            )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass
class AskedTrial:
    """A trial this worker asked for: Optuna's handle and the hyp values to train with."""

    trial: optuna.trial.Trial
    params: dict[str, float]

    @property
    def number(self) -> int:
        return self.trial.number


def ask_next(study: optuna.Study, space: SearchSpace, total: int, lock: threading.Lock) -> AskedTrial | None:
    """Ask for the next trial, or None when --trials are done or running (on every machine)."""
    with lock:
        fail_lost_trials(study)
        counted, _ = counted_trials(study)
        if counted >= total:
            return None
        trial = study.ask(distributions(space))
        mark_worker(trial)
        return AskedTrial(trial, dict(trial.params))
