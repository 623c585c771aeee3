"""trainer.val_*: every sampling field validated where it is declared; temperature 0 is greedy validation."""

from __future__ import annotations

import pytest
import torch
from _runs import CONFIG

from pacs_megatron.config import ConfigError, load_config
from pacs_megatron.rollout.hf_engine import sample_tokens
from pacs_megatron.stages import val_sampling


def test_val_sampling_fields_are_checked_and_temperature_zero_is_greedy():
    with pytest.raises(ConfigError, match=r"trainer.val_top_p=0.0 must be in \(0, 1\]"):
        load_config(CONFIG, ["trainer.val_top_p=0"])
    with pytest.raises(ConfigError, match="trainer.val_temperature=-1.0 must be >= 0"):
        load_config(CONFIG, ["trainer.val_temperature=-1"])
    sampling = val_sampling(load_config(CONFIG, ["trainer.val_temperature=0"]))
    logits = torch.tensor([[0.0, 3.0, 2.9, 0.0]] * 64)
    tokens, _ = sample_tokens(logits, sampling, torch.Generator().manual_seed(0))  # the engine's sampler
    assert tokens.tolist() == [1] * 64  # always the argmax
