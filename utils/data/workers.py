"""Loader worker processes: how many a rank gets, their CPU priority, their seeds, and the stop signals they outlast."""

from __future__ import annotations

import ctypes
import functools
import logging
import multiprocessing
import os
import random
import signal
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

import cv2
import numpy as np
import torch

from utils.distributed import DistContext, local_cpu_share
from utils.errors import STOP_SIGNALS

LOGGER = logging.getLogger(__name__)


def resolve_num_workers(requested: int, ctx: DistContext, per_rank_batch: int) -> int:
    """Return the worker processes one rank's loader uses: min(requested, CPUs // local ranks, batch).

    CPUs are those this process may use (affinity, e.g. under SLURM, capped by a container's CPU
    quota: `utils.cpus.usable_cpus`), split evenly among the ranks on this node so the node is
    not oversubscribed; more workers than images per batch would only sit idle. 0 means loading
    in the main process.
    """
    return max(0, min(requested, local_cpu_share(ctx), per_rank_batch))


def worker_start_method() -> multiprocessing.context.BaseContext | None:
    """Return how every loader starts its workers: 'fork' on Linux, else None (the platform's default).

    A forked worker shares the training process's dataset (its label index, its RAM image cache)
    page by page until either writes it, and starts at once. Python 3.14 made 'forkserver' the
    default on Linux; there each worker would import the main script again and get its own
    pickled copy of the dataset: on 2 cores, 1,000 images cached at 640 px and 2 workers, the
    first optimizer step came at 10.7 s instead of 5.1 s and the processes held 3.4 GB of memory
    instead of 2.5 GB. Forking a process that runs CUDA and gloo/NCCL threads is safe for
    workers that use neither, which is how DataLoader forked on Linux before 3.14. macOS keeps
    'spawn' (its system libraries do not survive a fork).
    """
    if sys.platform.startswith("linux") and "fork" in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("fork")
    return None


# Added to each loader worker's nice value. When workers and the training process want more CPU than the
# node has, the kernel then favours training: on a 2-core machine, a quick-start step took ~4% less wall
# time with workers at +10 (7 alternating rounds), and the workers still kept their queue full.
WORKER_NICENESS = 10


def worker_init(seed: int, rank: int) -> Callable[[int], None]:
    """Return the `worker_init_fn` of a loader of rank `rank`: `init_worker` with its seed and the shared stop flag."""
    return functools.partial(init_worker, seed=seed, rank=rank, stops_handled=_STOPS_HANDLED)


def init_worker(worker_id: int, seed: int, rank: int, stops_handled: ctypes.c_bool) -> None:
    """`worker_init_fn` of every loader: one OpenCV thread, lower CPU priority, stop signals, then seeding.

    The workers are the parallelism: OpenCV's own thread pool in each of them (as many threads as
    cores, like torch's, which DataLoader already sets to 1 in a worker) only adds threads that
    wait for each other's cores. `stops_handled` is the flag `set_stops_handled` sets (`worker_init`
    passes it, so it is shared under any start method).
    """
    cv2.setNumThreads(0)  # 0: run OpenCV functions in the calling thread
    lower_cpu_priority(WORKER_NICENESS)
    outlast_stop_signals(stops_handled)
    seed_worker(worker_id, seed, rank)


# True while a training loop turns stop signals into a checkpoint (utils/train/faults.StopSignals). Created before
# any worker exists and handed to each by `worker_init`: the workers read what the training process sets.
_STOPS_HANDLED = multiprocessing.RawValue(ctypes.c_bool, False)


def set_stops_handled(handled: bool) -> bool:
    """Tell every loader worker of this process whether a stop signal now ends in a save; return the previous value."""
    previous = bool(_STOPS_HANDLED.value)
    _STOPS_HANDLED.value = handled
    return previous


def outlast_stop_signals(stops_handled: ctypes.c_bool) -> None:
    """Keep this loader worker serving batches after a stop signal while its training process saves.

    torchrun stops a rank by signalling its process group, SLURM signals every process of a job
    step and a terminal's Ctrl-C reaches its whole foreground group, so the workers get the signal
    with the training process. Killed by it, a worker takes the run down with it (the DataLoader
    raises "worker killed by signal") before the checkpoint the training process saves at its next
    optimizer step. So while `stops_handled` is set, a worker ignores those signals: the training
    process stops it once it has saved, or, if that process dies first, DataLoader's own watchdog
    in the worker sees its parent gone and ends it. At any other time (validation alone, a run
    that is failing or exiting, whose exit handlers stop daemonic workers with SIGTERM) the signal
    does what it always does. A signal the worker was started with ignored stays ignored.
    """
    for name in STOP_SIGNALS:
        number = getattr(signal, name, None)
        if number is not None and signal.getsignal(number) is not signal.SIG_IGN:
            # A worker forked inside the training loop inherits its handler: give it the default's action instead.
            own_action = signal.default_int_handler if name == "SIGINT" else signal.SIG_DFL
            handler = functools.partial(_on_stop_signal, stops_handled=stops_handled, own_action=own_action)
            signal.signal(number, handler)


def _on_stop_signal(signum: int, frame: FrameType | None, stops_handled: ctypes.c_bool, own_action: Any) -> None:
    if stops_handled.value:
        return
    signal.signal(signum, own_action)  # this signal now acts as it would have, and this one acts so at once
    if callable(own_action):
        own_action(signum, frame)  # SIGINT: KeyboardInterrupt, which DataLoader's worker loop ends quietly on
    else:
        signal.raise_signal(signum)


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
