"""join_generation against a real TCPStore: the ranks of one start agree on a fresh key space whatever
earlier starts left in the store, in whatever order the ranks arrive."""

from __future__ import annotations

import datetime
import threading
import time

import pytest
import torch.distributed as dist

from utils.rendezvous import COUNTER_KEY, CURRENT_KEY, _joined_key, join_generation

TIMEOUT = datetime.timedelta(seconds=20)


@pytest.fixture()
def server() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)


def _client(server: dist.TCPStore) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=TIMEOUT)


def _start(server: dist.TCPStore, world_size: int, delays: dict[int, float]) -> dict[int, tuple[dist.Store, int]]:
    """Run join_generation for every rank in its own thread and client, rank r after delays.get(r, 0) s."""
    results: dict[int, tuple[dist.Store, int]] = {}
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        time.sleep(delays.get(rank, 0.0))
        try:
            results[rank] = join_generation(_client(server), rank, world_size, TIMEOUT)
        except BaseException as error:  # noqa: BLE001 (reported to the test below)
            errors.append(error)

    threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors, errors
    assert sorted(results) == list(range(world_size))
    return results


def _one_key_space(results: dict[int, tuple[dist.Store, int]], tag: str) -> None:
    """A key one rank writes through its store is what every other rank reads through its own."""
    results[0][0].set("probe", tag)
    assert {store.get("probe").decode() for store, _ in results.values()} == {tag}


def test_the_first_start_is_generation_0_in_one_key_space(server: dist.TCPStore) -> None:
    results = _start(server, 3, {})
    assert {generation for _, generation in results.values()} == {0}
    _one_key_space(results, "first")


@pytest.mark.parametrize("grown", [False, True], ids=["same_size", "grown"])
@pytest.mark.parametrize("half_dead", [False, True])
@pytest.mark.parametrize("rank0_delay", [0.0, 0.4])
def test_a_restart_never_joins_what_an_earlier_start_left(
    server: dist.TCPStore, half_dead: bool, rank0_delay: float, grown: bool
) -> None:
    # grown: torchrun --nnodes 1:2 restarts 2 workers as 4 when a node joins; the first start's complete
    # token then has fewer joins than the new start has ranks, and must still be passed over.
    first = _start(server, 2 if grown else 3, {})
    _one_key_space(first, "first")
    if half_dead:  # a start that died half-way: its rank 0 published a token, rank 1 joined it, rank 2 never came
        server.add(COUNTER_KEY, 1)
        server.set(CURRENT_KEY, "1-deadbeef")
        server.add(_joined_key("1-deadbeef"), 1)
    # The next start; with rank0_delay the other ranks find the earlier start's token first.
    second = _start(server, 4 if grown else 3, {0: rank0_delay, 1: 0.0, 2: 0.1})
    assert {generation for _, generation in second.values()} == {2 if half_dead else 1}
    for store, _ in second.values():
        assert not store.check(["probe"])  # nothing of the first start's key space is visible
    _one_key_space(second, "second")
    assert first[0][0].get("probe").decode() == "first"


def test_a_rank_that_never_comes_is_a_clear_error(server: dist.TCPStore) -> None:
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="not all 2 ranks of this torchrun start joined"):
        join_generation(_client(server), 0, 2, datetime.timedelta(seconds=0.5))
    assert time.monotonic() - started < 10
