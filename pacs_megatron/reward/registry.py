"""Reward functions by name: built-ins next to user functions loaded by dotted path.

Every reward has one signature, ``fn(prompt, response, ground_truth, extra) -> float`` (``extra`` is
the record's metadata dict or None). ``reward.fn`` names one:

- ``"math"``: math-verify equivalence of the response's final answer (PACS's reward);
- ``"math_boxed"``: the same on the last ``\\boxed{}`` only, a plain number boxed as a plain number
  (verl's and DeepScaleR's rule: no box, no reward);
- ``"arith"``: exact match of the synthetic task;
- ``"package.module:function"``: any importable function with that signature.

Loading checks everything that can be checked before the first call (module, attribute, callable,
arity) and raises :class:`RewardFunctionError` naming the spec and the fix; the return type is
checked on every call by :func:`check_score`.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any

from pacs_megatron.reward.verifiers import arith_reward, boxed_math_reward, math_reward
from pacs_megatron.utils.specs import load_callable

RewardFn = Callable[[str, str, str, Any], float]


class RewardFunctionError(ValueError):
    """A reward function cannot be loaded, or broke its contract (returned a non-number)."""


def math_score(prompt: str, response: str, ground_truth: str, extra: Any = None) -> float:
    """Registry form of :func:`~pacs_megatron.reward.verifiers.math_reward` (the prompt is unused).

    Example:
        >>> math_score("What is 1+1?", "1 + 1 = \\\\boxed{2}", "2", None)
        1.0
    """
    return math_reward(response, ground_truth)


def math_boxed_score(prompt: str, response: str, ground_truth: str, extra: Any = None) -> float:
    """Registry form of :func:`~pacs_megatron.reward.verifiers.boxed_math_reward` (the prompt is unused).

    Example:
        >>> math_boxed_score("1+1?", "1 + 1 = \\\\boxed{2}", "2", None), math_boxed_score("", "1 + 1", "2", None)
        (1.0, 0.0)
    """
    return boxed_math_reward(response, ground_truth)


def arith_score(prompt: str, response: str, ground_truth: str, extra: Any = None) -> float:
    """Registry form of :func:`~pacs_megatron.reward.verifiers.arith_reward`.

    Example:
        >>> arith_score("3+5=", "8", "8", None), arith_score("3+5=", "8 9", "8", None)
        (1.0, 0.0)
    """
    return arith_reward(response, ground_truth)


REWARDS: dict[str, RewardFn] = {"math": math_score, "math_boxed": math_boxed_score, "arith": arith_score}
"""Built-in rewards by name."""


def load_reward_fn(spec: str) -> RewardFn:
    """The function ``spec`` names: a key of :data:`REWARDS` or ``"package.module:function"``.

    Example:
        >>> load_reward_fn("arith")("1+1=", "2", "2", None)
        1.0
        >>> load_reward_fn("pacs_megatron.reward.registry:arith_score") is arith_score
        True
    """
    where = f"reward.fn={spec!r}"
    sample = ["prompt", "response", "ground_truth", None]
    return load_callable(spec, REWARDS, where, RewardFunctionError, sample, "(prompt, response, ground_truth, extra)")


def check_score(spec: str, value: Any) -> float:
    """``value`` as a float, or :class:`RewardFunctionError` if a reward returned a non-number.

    Example:
        >>> check_score("arith", True), check_score("arith", 0)
        (1.0, 0.0)
    """
    if isinstance(value, numbers.Real):
        return float(value)
    raise RewardFunctionError(
        f"reward.fn={spec!r} returned {type(value).__name__} {value!r}: it must return a float (e.g. 1.0 or 0.0)"
    )
