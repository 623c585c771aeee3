"""Built-in verifiable rewards: plain functions returning 1.0 or 0.0.

``math_reward`` is the PACS reference scorer (ritzz-ai/PACS ``src/reward_function.py``): the gold
answer is wrapped in ``\\boxed{}`` and parsed as LaTeX; the response is parsed as a plain expression or
LaTeX (its last ``\\boxed{}`` first); math-verify decides equivalence (numbers, fractions, sets,
intervals, symbolic). math-verify guards its parsers with ``signal.alarm``: call it from a process's
main thread (the scorer runs it in worker processes); in a thread its timeouts fail and the parse
returns nothing, which scores 0.

``arith_reward`` is the synthetic task's exact match: no parsing, no timeouts.
"""

from __future__ import annotations

import functools
import logging

from pacs_megatron.utils.logging import get_logger

logger = get_logger(__name__)


@functools.lru_cache(maxsize=1)
def _math_metric():
    from math_verify.metric import math_metric
    from math_verify.parser import ExprExtractionConfig, LatexExtractionConfig

    # math-verify warns for every response without an extractable answer (common early in RL).
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    return math_metric(
        gold_extraction_target=(LatexExtractionConfig(),),
        pred_extraction_target=(ExprExtractionConfig(), LatexExtractionConfig()),
    )


def math_reward(response: str, ground_truth: str) -> float:
    """1.0 if ``response``'s final answer equals ``ground_truth`` by math-verify, else 0.0.

    Any failure inside math-verify (unparsable gold, its own timeouts) scores 0.0, as in PACS.

    Example:
        >>> math_reward("so the answer is \\\\boxed{\\\\frac{1}{2}}", "0.5")
        1.0
        >>> math_reward("\\\\boxed{3}", "4")
        0.0
    """
    from math_verify.errors import TimeoutException  # a BaseException: `except Exception` misses it

    try:
        score, _ = _math_metric()(["\\boxed{" + ground_truth + "}"], [response])
    except (Exception, TimeoutException) as e:  # noqa: BLE001 - the reference scores every failure as 0
        logger.debug("math-verify failed on gold %r: %s", ground_truth, e)
        return 0.0
    return float(score)


def has_boxed(response: str) -> bool:
    """Whether ``response`` states an answer the way the PACS instruction asks: a non-empty ``\\boxed{...}``
    (math_reward also accepts a bare final number, so a right answer is not necessarily a boxed one).

    Example:
        >>> has_boxed("so \\\\boxed{7}."), has_boxed("the answer is 7"), has_boxed("\\\\boxed{}")
        (True, False, False)
    """
    start = response.rfind("\\boxed{")
    return start >= 0 and response.find("}", start) > start + len("\\boxed{")


def arith_reward(response: str, ground_truth: str) -> float:
    """Exact match of the synthetic task: the stripped response equals the answer string.

    Example:
        >>> arith_reward(" 7", "7"), arith_reward("17", "7")
        (1.0, 0.0)
    """
    return 1.0 if response.strip() == ground_truth else 0.0
