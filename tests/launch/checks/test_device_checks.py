"""rollout.quant_recipe: on CPU only the recipes whose quantizer runs there are accepted and offered (the
preflight's device checks, launch/checks/device.py)."""

from __future__ import annotations

import pytest

from pacs_megatron.config import ConfigError, load_config
from pacs_megatron.launch.checks.device import check_device

pytest.importorskip("modelopt.torch.quantization")


def test_cpu_refuses_and_never_offers_recipes_that_need_cuda():
    cpu = ["rollout.quantization=fp8", "parallel.backend=gloo"]
    with pytest.raises(ConfigError, match=r"rollout.quant_recipe=MXFP8_DEFAULT_CFG cannot run on CPU .*CUDA") as e:
        check_device(load_config(None, [*cpu, "rollout.quant_recipe=MXFP8_DEFAULT_CFG"]))
    assert "FP8_DEFAULT_CFG" in str(e.value).split("use one of")[1]
    with pytest.raises(ConfigError, match="is not a modelopt FP8 recipe") as e:
        check_device(load_config(None, [*cpu, "rollout.quant_recipe=NOPE"]))
    assert "MXFP8" not in str(e.value) and "'FP8_DEFAULT_CFG'" in str(e.value)
    check_device(
        load_config(None, [*cpu, "rollout.quant_recipe=FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG"])
    )  # runs on CPU: accepted


def test_the_config_is_data_and_the_preflight_checks_the_device():
    """Building the config runs no device check (config/ is data); the launcher's preflight runs it."""
    from pacs_megatron.launch.checks.preflight import preflight

    cfg = load_config(None, ["rollout.quantization=nvfp4", "parallel.backend=gloo"])
    with pytest.raises(ConfigError, match="rollout.quantization=nvfp4 needs CUDA"):
        preflight(cfg)
