"""Verifiable rewards: built-in verifiers, the name -> function registry, and the batch scorer.

from pacs_megatron.reward import RewardScorer, math_reward
math_reward("... \\boxed{1/2}", "0.5")                    # -> 1.0, any process
with RewardScorer(cfg.reward) as scorer:                 # worker processes, per-response timeouts
    scores, metrics = scorer.score(prompts, responses, answers)
score_rollouts(scorer, ..., sharded=True, step=True)      # over ranks; stops on failing steps
"""

from pacs_megatron.reward.accounting import RewardFailureError, RewardInterrupted
from pacs_megatron.reward.registry import REWARDS, RewardFunctionError, check_score, load_reward_fn
from pacs_megatron.reward.rollouts import score_rollouts
from pacs_megatron.reward.scorer import RewardScorer
from pacs_megatron.reward.verifiers import arith_reward, math_reward

__all__ = [
    "REWARDS",
    "RewardFailureError",
    "RewardFunctionError",
    "RewardInterrupted",
    "RewardScorer",
    "arith_reward",
    "check_score",
    "load_reward_fn",
    "math_reward",
    "score_rollouts",
]
