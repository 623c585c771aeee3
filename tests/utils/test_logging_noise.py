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
