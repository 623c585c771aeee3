"""Scoring a step's (or an evaluation's) rollouts, sharded over ranks: the one entry point that
training (``stages.collect_batch``) and evaluation (``eval.runner.evaluate``) share.

    scores, metrics = score_rollouts(scorer, prompts, responses, answers, extras, sharded=True, step=True)

``sharded``: each rank scores a contiguous share and the counters are summed over ranks, so every
rank returns the same scores and metrics (collective). ``step=True`` also feeds the step's totals
to the scorer's :class:`~pacs_megatron.reward.accounting.FailureGuard` (every rank sees the same
totals, so every rank stops together) and turns a batch abandoned on a stop signal into
:class:`~pacs_megatron.reward.accounting.RewardInterrupted` on every rank.
"""

from __future__ import annotations

from pacs_megatron.reward.accounting import RewardInterrupted
from pacs_megatron.utils.logging import get_logger

logger = get_logger(__name__)


def score_rollouts(
    scorer, prompts, responses, answers, extras, sharded: bool, step: bool = False
) -> tuple[list[float], dict[str, float]]:
    """Verifiable rewards of all rows and the summed counters (see the module docstring)."""
    if not sharded:
        scores, totals = scorer.score(prompts, responses, answers, extras)
        last_errors = [scorer.last_error]
    else:
        from pacs_megatron.utils.dist import map_sharded

        def part_scores(part):
            if not part:
                return []
            scores, metrics = scorer.score(*map(list, zip(*part)))
            return [(s, (metrics, scorer.last_error) if j == 0 else None) for j, s in enumerate(scores)]

        scored = map_sharded(list(zip(prompts, responses, answers, extras)), part_scores)
        totals, last_errors = {}, []
        for _, part in scored:
            if part is None:
                continue
            for k, v in part[0].items():
                totals[k] = totals.get(k, 0.0) + float(v)
            last_errors.append(part[1])
        scores = [s for s, _ in scored]
    if step:
        _check_step(scorer, len(responses), totals, next((e for e in reversed(last_errors) if e), ""))
    return scores, totals


def _check_step(scorer, total: int, totals: dict[str, float], last_error: str) -> None:
    if totals.get("reward/interrupted"):
        msg = (
            f"stopped by a signal while reward {scorer.cfg.fn} was still scoring (timing out on) this step; "
            "the step is not checkpointed: --resume auto restarts from the last checkpoint"
        )
        logger.warning("%s", msg)
        raise RewardInterrupted(msg)
    failed = totals.get("reward/errors", 0.0) + totals.get("reward/timeouts", 0.0)
    scorer.guard.update(total, int(failed), last_error)
