"""Reward functions: math-verify equivalence table, exact match, and the dotted-path contract."""

import pytest

from pacs_megatron.reward import REWARDS, RewardFunctionError, arith_reward, load_reward_fn, math_reward
from pacs_megatron.reward.verifiers import boxed_math_reward, last_boxed

# (response, ground truth, expected) -- chosen to pin the behaviour PACS's reward relies on.
MATH_TABLE = [
    ("The answer is \\boxed{\\frac{1}{2}}", "0.5", 1.0),  # fraction vs decimal
    ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("\\boxed{\\dfrac{3}{4}}", "\\frac34", 1.0),
    ("\\boxed{\\frac{1}{3}}", "0.333", 0.0),  # rounded decimal is not the fraction
    ("so \\boxed{\\boxed{7}}", "7", 1.0),  # nested boxes
    ("The total is \\boxed{1,080}", "1,080", 1.0),  # GSM8K thousands separator
    ("The total is \\boxed{1080}", "1,080", 1.0),
    ("\\boxed{1080}", "1080", 1.0),
    ("\\boxed{1079}", "1,080", 0.0),
    ("\\boxed{(2, 5]}", "(2,5]", 1.0),  # intervals: same
    ("\\boxed{[2, 5]}", "(2,5]", 0.0),  # different closedness
    ("\\boxed{(-\\infty, 3)}", "(-\\infty,3)", 1.0),
    ("I think it's 42", "42", 1.0),  # no box: plain expression extraction
    ("42", "42", 1.0),  # plain number
    ("no answer here", "42", 0.0),
    ("\\boxed{41}", "42", 0.0),
    ("\\boxed{\\sqrt{2}/2}", "\\frac{\\sqrt{2}}{2}", 1.0),
    ("\\boxed{x^2+2x+1}", "(x+1)^2", 1.0),  # symbolic
    ("\\boxed{2}", "", 0.0),  # unparsable gold: scored 0, never raised
]


@pytest.mark.parametrize(("response", "gold", "expected"), MATH_TABLE)
def test_math_reward_table(response, gold, expected):
    assert math_reward(response, gold) == expected


# (response, ground truth, math, math_boxed): the lenient reward evaluates a restated problem.
BOXED_TABLE = [
    ("1 + 4", "5", 1.0, 0.0),  # the restated problem: math-verify computes it
    ("\\boxed{1 + 4}", "5", 1.0, 0.0),  # a boxed expression for a plain-number answer
    ("The answer is 5.", "5", 1.0, 0.0),  # no box, no reward
    ("so \\boxed{5}.", "5", 1.0, 1.0),
    ("\\boxed{5} no, \\boxed{6}", "5", 0.0, 0.0),  # the last box counts
    ("\\boxed{$5.0$}", "5", 1.0, 1.0),  # still math-verify's equivalence
    ("\\boxed{1,080}", "1080", 1.0, 1.0),  # thousands separator inside the box
    ("\\boxed{\\frac{1}{2}}", "\\frac12", 1.0, 1.0),  # a non-number answer: any form math-verify equates
    ("\\boxed{}", "5", 0.0, 0.0),
    ("\\boxed{5", "5", 0.0, 0.0),  # unclosed box
]


@pytest.mark.parametrize(("response", "gold", "lenient", "strict"), BOXED_TABLE)
def test_boxed_math_reward_table(response, gold, lenient, strict):
    assert (math_reward(response, gold), boxed_math_reward(response, gold)) == (lenient, strict)


def test_last_boxed_balances_braces():
    assert last_boxed("a \\boxed{\\frac{1}{2}} b") == "\\frac{1}{2}"
    assert last_boxed("\\boxed{1} \\boxed{2}") == "2" and last_boxed("\\boxed{{x}") is None


def test_arith_exact_match():
    assert arith_reward("8", "8") == 1.0
    assert arith_reward(" 8\n", "8") == 1.0
    assert arith_reward("08", "8") == 0.0
    assert arith_reward("8 8", "8") == 0.0
    assert arith_reward("", "8") == 0.0


def test_builtins_live_in_the_registry_with_the_common_signature():
    assert set(REWARDS) == {"math", "math_boxed", "arith"}
    assert load_reward_fn("math_boxed")("q", "1 + 2", "3", None) == 0.0
    assert load_reward_fn("math")("q", "\\boxed{3}", "3", None) == 1.0
    assert load_reward_fn("arith")("1+2=", "3", "3", {"id": "x"}) == 1.0


def test_user_function_by_dotted_path():
    fn = load_reward_fn("reward_user_fns:exact")
    assert fn("p", "a", "a", None) == 1.0
    assert fn("p", "a", "b", {"bonus": 0.5}) == 0.5


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ("no_such_module_xyz:fn", "not found"),
        ("reward_user_fns:missing", "no attribute 'missing'"),
        ("reward_user_fns:NOT_CALLABLE", "not a function"),
        ("reward_user_fns:two_args", "cannot take (prompt, response, ground_truth, extra)"),
        ("reward_user_fns:", "package.module:function"),
        ("mathx", "neither a built-in"),
    ],
)
def test_bad_specs_raise_clear_errors(spec, needle):
    with pytest.raises(RewardFunctionError) as e:
        load_reward_fn(spec)
    assert needle in str(e.value)
    assert spec in str(e.value)
