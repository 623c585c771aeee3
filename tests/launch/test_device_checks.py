"""rollout.quant_recipe: on CPU only the recipes whose quantizer runs there are accepted and offered."""

from __future__ import annotations

import pytest

from pacs_megatron.config import ConfigError, load_config

pytest.importorskip("modelopt.torch.quantization")


def test_cpu_refuses_and_never_offers_recipes_that_need_cuda():
    cpu = ["rollout.quantization=fp8", "parallel.backend=gloo"]
    with pytest.raises(ConfigError, match=r"rollout.quant_recipe=MXFP8_DEFAULT_CFG cannot run on CPU .*CUDA") as e:
        load_config(None, [*cpu, "rollout.quant_recipe=MXFP8_DEFAULT_CFG"])
    assert "FP8_DEFAULT_CFG" in str(e.value).split("use one of")[1]
    with pytest.raises(ConfigError, match="is not a modelopt FP8 recipe") as e:
        load_config(None, [*cpu, "rollout.quant_recipe=NOPE"])
    assert "MXFP8" not in str(e.value) and "'FP8_DEFAULT_CFG'" in str(e.value)
    load_config(None, [*cpu, "rollout.quant_recipe=FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG"])  # runs on CPU: accepted
