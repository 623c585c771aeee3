"""bench/memory.py's ``sliced`` variant stands in for actor/forward.py's ``token_logprobs`` in the training pass:
it must take every argument the pass gives (the stand-in once lacked ``thd`` and ``rows`` and the variant failed
before measuring anything), and it refuses the two it cannot measure."""

from __future__ import annotations

import inspect

import pytest

from pacs_megatron.actor.forward import token_logprobs
from pacs_megatron.bench.memory import _sliced_token_logprobs


def test_the_sliced_stand_in_takes_what_the_training_pass_gives():
    assert list(inspect.signature(_sliced_token_logprobs).parameters) == list(
        inspect.signature(token_logprobs).parameters
    )
    with pytest.raises(ValueError, match="no thd, no rows"):
        _sliced_token_logprobs(None, None, None, None, 1.0, rows=object())
