"""What a Ray worker runs for one --ray trial: its train.py process, each epoch and the outcome reported to Ray Tune.

Ray pickles run_ray_trial by reference, so each trial's worker imports this module. It imports only
utils/tune/trial.py's process handling, not the tuner (utils/tune/ray_tune.py, which imports the
training configuration and with it torch): a worker that only starts and follows a training process
then starts in about half the time and without torch's several hundred MB of memory.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from utils.tune.trial import COMPLETE, TrialRecipe, TrialWatch, run_trial

SCORE = "epoch_score"  # each epoch's val mAP, what Ray's scheduler prunes on
FITNESS = "fitness"  # in the last result of a complete trial: the final COCO mAP of its best.pt; before, the score
NUMBER = "trial_number"  # the Optuna trial number, in the trial's config: its folder is trials/trial_NNNN


@dataclass(frozen=True)
class RayTrialJob:
    """What a Ray worker needs to run a trial: the recipe, the --device to give, and how to read the run."""

    recipe: TrialRecipe
    device: str  # "cpu", or "0,...,K-1" of the GPUs Ray gives the trial
    score_column: str
    fitness_key: str
    poll_s: float
    epochs: int  # the trials' --epochs: the last epoch's score goes only into the final report


def run_ray_trial(config: dict[str, Any], job: RayTrialJob) -> None:
    """Ray Tune's function trainable: train trial config[NUMBER] on this worker and report each epoch, then the end.

    The last report carries the outcome (state, fitness, reason, epochs, best.pt); a trial that Ray's
    scheduler stops never sends it, and is recorded as pruned. If Ray kills this worker, the
    training process gets SIGTERM (TrialCommand.die_with_parent) and saves last.pt.
    """
    from ray import tune

    number = int(config[NUMBER])
    params = {key: config[key] for key in job.recipe.space.keys}
    command = job.recipe.command(number, params, job.device, die_with_parent=True)
    last = {"epoch": 0, "score": 0.0}

    def report(epoch: int, score: float) -> bool:
        last.update(epoch=epoch, score=score)
        # After its last epoch the trial only validates best.pt: a scheduler that stopped it on that epoch's
        # result (the median rule has no max_t) would lose its final score, so the final report carries it.
        if epoch < job.epochs:
            tune.report({SCORE: score, FITNESS: score, "epoch": epoch})  # Ray wants FITNESS in every result
        return False  # Ray's scheduler decides; it stops this function rather than answering here

    watch = TrialWatch(report=report, heartbeat=lambda: None, stop=threading.Event(), score_column=job.score_column,
                       fitness_key=job.fitness_key, poll_s=job.poll_s)  # fmt: skip
    outcome = run_trial(command, watch)
    fitness = outcome.fitness if outcome.state == COMPLETE else last["score"]  # StudySearch reads only `state`'s
    tune.report({SCORE: last["score"], FITNESS: fitness, "epoch": max(outcome.epochs, last["epoch"]),
                 "state": outcome.state, "reason": outcome.reason, "best": outcome.best,
                 "run_dir": str(command.run_dir)})  # fmt: skip
