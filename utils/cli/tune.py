"""tune.py, segment/tune.py and train.py --evolve: parse the flags and run the study; tune.run(**flags)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from utils.cli import entry
from utils.config import ROOT
from utils.distributed import DistContext
from utils.errors import ConfigError
from utils.logs import logging_for
from utils.train.config import build_train_parser, explicit_options
from utils.train.records import TrainingTask
from utils.tune.config import argv_of, build_tune_parser, tune_config_from_argv

if TYPE_CHECKING:
    from utils.tune.results import StudySummary


def tune_run(options: dict[str, Any], training: TrainingTask) -> StudySummary:
    """tune.run(**options): tune.py's checks and study, in this process (trials still run as processes)."""
    return tune_main(entry.keyword_argv(build_tune_parser(training.name), options, "tune.run"), training)


def tune_main(argv: list[str] | None, training: TrainingTask) -> StudySummary:
    """The whole of tune.py: parse flags, run or resume the study, print its one-line summary."""
    cfg = tune_config_from_argv(argv, training.name)
    try:
        import optuna  # noqa: F401  (an optional dependency: only tuning needs it)
    except ImportError:
        raise ConfigError("tune.py (and --evolve) needs Optuna: pip install optuna") from None
    if cfg.ray:
        from utils.tune.ray_tune import require_ray

        require_ray()
    from utils.tune.tuner import tune

    with logging_for(DistContext()):
        return tune(cfg, training)


def evolve_argv(argv: list[str] | None, task: str) -> list[str] | None:
    """train.py --evolve N as tune.py's command line (--trials N, --project runs/evolve), or None without --evolve."""
    parser = build_train_parser(task)
    args = parser.parse_args(argv)
    if not args.evolve:
        return None
    # Refused here, in train.py's words: tune.py's own messages would name --trials and "the tune command".
    if args.evolve < 0:
        raise ConfigError(f"--evolve {args.evolve}: give the number of trials, at least 1 (default 300)")
    if args.resume:
        raise ConfigError("--resume with --evolve: run the same train.py --evolve command again to resume the study")
    explicit = explicit_options(parser, argv) - {"evolve"}
    words = argv_of(parser, args, set(explicit))
    if "project" not in explicit:
        words += ["--project", str(ROOT / "runs" / ("evolve-seg" if task == "segment" else "evolve"))]
    return [*words, "--trials", str(args.evolve)]
