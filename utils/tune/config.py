"""tune.py's options: train.py's flags (passed to every trial) plus the study's, parsed once into TuneConfig."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from pathlib import Path

from utils.config import AUTOBATCH, ROOT, flag_words
from utils.errors import ConfigError
from utils.train.config import TrainConfig, build_train_parser, config_from_args, explicit_options

SAMPLERS = ("tpe", "cmaes", "ga", "random")
PRUNERS = ("median", "halving", "none")
DEFAULT_TRIALS = 30
# train.py flags the tuner sets for each trial itself (the rest are passed on as given).
TUNER_OWNED = ("project", "name", "exist_ok", "hyp", "optimizer", "label_smoothing", "resume", "device", "callbacks")
TUNE_FLAGS = ("trials", "space", "sampler", "pruner", "storage", "parallel", "nproc_per_trial", "keep_weights", "ray")


@dataclass(frozen=True)
class TuneConfig:
    """A study: what each trial trains (`train`, and `train_argv`, the flags passed on) and how trials are chosen.

    The study lives in `project / name` (given again, the same command resumes it); its name in the
    storage is `name`, so several machines running the same command with one shared --storage work
    on one study.
    """

    task: str
    train: TrainConfig
    train_argv: tuple[str, ...]  # train.py flags given on the command line that each trial gets as they are
    trials: int = DEFAULT_TRIALS
    space: Path | None = None  # None: the model family's data/hyps/space.*.yaml
    sampler: str = "tpe"
    pruner: str = "median"
    storage: str = ""  # "": SQLite in the study folder; a .journal/.log path; or a database URL
    parallel: int = 0  # trials at once on this machine (0: one per GPU group, 1 on CPU)
    nproc_per_trial: int = 1
    keep_weights: bool = False
    ray: str = ""  # a Ray cluster's address ("auto", "ray://head:10001") or "local": trials run through Ray Tune

    @property
    def study_dir(self) -> Path:
        """The study's folder: trials.csv, best_hyp.yaml, plots, the SQLite storage and trials/."""
        return self.train.project / self.train.name

    @property
    def callbacks(self) -> tuple[str, ...]:
        """The --callbacks each trial loads: the user's, then the tuner's report."""
        return (*self.train.callbacks, "utils.tune.report")


def build_tune_parser(task: str = "detect") -> argparse.ArgumentParser:
    """train.py's parser plus the study's flags; --project defaults to runs/tune (runs/tune-seg)."""
    parser = build_train_parser(task)
    parser.description = (
        f"Tune the hyperparameters of a YOLO {task} model with Optuna: each trial is a full training run "
        "in a fresh process, scored by the mAP50-95 of its best.pt. Running the same command again resumes "
        "the study (docs/tuning.md)."
    )
    parser.set_defaults(project=ROOT / "runs" / ("tune-seg" if task == "segment" else "tune"))
    group = parser.add_argument_group("study")
    group.add_argument("--trials", type=int, default=DEFAULT_TRIALS, help="trials in the study, on all machines")
    group.add_argument("--space", type=Path, default=None, help="search-space YAML (default: the model family's "
                       "data/hyps/space.yolov5.yaml or space.anchor-free.yaml)")  # fmt: skip
    group.add_argument("--sampler", default="tpe", choices=SAMPLERS, help="tpe (default), cmaes, ga (genetic), random")
    group.add_argument(
        "--pruner",
        default="median",
        choices=PRUNERS,
        help="stop hopeless trials early on their per-epoch mAP: median (default), halving, none",
    )
    group.add_argument("--storage", default="", help="where the study lives: default SQLite in the study folder; "
                       "a .journal file on a shared disk or a database URL for several machines")  # fmt: skip
    group.add_argument(
        "--parallel",
        type=int,
        default=0,
        help="trials at once on this machine (default: one per --nproc-per-trial GPUs; 1 on CPU)",
    )
    group.add_argument("--nproc-per-trial", type=int, default=1, help="GPUs (torchrun ranks) per trial")
    group.add_argument("--keep-weights", action="store_true", help="keep every trial's weights (default: the best's)")
    group.add_argument("--ray", default="", metavar="ADDRESS", help="run the trials on a Ray cluster through Ray Tune "
                       "(Optuna as its search algorithm): its address (auto, ray://head:10001) or local")  # fmt: skip
    return parser


def tune_config_from_argv(argv: list[str] | None, task: str = "detect") -> TuneConfig:
    """Parse tune.py's command line; the train flags given explicitly are kept to pass to every trial."""
    parser = build_tune_parser(task)
    args = parser.parse_args(argv)
    explicit = explicit_options(parser, argv)
    train = dataclasses.replace(config_from_args(args, task), explicit=explicit - set(TUNE_FLAGS))
    passed_on = explicit - set(TUNE_FLAGS) - set(TUNER_OWNED)
    cfg = TuneConfig(
        task=task,
        train=train,
        train_argv=tuple(argv_of(build_train_parser(task), args, passed_on)),
        **{key: getattr(args, key) for key in TUNE_FLAGS},
    )
    check_tune_config(cfg)
    return cfg


def argv_of(parser: argparse.ArgumentParser, args: argparse.Namespace, dests: set[str]) -> list[str]:
    """The command-line words that give `parser` the parsed values of `dests` (in the parser's order)."""
    words: list[str] = []
    for action in parser._actions:
        if action.dest in dests and action.option_strings:
            words += flag_words(action.option_strings[0], action, getattr(args, action.dest), action.dest)
    return words


def check_tune_config(cfg: TuneConfig) -> None:
    """One-line errors for study options that cannot work."""
    if cfg.trials < 1:
        raise ConfigError(f"--trials {cfg.trials} must be at least 1")
    if cfg.nproc_per_trial < 1 or cfg.parallel < 0:
        raise ConfigError("--nproc-per-trial must be at least 1 and --parallel at least 0")
    if cfg.train.resume:
        raise ConfigError("--resume is train.py's: run the same tune command again to resume a study")
    if "evolve" in cfg.train.explicit:  # train.py --evolve N is this command with --trials N; here it would do nothing
        raise ConfigError("--evolve is train.py's spelling of tune.py; tune.py takes the number of trials as --trials")
    if cfg.train.batch_size == AUTOBATCH:  # each trial would measure its own GPU: trials of other batches
        raise ConfigError("--batch-size -1 (AutoBatch) would give trials on other GPUs other batches; give a size")
    if cfg.train.noval and cfg.pruner != "none":
        raise ConfigError("--noval leaves no per-epoch mAP to prune on; drop --noval or pass --pruner none")
