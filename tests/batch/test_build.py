"""Padded batches and the group-preserving splits."""

import pytest
import torch

from pacs_megatron.batch.build import build_rollouts, dp_shard, split_micro_batches, split_mini_batches


def _batch(groups=4, n=2):
    prompts = [[1, 2, 3]] * (groups * n)
    responses = [[4 + i] * (1 + i % 3) for i in range(groups * n)]
    return build_rollouts(prompts, responses, [float(i % 2) for i in range(groups * n)], n, pad_id=0, pad_to_multiple=4)


def test_layout():
    b = _batch()
    assert b.input_ids.shape == (8, 8)  # longest 3 + 3 = 6, padded to a multiple of 4
    assert b.response_mask.sum(1).tolist() == [1 + i % 3 for i in range(8)]
    assert b.seq_lens.tolist() == [4 + i % 3 for i in range(8)]
    assert b.group_ids.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]


def test_splits_keep_groups():
    b = _batch()
    micro = split_micro_batches(b, 4)
    assert [m.group_ids.tolist() for m in micro] == [[0, 0, 1, 1], [2, 2, 3, 3]]
    assert torch.equal(torch.cat([m.input_ids for m in micro]), b.input_ids)
    with pytest.raises(ValueError, match="multiple of rollout.n"):
        split_micro_batches(b, 3)
    assert len(split_mini_batches(b, 2)) == 2
    assert dp_shard(b, 1, 2).group_ids.tolist() == [2, 2, 3, 3]
    with pytest.raises(ValueError, match="data-parallel"):
        dp_shard(b, 0, 3)
    with pytest.raises(ValueError, match="split a prompt group"):
        b.rows(1, 3)
