"""Third-party import noise (megatron's Apex/TE notices, modelopt's version notice, torch.distributed.checkpoint's
deprecations) is filtered once logging is set up, so an error or a command's output is not buried under it."""

from __future__ import annotations

import logging
import warnings

from pacs_megatron.utils.logging import init_logging


def test_import_noise_is_filtered_and_real_warnings_are_not():
    init_logging()
    noise = [
        ("Transformer Engine and Apex are not installed. Falling back to Torch optimizers.", UserWarning),
        ("Apex is not installed. Falling back to Torch Norm", UserWarning),
        ("transformers 5.19.0 is not tested with current version of modelopt and may cause issues", UserWarning),
        ("`load_state_dict` is deprecated and will be removed in future versions.", FutureWarning),
        ("Please use DTensor instead and we are deprecating ShardedTensor.", FutureWarning),
    ]
    with warnings.catch_warnings(record=True) as seen:
        real = ["a warning about the user's own run", "Using sequence parallel requires CUDA_DEVICE_MAX_CONNECTIONS=1"]
        for message, category in [*noise, *((m, UserWarning) for m in real)]:
            warnings.warn(message, category, stacklevel=1)
    assert [str(w.message) for w in seen] == real  # megatron's queue-count advice stays visible (docs/launch.md)
    triton = logging.getLogger("vllm.triton_utils.importing")
    record = logging.LogRecord(
        triton.name, logging.WARNING, "", 0, "Triton is installed, but doesn't include CPU backend.", None, None
    )
    assert not triton.filter(record)


def test_third_party_warnings_print_on_rank_0_only(monkeypatch):
    """Fails on the old code: torch's all_gather_into_tensor deprecation and megatron's CUDA_DEVICE_MAX_CONNECTIONS
    advice printed once per rank."""
    torch_warning = "`torch.distributed.all_gather_into_tensor` is deprecated."
    megatron_advice = "Using sequence parallel requires CUDA_DEVICE_MAX_CONNECTIONS=1"
    seen = {}
    for rank in ("0", "1"):
        monkeypatch.setenv("RANK", rank)
        monkeypatch.delenv("PACS_LOG_ALL_RANKS", raising=False)
        with warnings.catch_warnings(record=True) as caught:  # restores the filters init_logging adds
            warnings.simplefilter("always")
            init_logging()
            warnings.warn_explicit(torch_warning, FutureWarning, "c10d_logger.py", 83, "torch.distributed.c10d_logger")
            warnings.warn(megatron_advice, UserWarning, stacklevel=1)
            warnings.warn("the user's own warning", UserWarning, stacklevel=1)
        seen[rank] = [str(w.message) for w in caught]
    assert seen["0"] == [torch_warning, megatron_advice, "the user's own warning"]
    assert seen["1"] == ["the user's own warning"]
