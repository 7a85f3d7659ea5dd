"""Tests for utils/data/sampler.py: equal steps per rank, shard-only or shared sampling, epoch order, eval ranges."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from tests.dist_helpers import captured, check_parts, run_distributed
from utils.data.sampler import ShardedInferenceSampler, SmartDistributedSampler, inference_batches, order_seed
from utils.distributed import DistContext

SIZES = [(10, 2), (11, 2), (13, 2), (10, 3), (11, 3), (13, 3)]


def stand_in_rank_shard(num_items: int, ctx: DistContext, seed: int) -> np.ndarray:
    """Local stand-in for utils.data.cache.rank_shard with the contract's semantics (same permutation, every W-th)."""
    permutation = np.random.default_rng(seed).permutation(num_items)
    return permutation[ctx.rank :: ctx.world_size]


def make_sampler(
    num_items: int, rank: int, world_size: int, seed: int = 3, **kwargs: object
) -> SmartDistributedSampler:
    ctx = DistContext(rank=rank, world_size=world_size)
    return SmartDistributedSampler(stand_in_rank_shard(num_items, ctx, seed), ctx, seed, num_items, **kwargs)


@pytest.mark.parametrize(("num_items", "world_size"), SIZES)
def test_every_rank_same_length_and_only_own_shard(num_items: int, world_size: int) -> None:
    seen: set[int] = set()
    for rank in range(world_size):
        sampler = make_sampler(num_items, rank, world_size)
        sampler.set_epoch(2)
        indices = list(sampler)
        shard = set(sampler.shard.tolist())
        assert len(indices) == len(sampler) == math.ceil(num_items / world_size)
        assert set(indices) == shard  # only own items, and every own item at least once
        seen |= shard
    assert seen == set(range(num_items))


def test_padding_repeats_own_items_from_the_epoch_permutation() -> None:
    sampler = make_sampler(11, rank=1, world_size=2)  # shard of 5, padded to 6
    assert len(sampler.shard) == 5
    for epoch in range(3):
        sampler.set_epoch(epoch)
        indices = list(sampler)
        assert len(indices) == 6
        assert len(set(indices[:5])) == 5  # one full permutation first
        assert indices[5] == indices[0]  # the pad is the head of that permutation


def test_set_epoch_changes_order_and_same_seed_epoch_repeats() -> None:
    sampler = make_sampler(13, rank=0, world_size=2)
    orders = []
    for epoch in range(4):
        sampler.set_epoch(epoch)
        orders.append(list(sampler))
    assert sampler.epoch == 3
    assert len({tuple(order) for order in orders}) == 4  # 7! orders: a repeat would be a bug
    again = make_sampler(13, rank=0, world_size=2)
    again.set_epoch(2)
    assert list(again) == orders[2]
    other_seed = SmartDistributedSampler(sampler.shard, DistContext(rank=0, world_size=2), 4, dataset_len=13)
    other_seed.set_epoch(2)
    assert list(other_seed) != orders[2]


@pytest.mark.parametrize("shared", [False, True])
def test_indices_of_any_epoch_is_that_epochs_order_and_leaves_the_selected_epoch(shared: bool) -> None:
    """A loader draws later epochs' orders ahead of time; that must neither differ nor move `set_epoch`'s choice."""
    sampler = shared_samplers(11, 2)[1] if shared else make_sampler(11, rank=1, world_size=2)
    sampler.set_epoch(1, start=2)
    ahead = {epoch: sampler.indices_of(epoch).tolist() for epoch in (2, 3)}
    assert (sampler.epoch, sampler.start, len(sampler)) == (1, 2, 4)
    for epoch, indices in ahead.items():
        sampler.set_epoch(epoch)
        assert list(sampler) == indices
    assert ahead[2] != ahead[3]


def test_order_seed_separates_ranks_and_epochs() -> None:
    seeds = {order_seed(0, epoch, rank) for epoch in range(5) for rank in range(5)}
    assert len(seeds) == 25  # seed + epoch + rank would collide here
    assert order_seed(-1, 0, 0) == order_seed(2**64 - 1, 0, 0)


