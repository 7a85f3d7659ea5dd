"""Distributed context: the one place that reads torchrun/SLURM variables, plus collective helpers."""

from __future__ import annotations

import contextlib
import datetime
import gc
import logging
import os
import random
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from utils.cpus import cap_torch_threads, usable_cpus
from utils.errors import ConfigError
from utils.rendezvous import join_generation

LOGGER = logging.getLogger(__name__)
T = TypeVar("T")

# Collectives that outlive this (rank died, rank stuck in user code) raise instead of hanging; --dist-timeout sets it.
DEFAULT_TIMEOUT_MINUTES = 30.0
DEFAULT_TIMEOUT = datetime.timedelta(minutes=DEFAULT_TIMEOUT_MINUTES)


@dataclass(frozen=True)
class DistContext:
    """Where this process sits in the job: global rank, rank on its node, job size and device.

    Built once by `init_distributed()` and passed to every library function that behaves
    differently per rank. Tests build one by hand, e.g. `DistContext(rank=1, world_size=2)`.
    """

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")
    local_world_size: int = 1
    # torchrun's elastic agent: how many times it has restarted the workers, and the job's rendezvous id.
    restart_count: int = 0
    run_id: str = ""
    # Which start of the workers this is within the torchrun job (0: the first), the same on every rank.
    generation: int = 0

    @property
    def is_main(self) -> bool:
        """True on global rank 0, the rank that logs, plots and writes checkpoints."""
        return self.rank == 0

    @property
    def is_local_main(self) -> bool:
        """True on the first rank of each node, the rank that writes node-local files."""
        return self.local_rank == 0

    @property
    def is_distributed(self) -> bool:
        """True when more than one process takes part in the job."""
        return self.world_size > 1


def _env_int(names: tuple[str, ...], default: int) -> int:
    """First of `names` set in the environment, as an int; SLURM's "8(x2)" task lists give 8."""
    for name in names:
        value = os.environ.get(name, "").strip()
        if value:
            digits = re.match(r"\d+", value)
            if digits is None:
                raise ValueError(f"environment variable {name}={value!r} is not an integer")
            return int(digits.group())
    return default


def read_launch_env() -> tuple[int, int, int, int]:
    """Return (rank, local_rank, world_size, local_world_size) from torchrun or SLURM variables.

    torchrun's variables win; under `srun` without torchrun the SLURM ones are used; with
    neither the process runs alone.
    """
    rank = _env_int(("RANK", "SLURM_PROCID"), 0)
    local_rank = _env_int(("LOCAL_RANK", "SLURM_LOCALID"), 0)
    world_size = _env_int(("WORLD_SIZE", "SLURM_NTASKS"), 1)
    local_world_size = _env_int(("LOCAL_WORLD_SIZE",), 0) or _slurm_tasks_on_this_node() or world_size
    return rank, local_rank, world_size, local_world_size


def _slurm_tasks_on_this_node() -> int:
    """Tasks SLURM runs on this node; 0 outside SLURM.

    Read from srun's SLURM_STEP_TASKS_PER_NODE (the step's nodes), else the job's SLURM_TASKS_PER_NODE
    ("2(x3),1": 2 on each of the first three nodes, 1 on the fourth), at SLURM_NODEID; SLURM sets
    them always, unlike SLURM_NTASKS_PER_NODE (only with --ntasks-per-node, the fallback). A
    malformed list is a ValueError naming the variable.
    """
    name = "SLURM_STEP_TASKS_PER_NODE" if os.environ.get("SLURM_STEP_TASKS_PER_NODE") else "SLURM_TASKS_PER_NODE"
    listed = os.environ.get(name, "").strip()
    if not listed:
        return _env_int(("SLURM_NTASKS_PER_NODE",), 0)
    per_node = []
    for part in listed.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            raise ValueError(f"environment variable {name}={listed!r} is not a SLURM task list")
        per_node += [int(match.group(1))] * int(match.group(2) or 1)
    node = _env_int(("SLURM_NODEID",), 0)
    return per_node[node] if node < len(per_node) else 0


def local_cpu_share(ctx: DistContext) -> int:
    """CPUs this process may use (`usable_cpus`: affinity, cgroup quota), divided evenly among the ranks of its node.

    What one rank may use for loader workers or scan processes without oversubscribing the node;
    0 when the node has fewer CPUs than ranks.
    """
    return usable_cpus() // max(ctx.local_world_size, 1)


