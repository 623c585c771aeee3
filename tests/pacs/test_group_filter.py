"""Dynamic sampling's group choice: which groups are mixed, which are trained, how much of the stream is used."""

import random

import pytest
import torch

from pacs_megatron.pacs.group_filter import keep_groups, take_groups


def test_mixed_keeps_groups_whose_rewards_differ():
    scores = torch.tensor([1, 0, 0, 1, 1, 1, 1, 1, 0, 0, 1, 0, 0.5, 0.5, 0.5, 0.5], dtype=torch.float32)
    assert keep_groups(scores, 4, "mixed").tolist() == [True, False, True, False]
    assert keep_groups(scores, 4, "none").tolist() == [True] * 4
    assert keep_groups(torch.tensor([0.2, 0.7]), 2, "mixed").tolist() == [True]  # not only 0/1 rewards
    with pytest.raises(ValueError, match="filter_groups"):
        keep_groups(scores, 4, "std")
    with pytest.raises(ValueError, match="whole number of groups"):
        keep_groups(scores, 3, "mixed")


def test_take_the_first_kept_groups_and_consume_up_to_the_last():
    keep = torch.tensor([False, True, True, False, True, True, False])
    assert take_groups(keep, need=2, unit=1) == ([1, 2], 3)  # prompts 3.. go back to the stream
    assert take_groups(keep, need=4, unit=2) == ([1, 2, 4, 5], 6)
    # short: whole units only (unit = prompts per optimizer step); nothing at all -> nothing consumed
    assert take_groups(keep, need=6, unit=2) == ([1, 2, 4, 5], 6)
    assert take_groups(keep, need=6, unit=3) == ([1, 2, 4], 5)
    assert take_groups(torch.tensor([False, True]), need=2, unit=2) == ([], 0)
    with pytest.raises(ValueError, match="multiple"):
        take_groups(keep, need=3, unit=2)


def test_no_mixed_prompt_is_lost_or_trained_twice():
    """Steps of draw -> filter -> take over one prompt stream: every mixed prompt up to where the steps
    got is trained exactly once, and only filtered prompts are passed over."""
    rng = random.Random(0)
    stream = [rng.random() < 0.4 for _ in range(3000)]  # whether prompt i comes out mixed
    pos, trained = 0, []
    for _ in range(80):
        drawn = stream[pos : pos + 30]  # one oversampled round
        chosen, consumed = take_groups(torch.tensor(drawn), need=5, unit=5)
        trained += [pos + i for i in chosen]
        pos += consumed
    assert len(trained) > 300 and len(set(trained)) == len(trained)
    assert trained == [i for i in range(pos) if stream[i]]
