"""Token-budget micro-batches and DP balancing (batch/packing.py): properties over random long-tailed
lengths, the config-time and step-time errors, and the docstring examples."""

import doctest
import random

import pytest
import torch

import pacs_megatron.batch.packing as packing
from pacs_megatron.batch.build import build_rollouts
from pacs_megatron.batch.packing import (
    balance_groups,
    dp_balanced_shard,
    group_tokens,
    micro_batch_tokens,
    pack_micro_batches,
    padded_len,
    plan_micro_batches,
)
from pacs_megatron.config import ConfigError, load_config


def _lengths(rng: random.Random, groups: int, n: int) -> list[int]:
    """Reasoning-RL-like rows: a prompt per group, long-tailed (log-normal) responses."""
    out = []
    for _ in range(groups):
        prompt = rng.randint(4, 40)
        out += [prompt + min(int(rng.lognormvariate(3.5, 1.0)), 600) for _ in range(n)]
    return out


@pytest.mark.parametrize("seed", range(20))
def test_plan_keeps_groups_whole_within_budget_and_sorted(seed):
    rng = random.Random(seed)
    n, groups = rng.choice([1, 2, 4, 8]), rng.randint(1, 40)
    lens = _lengths(rng, groups, n)
    budget = max(group_tokens(lens, n)) * rng.choice([1, 2, 3, 8])
    plan = plan_micro_batches(lens, n, budget)
    assert sorted(g for mb in plan for g in mb) == list(range(groups)), "every group exactly once"
    tokens = micro_batch_tokens(lens, n, plan)
    assert all(t <= budget for t in tokens)
    # the next group (longest first) did not fit: no micro-batch could have taken one more
    for mb, nxt in zip(plan, plan[1:]):
        width = padded_len(max(lens[r] for g in mb + nxt[:1] for r in range(g * n, (g + 1) * n)))
        assert (len(mb) + 1) * n * width > budget
    heads = [max(lens[g * n : (g + 1) * n]) for g in (mb[0] for mb in plan)]
    assert heads == sorted(heads, reverse=True), "micro-batches ordered by length"
    assert plan == plan_micro_batches(list(lens), n, budget), "deterministic"
    # fewer padded tokens than padding every row to the longest one
    assert sum(tokens) <= len(lens) * padded_len(max(lens))


@pytest.mark.parametrize("seed", range(20))
def test_balance_groups_bound(seed):
    rng = random.Random(seed)
    bins = rng.choice([1, 2, 3, 4, 8])
    costs = [8 * rng.randint(1, 600) for _ in range(bins * rng.randint(1, 12))]
    split = balance_groups(costs, bins)
    assert sorted(i for b in split for i in b) == list(range(len(costs)))
    assert len({len(b) for b in split}) == 1, "the same number of groups per rank"
    loads = [sum(costs[i] for i in b) for b in split]
    assert max(loads) - min(loads) <= max(costs)
    assert split == balance_groups(list(costs), bins)


def test_balance_beats_contiguous_on_sorted_lengths():
    costs = list(range(100, 0, -1))  # contiguous halves: 3775 vs 1275
    loads = [sum(costs[i] for i in b) for b in balance_groups(costs, 2)]
    assert max(loads) - min(loads) <= 100 and abs(loads[0] - loads[1]) < 2500


def _batch(lens: list[int], n: int):
    prompts = [[1] * 2] * len(lens)
    responses = [[5 + i % 7] * (length - 2) for i, length in enumerate(lens)]
    return build_rollouts(prompts, responses, [float(i % 2) for i in range(len(lens))], n, pad_id=0, pad_to_multiple=8)


def test_pack_micro_batches_rows_and_widths():
    rng = random.Random(0)
    n = 4
    lens = _lengths(rng, 12, n)
    batch = _batch(lens, n)
    budget = 3 * max(group_tokens(lens, n))
    micro, index = pack_micro_batches(batch, budget, chunk_groups=6)
    assert sorted(index.tolist()) == list(range(len(lens)))
    start = 0
    for mb in micro:
        rows = index[start : start + len(mb)]
        start += len(mb)
        width = mb.input_ids.shape[1]
        assert width == padded_len(int(batch.seq_lens[rows].max())) and len(mb) * width <= budget
        assert torch.equal(mb.input_ids, batch.input_ids[rows, :width])
        assert torch.equal(mb.response_mask, batch.response_mask[rows, :width])
        assert not batch.response_mask[rows, width:].any(), "only padding is cut"
        assert len(set(mb.group_ids.tolist())) == len(mb) // n
    # chunked: each run of 6 groups is planned alone, exactly as a mini-batch of 6 groups would be
    first = batch.rows(0, 6 * n)
    alone, _ = pack_micro_batches(first, budget)
    assert [m.group_ids.tolist() for m in micro[: len(alone)]] == [m.group_ids.tolist() for m in alone]
    same, _ = pack_micro_batches(batch, budget, same_length=True)
    assert len({m.input_ids.shape[1] for m in same}) == 1


def test_dp_balanced_shard_partitions_each_mini_batch():
    rng = random.Random(3)
    n, dp, mini = 2, 2, 4
    batch = _batch(_lengths(rng, 8, n), n)
    shards = [dp_balanced_shard(batch, r, dp, mini) for r in range(dp)]
    for k in range(2):  # rank r's k-th mini-batch holds half of global mini-batch k's groups
        ids = sorted(g for s in shards for g in s.group_ids[k * 4 : (k + 1) * 4 : n].tolist())
        assert ids == list(range(k * mini, (k + 1) * mini))
    assert all(len(s) == len(batch) // dp for s in shards)


def test_oversized_group_errors():
    with pytest.raises(ValueError, match=r"prompt group 1 needs 48 tokens \(2 rows x 24 padded\).*=40"):
        plan_micro_batches([3, 3, 20, 9], group_size=2, max_tokens=40)
    with pytest.raises(ConfigError, match=r"max_tokens_per_micro_batch=1000 .* 8 x 1544 .* = 12352 tokens"):
        load_config(
            None, ["rollout.n=8", "rollout.max_response_length=1027", "algorithm.max_tokens_per_micro_batch=1000"]
        )
    load_config(None, ["rollout.n=8", "algorithm.max_tokens_per_micro_batch=1000", "algorithm.dynamic_batching=false"])


def test_doctests():
    result = doctest.testmod(packing)
    assert result.attempted >= 3 and result.failed == 0