def test_no_shuffle_keeps_shard_order() -> None:
    sampler = make_sampler(11, rank=1, world_size=2, shuffle=False)
    sampler.set_epoch(5)
    shard = sampler.shard.tolist()
    assert list(sampler) == shard + shard[:1]


def test_num_samples_override_pads_or_truncates() -> None:
    longer = make_sampler(10, rank=0, world_size=2, num_samples=12)
    indices = list(longer)
    assert len(indices) == 12 and indices[5:10] == indices[:5] and indices[10:] == indices[:2]
    shorter = make_sampler(10, rank=0, world_size=2, num_samples=3)
    assert len(list(shorter)) == 3 and set(shorter) <= set(shorter.shard.tolist())


def test_rejects_shard_that_does_not_match_dataset() -> None:
    ctx = DistContext(rank=0, world_size=2)
    with pytest.raises(ValueError, match="shard has 3 indices"):
        SmartDistributedSampler(np.arange(3), ctx, 0, dataset_len=10)
    with pytest.raises(ValueError, match="outside"):
        SmartDistributedSampler(np.arange(5) + 6, ctx, 0, dataset_len=10)
    with pytest.raises(ValueError, match="3 processes"):
        SmartDistributedSampler(np.arange(1), DistContext(rank=0, world_size=3), 0, dataset_len=2)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("batch", [1, 2, 3])
