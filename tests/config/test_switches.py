"""The recipe switches' config: off by default and in every shipped recipe; bad values named with the fix."""

from pathlib import Path

import pytest

from pacs_megatron.config import ConfigError, load_config

CONFIGS = Path(__file__).resolve().parents[2] / "examples" / "configs"


def _off(cfg) -> bool:
    a = cfg.algorithm
    return (
        a.filter_groups == "none"
        and a.kl_loss_coef == 0
        and a.entropy_coeff == 0
        and a.overlong.buffer_len == 0
        and not a.overlong.mask_truncated
        # offloading the reference is a memory setting, for a run that has one (PACS v2's anchor)
        and (not cfg.actor.offload_reference or a.needs_reference)
    )


def test_off_by_default_and_in_every_shipped_recipe():
    assert _off(load_config())
    recipes = sorted(CONFIGS.glob("*.yaml"))
    assert len(recipes) >= 7
    for path in recipes:  # the PACS reference's scripts: use_kl_loss=False, entropy_coeff=0, no filtering
        assert _off(load_config(path)), path.name


@pytest.mark.parametrize(
    "override, words",
    [
        ("algorithm.filter_groups=std", "algorithm.filter_groups"),
        ("algorithm.max_gen_batches=0", "max_gen_batches=0 must be >= 1"),
        ("algorithm.gen_batch_size=-1", "algorithm.gen_batch_size"),
        ("algorithm.short_batch=skip", "algorithm.short_batch"),
        ("algorithm.kl_loss_type=full", "algorithm.kl_loss_type"),
        ("algorithm.kl_loss_coef=-1", "algorithm.kl_loss_coef"),
        ("algorithm.entropy_coeff=-0.1", "algorithm.entropy_coeff"),
        ("algorithm.overlong.penalty_factor=-1", "algorithm.overlong.penalty_factor"),
        ("algorithm.overlong.buffer_len=2048", "exceeds rollout.max_response_length=1024"),
    ],
)
def test_errors_name_the_field(override, words):
    with pytest.raises(ConfigError, match=words):
        load_config(None, ["algorithm.loss=grpo", override])


def test_pacs_refuses_a_shaped_reward_but_takes_the_rest():
    with pytest.raises(ConfigError, match="loss=pacs: .* use algorithm.overlong.mask_truncated=true"):
        load_config(None, ["algorithm.overlong.buffer_len=64"])
    on = ["algorithm.filter_groups=mixed", "algorithm.overlong.mask_truncated=true", "algorithm.kl_loss_coef=0.01"]
    cfg = load_config(None, on + ["algorithm.entropy_coeff=0.001", "algorithm.kl_loss_type=k3+"])
    assert cfg.algorithm.kl_loss_type == "k3+" and cfg.algorithm.overlong.mask_truncated
