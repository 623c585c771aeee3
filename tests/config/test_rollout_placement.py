"""rollout.placement / max_staleness / engines (issue 31): one line naming the key and the fix."""

from __future__ import annotations

import pytest

from pacs_megatron.config import ConfigError, load_config


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["rollout.max_staleness=1"], "rollout.max_staleness=1 needs rollout.placement=separate"),
        (["rollout.placement=apart"], "rollout.placement='apart' is not valid"),
        (["rollout.placement=separate", "rollout.max_staleness=-1"], "rollout.max_staleness=-1 must be >= 0"),
        (["rollout.placement=separate", "rollout.engines=0"], "rollout.engines=0 must be > 0"),
        (
            ["rollout.placement=separate", "rollout.engine=vllm", "rollout.vllm.tensor_parallel_size=2"],
            "set rollout.vllm.tensor_parallel_size=1 and raise rollout.engines",
        ),
        (  # dynamic sampling draws more rounds per step; the pipeline samples fixed batches ahead
            ["rollout.placement=separate", "algorithm.filter_groups=mixed"],
            "algorithm.filter_groups=mixed with rollout.placement=separate: .* set algorithm.filter_groups=none",
        ),
        (
            ["rollout.placement=separate", "rollout.max_staleness=1", "algorithm.filter_groups=mixed"],
            "cannot draw more generation rounds",
        ),
    ],
)
def test_bad_placement_settings_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_defaults_are_the_synchronous_colocated_loop():
    r = load_config(None, []).rollout
    assert (r.placement, r.max_staleness, r.engines) == ("colocated", 0, 1)
    sep = load_config(None, ["rollout.placement=separate", "rollout.max_staleness=2", "rollout.engines=3"]).rollout
    assert (sep.placement, sep.max_staleness, sep.engines) == ("separate", 2, 3)


def test_separate_engines_need_their_own_gpus(monkeypatch):
    """launch/checks/preflight.check_engine_gpus (the GPU branch, exercised here with a faked device count)."""
    import torch

    from pacs_megatron.launch.checks.preflight import check_engine_gpus

    for k in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    cfg = load_config(None, ["parallel.tp=4", "rollout.placement=separate", "rollout.engines=2"])
    check_engine_gpus(cfg)  # CPU: nothing to check
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 5)
    with pytest.raises(ConfigError, match=r"parallel.world_size=4 \+ rollout.engines=2 = 6, this machine has 5"):
        check_engine_gpus(cfg)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 6)
    check_engine_gpus(cfg)


def test_staleness_without_correction_is_warned_once_by_the_launcher(monkeypatch, caplog):
    from pacs_megatron.launch.checks.preflight import warn_uncorrected_staleness

    monkeypatch.delenv("PACS_LAUNCHER_KIND", raising=False)
    stale = ["rollout.placement=separate", "rollout.max_staleness=2"]
    with caplog.at_level("WARNING", logger="pacs_megatron"):
        warn_uncorrected_staleness(load_config(None, stale))
        warn_uncorrected_staleness(load_config(None, [*stale, "algorithm.rollout_correction=tis"]))
        monkeypatch.setenv("PACS_LAUNCHER_KIND", "local")  # a rank of the local launcher: its parent warned
        warn_uncorrected_staleness(load_config(None, stale))
    warned = [r.getMessage() for r in caplog.records if "rollout_correction=none" in r.getMessage()]
    assert len(warned) == 1 and "up to 2 policy versions old" in warned[0]