@pytest.mark.parametrize("num_items", [1, 7, 10, 11, 13])
def test_inference_batches_cover_each_index_once_and_never_cross_a_global_batch(
    num_items: int, batch: int, world_size: int
) -> None:
    group = batch * world_size  # the global batch the dataset's rectangles were computed with
    samplers = [
        ShardedInferenceSampler(num_items, DistContext(rank=r, world_size=world_size), group, batch)
        for r in range(world_size)
    ]
    batches = [indices for sampler in samplers for indices in sampler]
    assert [i for indices in batches for i in indices] == list(range(num_items))  # no padding, no duplicates
    # Each batch lies inside one global batch: its images get that batch's rectangle on any number of ranks.
    assert all(len({i // group for i in indices}) == 1 and len(indices) <= batch for indices in batches)
    lengths = [len(sampler) for sampler in samplers]
    assert max(lengths) - min(lengths) <= 1  # balanced to one batch
    assert lengths[0] >= 1  # rank 0, which draws the val_batch figures, always gets a batch
    for sampler in samplers:  # each rank's indices are one contiguous run
        mine = [i for indices in sampler for i in indices]
        assert not mine or mine == list(range(mine[0], mine[0] + len(mine)))


def test_inference_batches_reject_bad_sizes() -> None:
    with pytest.raises(ValueError, match="batch sizes"):
        inference_batches(10, 0, 2, 4, 0)


def _gather_sampler_indices(ctx: DistContext, num_items: int, seed: int) -> None:
    train = SmartDistributedSampler(stand_in_rank_shard(num_items, ctx, seed), ctx, seed, dataset_len=num_items)
    train.set_epoch(1)
    mine = (
        list(train),
        train.shard.tolist(),
        [i for indices in ShardedInferenceSampler(num_items, ctx, 2 * ctx.world_size, 2) for i in indices],
    )
    every: list[tuple[list[int], list[int], list[int]] | None] = [None] * ctx.world_size
    dist.all_gather_object(every, mine)
    assert len({len(indices) for indices, _, _ in every}) == 1  # equal steps on every rank
    for indices, shard, _ in every:
        assert set(indices) == set(shard)
    assert sorted(i for _, shard, _ in every for i in shard) == list(range(num_items))
    assert [i for _, _, inference in every for i in inference] == list(range(num_items))


@pytest.mark.distributed
def test_two_gloo_ranks_agree_on_lengths_and_cover_dataset(rank_results: list[dict[str, Any]]) -> None:
    check_parts(rank_results, "lengths_and_cover")  # the ranks assert; a rank that raised fails this test


def shared_samplers(num_items: int, world_size: int, seed: int = 3, **kwargs: object) -> list[SmartDistributedSampler]:
    """One sampler per rank over every index, as the dataset's shard is with --cache shm."""
    return [
        SmartDistributedSampler(
            np.arange(num_items), DistContext(rank=r, world_size=world_size), seed, num_items, **kwargs
        )
        for r in range(world_size)
    ]


@pytest.mark.parametrize(("num_items", "world_size"), SIZES)
def test_shared_dataset_is_one_permutation_dealt_out_to_the_ranks(num_items: int, world_size: int) -> None:
    samplers = shared_samplers(num_items, world_size)
    per_epoch = []
    for epoch in range(3):
        for sampler in samplers:
            sampler.set_epoch(epoch)
        deals = [list(sampler) for sampler in samplers]
        assert {len(deal) for deal in deals} == {math.ceil(num_items / world_size)}  # equal steps
        everything = [index for deal in deals for index in deal]
        assert set(everything) == set(range(num_items))  # every image this epoch
        assert len(everything) - num_items < world_size  # repeats: only the padding of the last round
        generator = torch.Generator().manual_seed(order_seed(3, epoch, 0))
        permutation = torch.randperm(num_items, generator=generator).tolist()
        assert deals[1] == (permutation * 2)[1 : len(deals[1]) * world_size : world_size]
        per_epoch.append(deals[0])
    assert len({tuple(deal) for deal in per_epoch}) == 3  # reshuffled each epoch
    # A rank is not confined to a shard: over the epochs rank 0 draws from the whole dataset.
    assert len(set(sum(per_epoch, []))) > math.ceil(num_items / world_size)


def test_shared_dataset_in_one_process_samples_as_its_shard_would() -> None:
    (sampler,) = shared_samplers(13, 1)
    for epoch in range(3):
        sampler.set_epoch(epoch)
        generator = torch.Generator().manual_seed(order_seed(3, epoch, 0))  # rank 0's shard order
        assert list(sampler) == torch.randperm(13, generator=generator).tolist()


def test_shared_dataset_resumes_mid_epoch_and_repeats_per_seed_and_epoch() -> None:
    sampler, again = shared_samplers(11, 2)[1], shared_samplers(11, 2)[1]
    sampler.set_epoch(4)
    whole = list(sampler)
    again.set_epoch(4, start=2)
    assert len(again) == 4 and list(again) == whole[2:]  # the rest of the interrupted epoch, exactly
    other_seed = shared_samplers(11, 2, seed=4)[1]
    other_seed.set_epoch(4)
    assert list(other_seed) != whole


def test_shared_dataset_without_shuffle_deals_out_dataset_order() -> None:
    samplers = shared_samplers(11, 2, shuffle=False)
    assert [list(s) for s in samplers] == [[0, 2, 4, 6, 8, 10], [1, 3, 5, 7, 9, 0]]
    with pytest.raises(ValueError, match="not each of"):
        SmartDistributedSampler(np.zeros(10, np.int64), DistContext(rank=0, world_size=2), 0, dataset_len=10)


def _seen_by(samplers: list[SmartDistributedSampler], epoch: int, per_rank_batch: int, batches_done: int) -> np.ndarray:
    """The images an interrupted run of these ranks had trained: each rank's first `batches_done` batches."""
    return np.unique(np.concatenate([s.indices_of(epoch)[: per_rank_batch * batches_done] for s in samplers]))


# Per-rank shards on several new ranks gather their plans' lengths: that case is the gloo test below.
@pytest.mark.parametrize(
    ("shared", "old_world", "new_world"),
    [(False, 2, 1), (False, 3, 1), (False, 1, 1), (True, 2, 1), (True, 3, 1), (True, 2, 3), (True, 1, 2)],
)
def test_a_remainder_plan_trains_every_unseen_image_once_and_no_seen_one(
    shared: bool, old_world: int, new_world: int
) -> None:
    num_items, epoch, batch = 23, 4, 2
    build = shared_samplers if shared else lambda n, w: [make_sampler(n, r, w) for r in range(w)]
    seen = _seen_by(build(num_items, old_world), epoch, per_rank_batch=3, batches_done=2)
    assert 0 < len(seen) < num_items
    new = build(num_items, new_world)
    starts = {sampler.plan_remainder(epoch, seen, batch) for sampler in new}
    assert len(starts) == 1  # every rank starts the rest at the same batch
    start = starts.pop()
    whole = math.ceil(new[0].num_samples / batch)  # the epoch keeps its number of batches: steps count on
    assert all(math.ceil(s.length_of(epoch) / batch) == whole for s in new) and 0 < start < whole
    rests = [sampler.indices_of(epoch)[start * batch :] for sampler in new]
    assert len({len(rest) for rest in rests}) == 1
    trained = np.concatenate(rests)
    assert set(trained.tolist()) == set(range(num_items)) - set(seen.tolist())  # every unseen image, no seen one
    assert len(trained) - len(set(trained.tolist())) < new_world  # repeats only to even out the ranks
    for sampler in new:  # the batches before the start stand for what was trained; other epochs are their own
        assert set(sampler.indices_of(epoch)[: start * batch].tolist()) <= set(seen.tolist())
        assert len(sampler.indices_of(epoch + 1)) == sampler.num_samples
        np.testing.assert_array_equal(sampler.plan_seen, seen)


def test_an_epoch_with_nothing_left_starts_at_its_end() -> None:
    sampler = make_sampler(10, 0, 1)
    assert sampler.plan_remainder(2, np.arange(10), batch_size=4) == 3  # all 3 batches done
    sampler.set_epoch(2, start=sampler.length_of(2))
    assert list(sampler) == []


def _plan_on_two_ranks(ctx: DistContext, num_items: int, seen: list[int]) -> tuple[int, list[int]]:
    sampler = SmartDistributedSampler(stand_in_rank_shard(num_items, ctx, 3), ctx, 3, dataset_len=num_items)
    start = sampler.plan_remainder(4, np.asarray(seen), batch_size=2)
    return start, sampler.indices_of(4)[start * 2 :].tolist()


REMAINDER_ITEMS = 23


def _seen_before_the_remainder() -> np.ndarray:
    """What a one-rank run had trained of epoch 4 when it stopped: 3 batches of 4, 12 images."""
    return _seen_by([make_sampler(REMAINDER_ITEMS, 0, 1)], 4, per_rank_batch=4, batches_done=3)


@pytest.mark.distributed
def test_on_two_gloo_ranks_a_remainder_plan_is_equally_long_and_covers_the_unseen(
    rank_results: list[dict[str, Any]],
) -> None:
    num_items, seen = REMAINDER_ITEMS, _seen_before_the_remainder()
    (start0, rest0), (start1, rest1) = check_parts(rank_results, "remainder_plan")
    assert start0 == start1 and len(rest0) == len(rest1) > 0
    for rank, rest in enumerate((rest0, rest1)):  # each rank keeps to its own shard (what its cache holds)
        assert set(rest) <= set(stand_in_rank_shard(num_items, DistContext(rank=rank, world_size=2), 3).tolist())
    assert set(rest0) | set(rest1) == set(range(num_items)) - set(seen.tolist())


def _rank_checks(ctx: DistContext, seen: list[int]) -> dict[str, Any]:
    """The 2-rank checks of this module, in the same order on both ranks: one spawned job for both."""
    return {
        "lengths_and_cover": captured(_gather_sampler_indices, ctx, 11, 5),
        "remainder_plan": captured(_plan_on_two_ranks, ctx, REMAINDER_ITEMS, seen),
    }


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Both ranks' results of _rank_checks: a spawned job costs seconds of torch imports, so the tests share one."""
    seen = _seen_before_the_remainder().tolist()
    return run_distributed(_rank_checks, 2, tmp_path_factory.mktemp("sampler_ranks"), seen)
