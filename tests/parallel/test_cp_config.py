"""What parallel.cp > 1 does not run yet is refused in one line before any rank starts: the learned critic and
routing replay by the config (config/model.py ``check_context_parallel``), MoE models by the layout check, which
reads the model's config (parallel/layout.py). No process is started."""

from __future__ import annotations

import pytest

from pacs_megatron.config import ConfigError, ParallelConfig, load_config
from pacs_megatron.config.model import check_context_parallel
from pacs_megatron.parallel import check_layout

GAE = ["algorithm.loss=ppo", "algorithm.policy.adv_estimator=gae"]
MOE = {"model_type": "qwen3_moe", "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2}


def test_the_critic_and_routing_replay_are_refused_at_cp_2():
    with pytest.raises(ConfigError, match=r"parallel.cp=2 with a learned critic .*: set parallel.cp=1"):
        check_context_parallel(ParallelConfig(cp=2), critic=True, routing_replay="none")
    with pytest.raises(ConfigError, match=r"actor.routing_replay=rollout with parallel.cp=2: .*MoE"):
        check_context_parallel(ParallelConfig(cp=2), critic=False, routing_replay="rollout")
    check_context_parallel(ParallelConfig(cp=1), critic=True, routing_replay="rollout")
    check_context_parallel(ParallelConfig(cp=2), critic=False, routing_replay="none")


def test_a_moe_model_gets_the_layout_line_at_cp_2():
    """Routing replay needs a MoE model, which the layout check refuses at cp > 1 whatever the config says."""
    with pytest.raises(ConfigError, match="parallel.cp=2 with a MoE model .* set parallel.cp=1"):
        check_layout(ParallelConfig(cp=2), {**MOE, "num_experts": 4}, world_size=2)


def test_construction_refuses_the_critic_and_routing_replay_at_cp_2():
    for overrides, line in ((GAE, "learned critic"), (["actor.routing_replay=rollout"], "routing replay is for MoE")):
        try:
            load_config(None, ["parallel.cp=2", *overrides])
        except ConfigError as e:
            assert line in str(e), e
        else:
            raise AssertionError(f"{overrides} at parallel.cp=2 was accepted")
    load_config(None, ["parallel.cp=1", *GAE])
