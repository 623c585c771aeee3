"""The kernel's % of the HBM floor uses the card's own peak (an H200 was graded against H100's 3.35 TB/s and
read "119 %" on 2026-11-26)."""

import pytest

from pacs_megatron.bench.logprob import hbm_peak_tbps


@pytest.mark.parametrize(
    ("name", "tbps"),
    [
        ("NVIDIA H200", 4.8),
        ("NVIDIA H100 80GB HBM3", 3.35),
        ("NVIDIA H100 PCIe", 2.0),
        ("NVIDIA H100 NVL", 3.9),
        ("NVIDIA A100-SXM4-80GB", 2.039),
        ("NVIDIA A100-SXM4-40GB", 1.555),
        ("NVIDIA A100 80GB PCIe", 1.935),
    ],
)
def test_peak_from_the_device_name(name, tbps):
    assert hbm_peak_tbps(name) == tbps


def test_unknown_or_ambiguous_card_has_no_floor():
    assert hbm_peak_tbps("NVIDIA GeForce RTX 4090") is None
    assert hbm_peak_tbps("NVIDIA GH200 480GB") is None  # not the H200's 4.8: two memory types
