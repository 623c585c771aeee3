"""Built-in verifiable rewards: plain functions returning 1.0 or 0.0.

``math_reward`` is the PACS reference scorer (ritzz-ai/PACS ``src/reward_function.py``): the gold
answer is wrapped in ``\\boxed{}`` and parsed as LaTeX; the response is parsed as a plain expression or
LaTeX (its last ``\\boxed{}`` first); math-verify decides equivalence (numbers, fractions, sets,
intervals, symbolic). math-verify guards its parsers with ``signal.alarm``: call it from a process's
main thread (the scorer runs it in worker processes); in a thread its timeouts fail and the parse
returns nothing, which scores 0.

``boxed_math_reward`` is the strict form (only the last ``\\boxed{}`` counts, a number boxed as a
number), for tasks where the lenient parse is gamed; ``arith_reward`` is the synthetic task's exact
match: no parsing, no timeouts.
"""

from __future__ import annotations

import functools
import logging
import re

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


def last_boxed(response: str) -> str | None:
    """The content of the last ``\\boxed{...}`` in ``response`` (braces balanced), or None.

    Example:
        >>> last_boxed("a \\\\boxed{1}, \\\\boxed{\\\\frac{1}{2}}."), last_boxed("no box"), last_boxed("\\\\boxed{2")
        ('\\\\frac{1}{2}', None, None)
    """
    start = response.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    while i < len(response):
        depth += {"{": 1, "}": -1}.get(response[i], 0)
        if depth == 0:
            return response[start + len("\\boxed{") : i]
        i += 1
    return None


def has_boxed(response: str) -> bool:
    """Whether ``response`` states an answer the way the PACS instruction asks: a non-empty last
    ``\\boxed{...}`` (math_reward also accepts a bare final number, so a right answer is not necessarily
    a boxed one).

    Example:
        >>> has_boxed("so \\\\boxed{7}."), has_boxed("the answer is 7"), has_boxed("\\\\boxed{}")
        (True, False, False)
    """
    content = last_boxed(response)
    return bool(content and content.strip())


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def _plain_number(text: str) -> bool:
    return bool(_NUMBER.fullmatch(re.sub(r"[\s$,]|\\[,!; ]", "", text)))


def boxed_math_reward(response: str, ground_truth: str) -> float:
    """:func:`math_reward` of the last ``\\boxed{}`` only: a response without one scores 0 (the rule of
    verl's and DeepScaleR's math rewards), and a plain-number answer must be boxed as a plain number.

    Why stricter than PACS's reward: math-verify evaluates arithmetic, so for "What is 1 + 4?" the
    lenient reward scores a response that merely restates "1 + 4" (or boxes it) as right; a policy
    learns that in a few steps. Equivalence is still math-verify's ("5.0" = "5", "1,080" = "1080").

    Example:
        >>> [boxed_math_reward(r, "5") for r in ("so \\\\boxed{5}", "1 + 4 = 5", "\\\\boxed{1 + 4}", "\\\\boxed{5.0}")]
        [1.0, 0.0, 0.0, 1.0]
    """
    content = last_boxed(response)
    if content is None or not content.strip():
        return 0.0
    if _plain_number(ground_truth) and not _plain_number(content):
        return 0.0
    return math_reward("\\boxed{" + content + "}", ground_truth)


def arith_reward(response: str, ground_truth: str) -> float:
    """Exact match of the synthetic task: the stripped response equals the answer string.

    Example:
        >>> arith_reward(" 7", "7"), arith_reward("17", "7")
        (1.0, 0.0)
    """
    return 1.0 if response.strip() == ground_truth else 0.0
