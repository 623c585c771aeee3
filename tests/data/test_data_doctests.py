"""The examples in the data modules' docstrings run."""

import doctest

import pytest

import pacs_megatron.data.prompts
import pacs_megatron.data.records
import pacs_megatron.data.sampler
import pacs_megatron.data.sources
import pacs_megatron.data.synthetic


@pytest.mark.parametrize(
    "module",
    [
        pacs_megatron.data.prompts,
        pacs_megatron.data.records,
        pacs_megatron.data.sampler,
        pacs_megatron.data.sources,
        pacs_megatron.data.synthetic,
    ],
)
def test_doctests(module):
    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0
