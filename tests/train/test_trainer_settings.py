"""Trainer settings: sampling fields validated where declared (temperature 0 is greedy validation), the time
budget counted from the launch, val_before_train."""

from __future__ import annotations

import pytest
import torch
from _runs import CONFIG

from pacs_megatron.config import ConfigError, load_config
from pacs_megatron.loop.stages import val_sampling
from pacs_megatron.rollout.hf_engine import sample_tokens


def test_val_sampling_fields_are_checked_and_temperature_zero_is_greedy():
    with pytest.raises(ConfigError, match=r"trainer.val_top_p=0.0 must be in \(0, 1\]"):
        load_config(CONFIG, ["trainer.val_top_p=0"])
    with pytest.raises(ConfigError, match="trainer.val_temperature=-1.0 must be >= 0"):
        load_config(CONFIG, ["trainer.val_temperature=-1"])
    sampling = val_sampling(load_config(CONFIG, ["trainer.val_temperature=0"]))
    logits = torch.tensor([[0.0, 3.0, 2.9, 0.0]] * 64)
    tokens, _ = sample_tokens(logits, sampling, torch.Generator().manual_seed(0))  # the engine's sampler
    assert tokens.tolist() == [1] * 64  # always the argmax


def test_time_budget_counts_from_the_launch_and_val_before_train_needs_validation():
    from pacs_megatron.config.training import TrainerConfig, stop_deadline

    assert stop_deadline(TrainerConfig(stop_after_s=6.0), launched_unix=1000.0) == 1006.0  # not from the loop
    assert stop_deadline(TrainerConfig(stop_after_s=60.0, deadline_unix=1030.0), launched_unix=1000.0) == 1030.0
    assert stop_deadline(TrainerConfig(), launched_unix=1000.0) == 0.0
    with pytest.raises(ConfigError, match="trainer.val_before_train=true needs validation: set trainer.test_freq"):
        load_config(CONFIG, ["trainer.val_before_train=true", "trainer.test_freq=0"])
