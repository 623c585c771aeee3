"""Config loading: YAML + overrides, validation errors that name the key and the fix."""

from pathlib import Path

import pytest

from pacs_megatron.config import ConfigError, RunConfig, load_config, to_yaml


def test_defaults_are_valid_and_roundtrip(tmp_path):
    cfg = load_config()
    assert isinstance(cfg, RunConfig)
    f = tmp_path / "c.yaml"
    f.write_text(to_yaml(cfg))
    assert load_config(f) == cfg


def test_yaml_then_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("rollout:\n  n: 4\nalgorithm:\n  micro_batch_size: 8\n  pacs:\n    beta: 2.0\n")
    cfg = load_config(f, ["algorithm.pacs.beta=1.5", "trainer.total_steps=3"])
    assert cfg.rollout.n == 4 and cfg.algorithm.pacs.beta == 1.5 and cfg.trainer.total_steps == 3


@pytest.mark.parametrize(
    "override, words",
    [
        ("algorithm.micro_batch_size=12", ["algorithm.micro_batch_size", "multiple of 8"]),
        ("algorithm.pacs.beta=0", ["algorithm.pacs.beta"]),
        ("rollout.engine=sglang", ["rollout.engine", "hf"]),
        ("rollout.n=many", ["rollout.n"]),
        ("trainer.nonsense=1", ["nonsense"]),
        ("algorithm.mini_batch_size=5", ["mini_batch_size", "train_batch_size"]),
        ("parallel.vpp=2", ["parallel.vpp", "pp"]),
        ("model.path=", ["model.path"]),
        ("trainer.val_k=[1,16]", ["trainer.val_k"]),
        ("sync.probe_greedy_tolerance=0", ["sync.probe_greedy_tolerance", "-1"]),
    ],
)
def test_errors_name_the_field(override, words):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    for w in words:
        assert w in str(e.value)


def test_tp_must_divide_tiny_heads():
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        load_config(None, ["model.init=tiny", "parallel.tp=4"])


def test_missing_file_and_bad_override():
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("/nope.yaml")
    with pytest.raises(ConfigError, match="a.b.c=value"):
        load_config(None, ["trainer.total_steps"])


def test_base_chain(tmp_path):
    (tmp_path / "base.yaml").write_text("rollout:\n  n: 4\nalgorithm:\n  micro_batch_size: 4\n  loss: pacs\n")
    (tmp_path / "child.yaml").write_text("base: base.yaml\nalgorithm:\n  loss: grpo\n")
    cfg = load_config(tmp_path / "child.yaml")
    assert (cfg.rollout.n, cfg.algorithm.loss, cfg.algorithm.micro_batch_size) == (4, "grpo", 4)
    (tmp_path / "loop.yaml").write_text("base: loop.yaml\n")
    with pytest.raises(ConfigError, match="cycle"):
        load_config(tmp_path / "loop.yaml")


@pytest.mark.parametrize("truncation", ["rollout.top_p=0.9", "rollout.top_k=20"])
def test_rollout_correction_refuses_truncated_sampling(truncation):
    """The engines report log-probs of the distribution they sample from (top-k / top-p renormalised);
    the actor scores the untruncated one, so tis / mis weights would correct the truncation itself."""
    for correction in ("tis", "mis"):
        with pytest.raises(ConfigError) as e:
            load_config(None, [f"algorithm.rollout_correction={correction}", truncation])
        assert "algorithm.rollout_correction" in str(e.value) and truncation.split("=")[0] in str(e.value)
    assert load_config(None, [truncation]).rollout.top_k in (-1, 20)  # without a correction: allowed
    assert load_config(None, ["algorithm.rollout_correction=tis", "rollout.top_k=-1", "rollout.top_p=1.0"])


@pytest.mark.parametrize(
    "overrides",
    [
        ["rollout.n=1", "algorithm.pacs.adv_estimator=naive"],  # issue 29: the fix led to a second error
        ["algorithm.micro_batch_size=7"],
        ["algorithm.micro_batch_size=48"],
        ["rollout.n=3", "algorithm.micro_batch_size=80"],
        ["algorithm.logprob_micro_batch_size=24"],
        ["parallel.dp=2", "algorithm.micro_batch_size=160"],
        ["critic.micro_batch_size=5"],
    ],
)
def test_a_batch_size_error_offers_a_fix_that_works(overrides):
    """Every micro-batch error says "set KEY=VALUE" with a value that loads as it stands (cpu_tiny: n=16,
    mini-batches of 10 prompts), and calls the size a number of sequences, as the docstrings do."""
    import re

    config = Path(__file__).resolve().parents[1] / "examples" / "configs" / "cpu_tiny.yaml"
    with pytest.raises(ConfigError) as e:
        load_config(config, overrides)
    fix = re.search(r"set (\S+=\d+)$", str(e.value))
    assert fix and "sequences" in str(e.value), str(e.value)
    load_config(config, [*overrides, fix.group(1)])


def test_rloo_with_one_response_is_named_before_any_batch_size():
    with pytest.raises(ConfigError, match=r"^rollout.n=1 with algorithm.pacs.adv_estimator=rloo"):
        load_config(Path(__file__).resolve().parents[1] / "examples" / "configs" / "cpu_tiny.yaml", ["rollout.n=1"])
