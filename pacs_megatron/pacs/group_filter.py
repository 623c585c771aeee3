"""Dynamic sampling (DAPO's group filtering): which prompt groups a step trains on, from rewards alone.

Shapes: ``scores [P * n]``, P prompt groups of n responses, a group's rows contiguous (advantage.py's
layout); ``keep [P]`` bool, one flag per prompt in the order the prompts were drawn.

    none    keep every group
    mixed   keep group g  iff  max_i R_gi != min_i R_gi      (DAPO / verl: the group's reward std > 0)

Why it is opt-in here: GRPO's and PPO's outcome advantages of an all-equal group are 0, so such a
group only dilutes the mean; PACS's is not 0: its implicit reward psi still moves and the PACS
reference trains the group with class weight 1. Filtering therefore changes PACS, and stays off in
its recipes.

A step draws prompts in rounds until it keeps ``need`` groups; :func:`take_groups` chooses the first
``need`` kept ones in draw order and says how many drawn prompts the step *consumed*: the prefix up to
its last trained prompt. The prompts after it go back to the prompt stream, so across steps (and a
resume) every prompt of the stream is visited exactly once, trained or filtered, never lost or repeated.

Example:
    >>> keep = keep_groups(torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0]), 2, "mixed")
    >>> keep.tolist()
    [True, False, False, True]
    >>> take_groups(keep, need=1, unit=1)
    ([0], 1)
"""

from __future__ import annotations

import torch

from pacs_megatron.batch.rows import check_groups
from pacs_megatron.pacs.config import FILTER_MODES


def keep_groups(scores: torch.Tensor, group_size: int, mode: str) -> torch.Tensor:
    """``[P]`` bool: whether each group of ``scores [P * n]`` is trained under filter ``mode``."""
    check_groups(scores.numel(), group_size)
    grouped = scores.reshape(-1, group_size)
    if mode == "none":
        return torch.ones(grouped.shape[0], dtype=torch.bool)
    if mode == "mixed":
        return grouped.amax(dim=1) != grouped.amin(dim=1)
    raise ValueError(f"filter_groups={mode!r}: choose one of {list(FILTER_MODES)}")


def take_groups(keep: torch.Tensor, need: int, unit: int) -> tuple[list[int], int]:
    """``(chosen, consumed)``: the indices of the groups to train and how many drawn prompts that uses.

    ``chosen`` is the first ``need`` kept groups in draw order; with fewer kept it is the first
    multiple of ``unit`` (the prompts of one optimizer step) of them, possibly none. ``consumed`` is
    one past the last chosen index (0 when none): the drawn prompts after it are returned to the stream.
    """
    if need < 1 or unit < 1 or need % unit:
        raise ValueError(f"need={need} must be a positive multiple of unit={unit}")
    kept = keep.nonzero().flatten().tolist()
    count = need if len(kept) >= need else len(kept) // unit * unit
    chosen = kept[:count]
    return chosen, (chosen[-1] + 1 if chosen else 0)


def filter_metrics(generated: int, kept: int, trained: int, rounds: int, returned: int) -> dict[str, float]:
    """The step's dynamic-sampling counters, under ``sampling/``: groups generated over all rounds, kept by
    the filter, trained (kept and within the step's need), the rounds run and the prompts given back."""
    return {
        "sampling/generated_groups": float(generated),
        "sampling/kept_groups": float(kept),
        "sampling/filtered_groups": float(generated - kept),
        "sampling/trained_groups": float(trained),
        "sampling/gen_rounds": float(rounds),
        "sampling/returned_prompts": float(returned),
    }
