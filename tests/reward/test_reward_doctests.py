"""The examples in the reward modules' docstrings run (the built-ins' doctests are their spec)."""

import doctest

import pytest

import pacs_megatron.reward.accounting
import pacs_megatron.reward.registry
import pacs_megatron.reward.scorer
import pacs_megatron.reward.verifiers


@pytest.mark.parametrize(
    "module",
    [
        pacs_megatron.reward.accounting,
        pacs_megatron.reward.registry,
        pacs_megatron.reward.scorer,
        pacs_megatron.reward.verifiers,
    ],
)
@pytest.mark.subprocess
def test_doctests(module):
    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0
