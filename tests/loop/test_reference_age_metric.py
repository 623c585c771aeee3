"""reference/age: the age of the reference each step's update was measured against (the K table's column)."""

from types import SimpleNamespace

import pytest

from pacs_megatron.config import load_config
from pacs_megatron.loop.update_stages import reset_reference


class _Actor:
    def __init__(self):
        self.reference = SimpleNamespace(reset_step=0)
        self.resets = 0

    def reset_reference(self):
        self.resets += 1


@pytest.mark.parametrize(
    "every, ages, resets",
    [
        (3, [0, 1, 2, 0, 1, 2, 0], [0, 0, 1, 0, 0, 1, 0]),  # step 1's reference is pi_old: age 0
        (1, [0] * 7, [1] * 7),  # reset after every step: every update is measured against pi_old
        (0, [0, 1, 2, 3, 4, 5, 6], [0] * 7),  # never reset: the reference ages with the run
    ],
)
def test_age_is_the_reference_the_step_used(every, ages, resets):
    cfg = load_config(None, ["algorithm.pacs.anchor=reference", f"algorithm.reference_reset_every={every}"])
    actor = _Actor()
    rows = [reset_reference(cfg, actor, step) for step in range(1, 8)]
    assert [r["reference/age"] for r in rows] == ages
    assert [r["reference/reset"] for r in rows] == resets
    assert actor.resets == sum(resets)


def test_no_reference_no_rows():
    actor = _Actor()
    actor.reference = None
    assert reset_reference(load_config(None, []), actor, 1) == {}
