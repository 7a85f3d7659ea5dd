"""A fresh, agreed key space in torchrun's agent store for each start of the workers.

torchrun's elastic agent hosts one TCPStore for the whole job and hands its address to every
worker it starts (TORCHELASTIC_USE_AGENT_STORE=True). The store outlives restarts, so the keys a
failed attempt's process group wrote (the dead ranks' addresses) are still there when the
restarted workers build theirs; gloo or NCCL may read them and wait on a peer that is gone.
torch keys each attempt by TORCHELASTIC_RESTART_COUNT, but every agent counts its own restarts:
with several agents (`--nnodes 1:2`), an agent whose workers did not fail restarts them without
counting, and the two halves of the job then look in different places.

Here the workers of one start agree among themselves, through the store alone, on a random token
that names their key space (`join_generation`). Every worker of an attempt is stopped before the
agents meet again, so none of an earlier attempt is alive when the next one joins:

- rank 0 numbers the start (a counter in the store), publishes `<number>-<random hex>` and waits
  until the other world_size - 1 ranks have joined that token, then marks it complete;
- any other rank joins the published token by incrementing its join counter. A token already
  marked complete (an earlier start, also one with fewer ranks when the job grew) or a count above
  world_size - 1 (that start already had all its ranks) is stale, and the rank waits for a newer
  one. A stale token whose start never completed is never marked complete (its rank 0 is gone),
  so a rank that joined it moves on when rank 0 publishes the new token.

The number also tells every rank, identically, whether this is the job's first start.
"""

from __future__ import annotations

import datetime
import secrets
import time

import torch.distributed as dist

CURRENT_KEY = "yolo/generation/current"
COUNTER_KEY = "yolo/generation/count"
POLL_S = 0.05


def _joined_key(token: str) -> str:
    return f"yolo/generation/{token}/joined"


def _complete_key(token: str) -> str:
    return f"yolo/generation/{token}/complete"


def _wait_step(deadline: float, rank: int, world_size: int, timeout: datetime.timedelta) -> None:
    if time.monotonic() > deadline:
        raise RuntimeError(
            f"rank {rank}: not all {world_size} ranks of this torchrun start joined within {timeout} "
            "(--dist-timeout); a rank failed to start or cannot reach the agent's store"
        )
    time.sleep(POLL_S)


def join_generation(
    store: dist.Store, rank: int, world_size: int, timeout: datetime.timedelta
) -> tuple[dist.Store, int]:
    """Agree with every other rank of this start on a fresh key space of `store`.

    Returns (a PrefixStore over that key space, the start's number: 0 for the job's first start
    of the workers, n for the n-th restart, counted the same on every rank). Raises RuntimeError
    when the other ranks do not all join within `timeout`.
    """
    deadline = time.monotonic() + timeout.total_seconds()
    if rank == 0:
        generation = store.add(COUNTER_KEY, 1) - 1
        token = f"{generation}-{secrets.token_hex(8)}"
        store.set(CURRENT_KEY, token)
        while store.add(_joined_key(token), 0) < world_size - 1:
            _wait_step(deadline, rank, world_size, timeout)
        store.set(_complete_key(token), "1")
    else:
        token, stale = "", set()
        while not (token and store.check([_complete_key(token)])):
            current = store.get(CURRENT_KEY).decode() if store.check([CURRENT_KEY]) else ""
            if current and current != token and current not in stale:
                # Complete, or joined by more ranks than this start has: an earlier start's token (one with
                # fewer ranks, when the job grew, has fewer joins than this world size but is complete).
                if store.check([_complete_key(current)]) or store.add(_joined_key(current), 1) > world_size - 1:
                    stale.add(current)
                else:
                    token = current
                continue
            _wait_step(deadline, rank, world_size, timeout)
        generation = int(token.split("-", 1)[0])
    return dist.PrefixStore(f"yolo/generation/{token}/pg", store), generation
