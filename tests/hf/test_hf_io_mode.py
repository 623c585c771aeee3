"""Exported weights are files like any other: their mode honours the umask (safetensors alone writes 0600)."""

from __future__ import annotations

import os
import stat

import torch

from pacs_megatron.hf.io import write_safetensors


def test_exported_safetensors_honour_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        for mask, mode in ((0o022, 0o644), (0o077, 0o600), (0o002, 0o664)):
            os.umask(mask)
            out = tmp_path / f"m{mask:o}"
            names = write_safetensors([("w", torch.zeros(4)), ("v", torch.ones(4))], out, max_shard_bytes=16)
            assert len(names) == 2  # sharded: every shard, not only the single-file case
            for name in names:
                assert stat.S_IMODE((out / name).stat().st_mode) == mode, (oct(mask), name)
    finally:
        os.umask(old)
