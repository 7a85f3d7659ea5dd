"""Loader worker processes: how many a rank gets, their CPU priority, their seeds, and the stop signals they outlast."""

from __future__ import annotations

import logging
import os
import random
import signal

import cv2
import numpy as np
import torch

from utils.distributed import DistContext, local_cpu_share
from utils.errors import STOP_GRACE_S, STOP_SIGNALS

LOGGER = logging.getLogger(__name__)


def resolve_num_workers(requested: int, ctx: DistContext, per_rank_batch: int) -> int:
    """Return the worker processes one rank's loader uses: min(requested, CPUs // local ranks, batch).

    CPUs are those this process may use (affinity, e.g. under SLURM, capped by a container's CPU
    quota: `utils.cpus.usable_cpus`), split evenly among the ranks on this node so the node is
    not oversubscribed; more workers than images per batch would only sit idle. 0 means loading
    in the main process.
    """
    return max(0, min(requested, local_cpu_share(ctx), per_rank_batch))


# Added to each loader worker's nice value. When workers and the training process want more CPU than the
# node has, the kernel then favours training: on a 2-core machine, a quick-start step took ~4% less wall
# time with workers at +10 (7 alternating rounds), and the workers still kept their queue full.
WORKER_NICENESS = 10


def init_worker(worker_id: int, seed: int, rank: int) -> None:
    """`worker_init_fn` of every loader: one OpenCV thread, lower CPU priority, stop signals, then seeding.

    The workers are the parallelism: OpenCV's own thread pool in each of them (as many threads as
    cores, like torch's, which DataLoader already sets to 1 in a worker) only adds threads that
    wait for each other's cores.
    """
    cv2.setNumThreads(0)  # 0: run OpenCV functions in the calling thread
    lower_cpu_priority(WORKER_NICENESS)
    outlast_stop_signals()
    seed_worker(worker_id, seed, rank)


# How long a loader worker lives on after a stop signal when nobody shuts it down: the training process's
# own deadline after that signal (STOP_GRACE_S), plus time for it to shut its workers down.
WORKER_STOP_GRACE_S = int(STOP_GRACE_S) + 30


def outlast_stop_signals() -> None:
    """Keep this loader worker serving batches after SIGTERM / SIGUSR1; the training process decides.

    torchrun stops a rank by signalling its process group, and SLURM signals every process of a
    job step, so the workers get the signal with the training process. Killed by it, a worker
    takes the run down with it (the DataLoader raises "worker killed by signal") before the
    checkpoint the training process saves at its next optimizer step. A worker that gets one
    instead arms an alarm: if it is still alive WORKER_STOP_GRACE_S later (its process never shut
    it down, or a stuck worker that the DataLoader's shutdown signalled), SIGALRM's default action
    ends it. Without the signal (Windows), nothing to do.
    """
    if not hasattr(signal, "SIGALRM"):
        return
    for name in STOP_SIGNALS:
        number = getattr(signal, name, None)
        if number is not None:
            signal.signal(number, _arm_exit_alarm)


def _arm_exit_alarm(_signum: int, _frame: object) -> None:
    signal.alarm(WORKER_STOP_GRACE_S)


def lower_cpu_priority(increment: int) -> None:
    """Raise this process's nice value by `increment`, where the OS has one (best effort, never raises)."""
    if hasattr(os, "nice"):
        try:
            os.nice(increment)
        except OSError as error:  # e.g. a container that forbids it: run at normal priority
            LOGGER.debug("loader worker keeps its priority: %s", error)


def seed_worker(worker_id: int, seed: int, rank: int) -> None:
    """Seed Python, NumPy and torch inside one loader worker from (seed, rank, worker_id).

    Called in every worker by `init_worker`. Without it forked workers share the parent's NumPy state and
    draw identical augmentations; mixing the three numbers through `np.random.SeedSequence`
    gives every worker of every rank its own independent, reproducible streams. Workers are
    persistent, so this runs once and the streams continue across epochs.
    """
    words = np.random.SeedSequence([seed % 2**64, rank, worker_id]).generate_state(4, np.uint64)
    random.seed(int(words[0]))
    np.random.seed(words[1:3].view(np.uint32))
    torch.manual_seed(int(words[3]))
