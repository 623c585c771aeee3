"""The context-parallel split (parallel/cp_split.py): chunks, round trip, the causal mask, bad input; and
parallel.cp in the config and the layout check."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pacs_megatron.config import ConfigError, ParallelConfig
from pacs_megatron.parallel import check_layout
from pacs_megatron.parallel.cp_split import (
    causal_allowed,
    chunk_positions,
    gathered_positions,
    pad_to_split,
    padded_length,
    split_sequence,
    unsplit_sequence,
)

MODEL = {"num_attention_heads": 8, "num_key_value_heads": 2, "num_hidden_layers": 6}


def test_zigzag_chunks_balance_the_causal_work():
    assert chunk_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert chunk_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert chunk_positions(12, 3, 1).tolist() == [2, 3, 8, 9]
    for cp in (1, 2, 3, 4):
        S = 2 * cp * 3
        parts = [chunk_positions(S, cp, r) for r in range(cp)]
        assert sorted(torch.cat(parts).tolist()) == list(range(S))
        # every rank's queries see the same number of keys in all (load balance)
        work = {int((p + 1).sum()) for p in parts}
        assert len(work) == 1


def test_split_unsplit_round_trip_and_padding():
    x = torch.arange(2 * 11).view(2, 11)
    for cp in (1, 2, 3):
        padded = pad_to_split(x, cp, value=-1)
        assert padded.shape[1] == padded_length(11, cp) and padded.shape[1] % (2 * cp) == 0
        assert torch.equal(padded[:, :11], x) and (padded[:, 11:] == -1).all()
        gathered = torch.cat([split_sequence(padded, cp, r) for r in range(cp)], dim=1)
        assert torch.equal(unsplit_sequence(gathered, cp), padded)
        assert torch.equal(gathered, padded[:, gathered_positions(padded.shape[1], cp)])
    assert padded_length(12, 3) == 12 and padded_length(13, 3) == 18
    # rows are never split: the batch dimension stays whole
    assert split_sequence(pad_to_split(x, 2), 2, 1).shape == (2, 6)


def test_split_refuses_unpadded_lengths_and_bad_ranks():
    with pytest.raises(ValueError, match=r"10 tokens does not split into 2 \* parallel.cp = 4 .* pad it to 12"):
        split_sequence(torch.zeros(1, 10), 2, 0)
    with pytest.raises(ValueError, match="CP rank 2 outside a CP group of 2"):
        chunk_positions(8, 2, 2)


def test_split_attention_with_the_zigzag_mask_is_causal_attention():
    """Each rank's queries against every rank's keys (gathered in rank order) under the mask from global
    positions give exactly the rows of full causal attention."""
    torch.manual_seed(0)
    b, h, S, d, cp = 2, 3, 12, 8, 3
    q, k, v = (torch.randn(b, h, S, d, dtype=torch.float64) for _ in range(3))
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    order = gathered_positions(S, cp)
    kg, vg = k[:, :, order], v[:, :, order]
    for r in range(cp):
        pos = chunk_positions(S, cp, r)
        out = F.scaled_dot_product_attention(q[:, :, pos], kg, vg, attn_mask=causal_allowed(pos, order))
        torch.testing.assert_close(out, full[:, :, pos], rtol=0, atol=1e-12)


def test_cp_config_and_layout_name_the_field():
    assert ParallelConfig(tp=2, cp=2, dp=2).world_size == 8
    with pytest.raises(ConfigError, match="parallel.cp"):
        ParallelConfig(cp=0)
    check_layout(ParallelConfig(tp=2, cp=2), MODEL, world_size=4)
    with pytest.raises(ConfigError, match=r"8 ranks but .*parallel.cp \* parallel.dp = 2\*1\*2\*1 = 4"):
        check_layout(ParallelConfig(tp=2, cp=2), MODEL, world_size=8)
    with pytest.raises(ConfigError, match=r"parallel.tp \* parallel.pp \* parallel.cp = 4 must divide it"):
        check_layout(ParallelConfig(tp=2, cp=2), MODEL, world_size=6)
    with pytest.raises(ConfigError, match="set parallel.dp=2"):
        check_layout(ParallelConfig(cp=2), MODEL, world_size=4)
    moe = {**MODEL, "model_type": "qwen3_moe", "num_experts": 4}
    with pytest.raises(ConfigError, match="parallel.cp=2 with a MoE model .* set parallel.cp=1"):
        check_layout(ParallelConfig(cp=2), moe, world_size=2)