def select_device(device_arg: str, local_rank: int = 0) -> torch.device:
    """Turn a `--device` value ('', 'cpu', '0', 'cuda:0', '0,1') into this process's device.

    Under torchrun each process drives the GPU of its *local* rank; '' picks CUDA when it
    exists. A value that cannot be honoured (CUDA absent, not GPU numbers, a GPU this machine
    lacks, fewer GPUs than local ranks) is a user mistake: a one-line ConfigError naming the
    flag, which entry points print as `error: ...`.
    """
    arg = device_arg.strip().lower().replace("cuda:", "")
    if arg == "cpu" or (arg == "" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if arg == "mps":
        raise ConfigError("--device mps: Apple's MPS is not supported; use --device cpu (or a CUDA device)")
    if not torch.cuda.is_available():
        raise ConfigError(f"--device {device_arg} asks for CUDA but no CUDA device is available; use --device cpu")
    if arg in ("", "cuda"):
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    visible = gpu_indices(device_arg, arg)
    if local_rank >= len(visible):
        raise ConfigError(f"--device {device_arg} lists {len(visible)} GPU(s) but local rank {local_rank} needs one")
    return torch.device("cuda", visible[local_rank])


def gpu_indices(device_arg: str, arg: str) -> list[int]:
    """The GPU numbers of a `--device` list such as '0,1', each one this machine has, or a ConfigError."""
    words = [word.strip() for word in arg.split(",") if word.strip()]
    if not all(word.isdigit() for word in words):
        raise ConfigError(f"--device {device_arg}: expected cpu, cuda or GPU numbers such as 0 or 0,1")
    count = torch.cuda.device_count()
    missing = [int(word) for word in words if int(word) >= count]
    if missing:
        raise ConfigError(f"--device {device_arg}: no GPU {missing[0]} on this machine; it has {count} (0-{count - 1})")
    return [int(word) for word in words]


def _warn_unused_gpus(device_arg: str, local_rank: int, local_world_size: int) -> None:
    """One warning (local rank 0) when --device lists more GPUs than this node runs processes: each process uses one
    (DDP), so `python train.py --device 0,1` trains on GPU 0 alone, where YOLOv5 would use DataParallel."""
    arg = device_arg.strip().lower().replace("cuda:", "")
    listed = len(gpu_indices(device_arg, arg)) if arg not in ("", "cuda") else 0
    if local_rank == 0 and listed > local_world_size:
        LOGGER.warning(
            f"--device {device_arg} lists {listed} GPUs but this node runs {local_world_size} process(es), one GPU "
            f"each: launch with torchrun --nproc_per_node {listed} to train on all of them"
        )


# torchrun job id -> the start (rendezvous generation) this worker process joined first.
_START_OF_PROCESS: dict[str, int] = {}


def init_distributed(device_arg: str = "", timeout: datetime.timedelta = DEFAULT_TIMEOUT) -> DistContext:
    """Create this process's DistContext and, when launched with several processes, the process group.

    Uses NCCL on CUDA and gloo on CPU. The group has `timeout` (the entry points' --dist-timeout),
    so a rank that dies makes the others fail with an error instead of waiting forever; work that
    keeps one rank busy while others wait in a collective must stay well below it. Under
    torchrun's agent store the group's keys live in a space all ranks of this start agreed on
    (utils/rendezvous.py), never in one an earlier, failed start left behind. torch's CPU threads
    are capped to this rank's share of a container's CPU quota (`utils.cpus.cap_torch_threads`).
    Called once per entry point.
    """
    rank, local_rank, world_size, local_world_size = read_launch_env()
    restart_count = _env_int(("TORCHELASTIC_RESTART_COUNT",), 0)
    generation = 0
    device = select_device(device_arg, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        _warn_unused_gpus(device_arg, local_rank, local_world_size)
    if world_size > 1 and not dist.is_initialized():
        if "MASTER_ADDR" not in os.environ:
            raise RuntimeError("WORLD_SIZE > 1 but MASTER_ADDR is unset; launch with torchrun or set MASTER_ADDR/PORT")
        backend = "nccl" if device.type == "cuda" else "gloo"
        init_kwargs: dict[str, Any] = {"backend": backend, "timeout": timeout, "rank": rank, "world_size": world_size}
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            agent_store = dist.TCPStore(
                os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False, timeout=timeout
            )
            init_kwargs["store"], generation = join_generation(agent_store, rank, world_size, timeout)
            # A worker process lives within one start: a later group in the same process (a script calling
            # train.run twice) gets a fresh key space but is still that start, not a torchrun restart.
            generation = _START_OF_PROCESS.setdefault(os.environ.get("TORCHELASTIC_RUN_ID", ""), generation)
        if device.type == "cuda":
            init_kwargs["device_id"] = device
        dist.init_process_group(**init_kwargs)
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    ctx = DistContext(rank, local_rank, world_size, device, local_world_size, restart_count, run_id, generation)
    cap_torch_threads(max(1, local_cpu_share(ctx)))
    return ctx


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """Return the plain model inside a DistributedDataParallel (or DataParallel) wrapper, else `model`."""
    return getattr(model, "module", model)


def cleanup() -> None:
    """Destroy the process group if this process created one (safe to call twice).

    A DistributedDataParallel wrapper sits in reference cycles, so it (and the reference its
    reducer holds on the process group) outlives the function that built it until the cyclic
    collector runs. Left to interpreter shutdown, tearing down gloo's worker threads then aborts
    the process now and then ("terminate called without an active exception", SIGABRT, about 1
    run in 20 here), which torchrun reports as a failed job. Collecting first frees every
    unreachable wrapper while Python is fully alive.
    """
    if dist.is_available() and dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


def per_rank_batch(global_batch: int, ctx: DistContext) -> int:
    """Return the images each rank loads per step for the **global** `--batch-size` `global_batch`.

    The global batch is the one number users set (stable across 1, 8 or 64 GPUs); it must split
    evenly across ranks, otherwise a one-line ConfigError names the flag and the fix. Every rank
    computes the same answer from the same arguments, so every rank raises together.
    """
    if global_batch < 1:
        raise ConfigError(f"--batch-size {global_batch} must be at least 1")
    if global_batch % ctx.world_size:
        raise ConfigError(
            f"--batch-size {global_batch} is not divisible by {ctx.world_size} processes; "
            f"use a multiple of {ctx.world_size} (it is the global batch, split evenly across ranks)"
        )
    return global_batch // ctx.world_size


def barrier(ctx: DistContext) -> None:
    """Wait for every rank; a no-op in a single process. Every rank must call it."""
    if ctx.is_distributed and dist.is_initialized():
        dist.barrier()


@contextlib.contextmanager
def main_first(ctx: DistContext, local: bool = True) -> Iterator[None]:
    """Run the body on the (local) main rank first while the others wait, then on the others.

    For short once-only work whose result the others reuse: generating the built-in dataset (seconds).
    The others wait in a barrier bounded by the process-group timeout, so work that grows with the
    data (the label scan) is split across ranks instead. Every rank must enter it, so the barrier
    count matches.
    """
    is_first = ctx.is_local_main if local else ctx.is_main
    if not is_first:
        barrier(ctx)
    try:
        yield
    finally:
        if is_first:
            barrier(ctx)


def broadcast_object(obj: Any, ctx: DistContext, src: int = 0) -> Any:
    """Return rank `src`'s `obj` on every rank (decisions taken on rank 0). Every rank must call it."""
    if not (ctx.is_distributed and dist.is_initialized()):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_gather_objects(obj: Any, ctx: DistContext) -> list[Any]:
    """Return the list of every rank's `obj`, in rank order. Every rank must call it."""
    if not (ctx.is_distributed and dist.is_initialized()):
        return [obj]
    out: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(out, obj)
    return out


def job_start_number(ctx: DistContext) -> int:
    """This start's number within its torchrun job, 0 for the first; the same on every rank (a collective).

    A restart counted by any agent counts: with several nodes, an agent whose workers did not fail
    counts fewer restarts than the job had, and an agent store started afresh by a new rank-0 agent
    numbers its restarts from 0 again, while the rendezvous generation still counts the job's starts.
    """
    return max(ctx.generation, *all_gather_objects(ctx.restart_count, ctx))


def gather_objects(obj: Any, ctx: DistContext, dst: int = 0) -> list[Any] | None:
    """Return every rank's `obj` in rank order on rank `dst` and None on the others. Every rank must call it.

    Unlike `all_gather_objects` only `dst` holds the whole list, so gathering large per-rank
    results (COCO predictions) costs memory on one rank only. In a single process: `[obj]`.
    """
    if not (ctx.is_distributed and dist.is_initialized()):
        return [obj]
    out: list[Any] | None = [None] * ctx.world_size if ctx.rank == dst else None
    dist.gather_object(obj, out, dst=dst)
    return out


def all_reduce_sum(tensor: torch.Tensor, ctx: DistContext) -> torch.Tensor:
    """Sum `tensor` over ranks in place and return it. Every rank must call it."""
    if ctx.is_distributed and dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


@dataclass(frozen=True)
class RankMean:
    """A loss's `reduce_counts`: the mean of a tensor over ranks (all-reduce, / world size). Every rank must call it.

    `world_size` lets a loss clamp a normaliser where one process would: a floor of 1 on a global
    total is a floor of 1 / world_size on the mean.
    """

    ctx: DistContext

    @property
    def world_size(self) -> int:
        """Ranks the mean is taken over."""
        return self.ctx.world_size

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        """Return the mean of `tensor` over ranks (a new tensor; the argument is summed in place)."""
        return all_reduce_sum(tensor, self.ctx) / self.ctx.world_size


def seed_everything(seed: int, deterministic: bool = False) -> None:
    """Seed Python, NumPy and torch; with `deterministic`, also ask torch for repeatable kernels.

    Callers pass `seed + rank` for augmentation randomness, so ranks draw different mosaics.
    """
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


def smart_ddp(
    model: torch.nn.Module, ctx: DistContext, sync_bn: bool = False, static_graph: bool = False
) -> torch.nn.Module:
    """Wrap `model` for DistributedDataParallel when the job has several processes; else return it.

    On CUDA the module uses the local-rank GPU (`device_ids`), and with `sync_bn` its BatchNorm
    layers become SyncBatchNorm first. SyncBatchNorm refuses CPU tensors, so on CPU/gloo one
    warning is logged and per-rank BN is kept (the engine averages BN statistics before each
    evaluation and save). DDP broadcasts rank 0's parameters and buffers at construction.

    `static_graph` lets DDP skip re-discovering the graph each step. Callers must pass False
    when they accumulate gradients under `no_sync()`: in current PyTorch releases that combination
    crashes or silently stops all-reducing gradients.
    """
    if not ctx.is_distributed:
        return model
    from torch.nn.parallel import DistributedDataParallel

    if sync_bn and ctx.device.type == "cuda":
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
        LOGGER.info("Using SyncBatchNorm across %d processes", ctx.world_size)
    elif sync_bn:
        LOGGER.warning("--sync-bn needs CUDA; on CPU each rank keeps its own BatchNorm (stats averaged before eval)")
    device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    return DistributedDataParallel(
        model,
        device_ids=device_ids,
        output_device=device_ids[0] if device_ids else None,
        static_graph=static_graph,
    )


def average_bn_stats(model: torch.nn.Module, ctx: DistContext) -> None:
    """Average BatchNorm running mean/var over ranks in place; every rank must call it (a no-op in one process).

    Afterwards every rank (and rank 0's checkpoint) reflects the statistics of all shards.
    """
    if not (ctx.is_distributed and dist.is_initialized()):
        return
    buffers = [
        buffer
        for module in model.modules()
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm) and module.track_running_stats
        for buffer in (module.running_mean, module.running_var)
        if buffer is not None
    ]
    if not buffers:
        return
    flat = torch.cat([b.detach().float().reshape(-1) for b in buffers])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    flat /= ctx.world_size
    offset = 0
    for buffer in buffers:
        count = buffer.numel()
        buffer.copy_(flat[offset : offset + count].view_as(buffer))
        offset += count


def run_on_main(fn: Callable[[], T], ctx: DistContext, what: str) -> T | None:
    """Run `fn` on rank 0 and return its value there (None elsewhere); its failure is raised on every rank.

    Every rank must call it. Rank 0's exception is broadcast, so the other ranks raise too (a
    ConfigError as the same one-line ConfigError, anything else as RuntimeError naming `what`)
    instead of waiting in their next collective until the process-group timeout.
    """
    value, error = None, None
    if ctx.is_main:
        try:
            value = fn()
        except Exception as exc:  # re-raised below, after the other ranks have been told
            error = exc
    failure = broadcast_object(None if error is None else (isinstance(error, ConfigError), str(error)), ctx)
    if error is not None:
        raise error
    if failure is not None:
        is_config_error, message = failure
        raise ConfigError(message) if is_config_error else RuntimeError(f"{what} failed on rank 0: {message}")
    return value
