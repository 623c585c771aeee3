"""The supervised warm-up before RL (``trainer.sft_warmup_steps``): the CPU recipe's answer format, or the tool
call syntax. The tool warm-up stops after a fixed count or, with ``trainer.sft_warmup_stop.until=valid_calls``,
once the policy's calls parse and run on held-out prompts (:func:`run_until_valid`; docs/tools.md)."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pacs_megatron.batch.build import build_rollouts, dp_shard
from pacs_megatron.batch.rows import Rollouts, TrainBatch, TrainRows
from pacs_megatron.config import RunConfig
from pacs_megatron.rollout.types import Response, SamplingParams
from pacs_megatron.run.metrics import format_metrics
from pacs_megatron.utils.logging import get_logger

TOOL_DEMOS = 8
"""Tool-call demonstrations of the tool warm-up ("a handful": the syntax, not the task)."""
STOP_KEYS = ("sft/valid_call_rate", "sft/call_rate", "sft/call_error_rate", "sft/warmup_steps", "sft/warmup_reached")
"""What a "valid_calls" warm-up leaves in the run's step-0 row: its last check, its length and whether it reached
the threshold (1) or its maximum (0)."""
_HELD_OUT_SEED = 7_368_787
"""Mixed into trainer.seed (the held-out draw) and rollout.seed (the check's sampling): streams of their own."""

if TYPE_CHECKING:
    from pacs_megatron.data.records import PromptRecord
    from pacs_megatron.loop.runtime import Components, Runtime

logger = get_logger(__name__)


def format_warmup(cfg: RunConfig, rt: Runtime, c: Components) -> dict:
    """Supervised warm-up on (prompt, random digits + eos): teaches the answer *format*, never the
    answer nor its length (targets are drawn uniformly), so the RL run still starts at chance level.
    Prompts are drawn with their own RNG, so the RL prompt stream is untouched. With tool-integrated
    rollouts: :func:`tool_warmup`."""
    from pacs_megatron.data.synthetic import format_warmup_examples

    if cfg.rollout.multi_turn.enabled:
        return tool_warmup(cfg, rt, c)

    rng = random.Random(cfg.trainer.seed)
    rows = cfg.mini_batch_prompts * cfg.rollout.n
    last: dict = {}
    lengths = [len(r.answer) for r in c.dataset.records]
    for _ in range(cfg.trainer.sft_warmup_steps):
        picked = [rng.choice(c.dataset.records) for _ in range(rows)]
        pairs = format_warmup_examples(picked, rng, max(lengths), min(lengths))
        shard = dp_shard(
            build_rollouts([p for p, _ in pairs], [t for _, t in pairs], [0.0] * rows, 1, c.pad_id, 8),
            rt.groups.dp_rank,
            rt.groups.dp_size,
        )
        last = _sft_step(c, shard)
    return last


def _sft_step(c: Components, shard: Rollouts) -> dict:
    """One supervised optimizer step; its metrics, with the train step's ``actor/max_abs_logratio`` named for what
    it is here: ``sft/max_token_nll``. The old log-probs given are zeros, so ``max |logp - old|`` over response
    tokens is the largest NLL of one demonstration token (8.3 nats: a token at p ~ 2.6e-4, what the issue's bf16
    warm-up left, against 1.7 in fp32), not a policy ratio."""
    zeros = torch.zeros(shard.input_ids.shape)  # the sft loss reads no old log-probs and no advantages
    local = TrainBatch.of_rows(TrainRows.of(shard, advantages=zeros[:, 0]), old_logp=zeros, old_entropy=zeros)
    metrics = c.actor.train_step(local, loss_name="sft")
    if "actor/max_abs_logratio" in metrics:
        metrics["sft/max_token_nll"] = metrics.pop("actor/max_abs_logratio")
    return metrics


def tool_warmup(cfg: RunConfig, rt: Runtime, c: Components) -> dict:
    """Supervised warm-up on :data:`TOOL_DEMOS` tool-call demonstrations (rollout/multi_turn.py
    ``tool_demonstration``): the call syntax and reading the tool's answer. Each step is one optimizer step on
    the handful of demonstrations; their tool turns are context (off the loss), so the policy is
    never trained to write a problem's answer except by copying it from the tool's output in front of it."""
    from pacs_megatron.rollout.multi_turn import MultiTurnEngine, tool_demonstration

    if not isinstance(c.engine, MultiTurnEngine):  # the separate placement's turn loop runs in the engine processes
        raise ValueError("the tool warm-up needs the turn loop in the trainer (rollout.placement=colocated)")
    rng = random.Random(cfg.trainer.seed)
    records = rng.sample(c.dataset.records, min(TOOL_DEMOS, len(c.dataset.records)))
    demos = [tool_demonstration(c.engine, rec) for rec in records]
    # each demonstration once (repeated only to split over DP): copies would add compute, not signal, since a
    # step's loss is a mean (8 copies of 8 demonstrations: SmolLM2 ~2 min a warm-up step on 2 cores, now ~15 s)
    dp = rt.groups.dp_size
    rows = -(-len(demos) // dp) * dp
    picked = [demos[i % len(demos)] for i in range(rows)]
    batch = build_rollouts(
        [d[0] for d in picked],
        [d[1] for d in picked],
        [0.0] * rows,
        1,
        c.pad_id,
        8,
        policy_masks=[d[2] for d in picked],
    )
    shard = dp_shard(batch, rt.groups.dp_rank, rt.groups.dp_size)
    stop = cfg.trainer.sft_warmup_stop
    if stop.until == "valid_calls":
        rule = StopRule(stop.threshold, stop.check_every, cfg.trainer.sft_warmup_steps)
        return run_until_valid(rule, lambda: _sft_step(c, shard), ValidCallCheck(cfg, c, records))
    last: dict = {}
    for _ in range(cfg.trainer.sft_warmup_steps):
        last = _sft_step(c, shard)
    return last


def stop_record(metrics: dict) -> dict:
    """The :data:`STOP_KEYS` of a warm-up's metrics (none after a fixed-count warm-up): for the step-0 row."""
    return {k: metrics[k] for k in STOP_KEYS if k in metrics}


def valid_call_metrics(responses: Sequence[Response]) -> dict[str, float]:
    """A check's numbers over sampled trajectories, from the turn loop's own parse and sandbox run (TurnStats):
    ``sft/valid_call_rate`` (samples that made a call and whose every call parsed and ran; a sample without a
    call fails), ``sft/call_rate`` (samples with a call) and ``sft/call_error_rate`` (failed calls per call)."""
    stats = [r.turns for r in responses if r.turns is not None]
    if not stats:
        raise ValueError("the valid-call check needs multi-turn trajectories (rollout.multi_turn.max_turns >= 2)")
    calls = sum(s.tool_calls for s in stats)
    return {
        "sft/valid_call_rate": sum(s.tool_calls > 0 and s.tool_errors == 0 for s in stats) / len(stats),
        "sft/call_rate": sum(s.tool_calls > 0 for s in stats) / len(stats),
        "sft/call_error_rate": sum(s.tool_errors for s in stats) / max(calls, 1),
    }


@dataclass(frozen=True)
class StopRule:
    """``trainer.sft_warmup_stop.until=valid_calls`` over at most ``max_steps`` steps."""

    threshold: float
    check_every: int
    max_steps: int

    def due(self, step: int) -> bool:
        """Whether a check follows step ``step`` (1-based): every ``check_every`` steps, and the last step."""
        return step % self.check_every == 0 or step >= self.max_steps

    def verdict(self, step: int, rate: float) -> str | None:
        """After a check: "threshold" (reached), "max" (the last step, below it), or None (train on)."""
        if rate >= self.threshold:
            return "threshold"
        return "max" if step >= self.max_steps else None


def run_until_valid(rule: StopRule, train_step: Callable[[], dict], check: Callable[[int], dict]) -> dict:
    """Train a step at a time, check when due, stop on the rule's verdict: one log line per check, one that says
    why it stopped (a warning, the only one, when the maximum came first). ``check`` is collective and returns
    the same numbers on every rank, so every rank stops at the same step. The last step's metrics, the last
    check's and ``sft/warmup_steps`` / ``sft/warmup_reached``."""
    last: dict = {}
    for step in range(1, rule.max_steps + 1):
        last = train_step()
        if not rule.due(step):
            continue
        checked = check(step)
        rate = checked["sft/valid_call_rate"]
        logger.info("tool warm-up check at step %d: %s", step, format_metrics({**_loss(last), **checked}))
        verdict = rule.verdict(step, rate)
        if verdict is None:
            continue
        if verdict == "threshold":
            logger.info(
                "tool warm-up stopped at step %d of at most %d: threshold reached, valid-call rate %.3f >= "
                "trainer.sft_warmup_stop.threshold=%g",
                step,
                rule.max_steps,
                rate,
                rule.threshold,
            )
        else:
            logger.warning(
                "tool warm-up stopped at step %d: max steps reached (trainer.sft_warmup_steps) with valid-call rate "
                "%.3f < trainer.sft_warmup_stop.threshold=%g; RL starts from a policy whose calls often fail, so "
                "reward is often out of reach: raise trainer.sft_warmup_steps (or the lr) to reach it",
                step,
                rate,
                rule.threshold,
            )
        return {**last, **checked, "sft/warmup_steps": float(step), "sft/warmup_reached": float(verdict == "threshold")}
    raise ValueError(f"the warm-up's maximum is {rule.max_steps} steps: it must be >= 1 (trainer.sft_warmup_steps)")


def _loss(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if k == "sft/loss"}


class ValidCallCheck:
    """Samples the policy just trained on held-out train prompts through the run's turn loop (its call parser,
    its sandbox): ``trainer.sft_warmup_stop.held_out`` prompts, ``samples`` each, at the RL rollout's settings."""

    def __init__(self, cfg: RunConfig, c: Components, demos: Sequence[PromptRecord]) -> None:
        stop = cfg.trainer.sft_warmup_stop
        taken = {(r.source, r.id) for r in demos}
        pool = [r for r in c.dataset.records if (r.source, r.id) not in taken]
        if len(pool) < stop.held_out:
            raise ValueError(
                f"trainer.sft_warmup_stop.held_out={stop.held_out}: the train set has {len(pool)} problems besides "
                f"the {len(taken)} demonstrations; lower it to <= {len(pool)}"
            )
        self.c = c
        self.records = random.Random(cfg.trainer.seed + _HELD_OUT_SEED).sample(pool, stop.held_out)
        # what RL will sample with, n and seed its own
        self.sampling = SamplingParams.of_rollout(cfg.rollout, n=stop.samples, seed=cfg.rollout.seed + _HELD_OUT_SEED)

    def __call__(self, step: int) -> dict:
        """Collective: sync the actor's weights into the engine (verified), sample, and put the engine back to
        sleep while the actor trains; rank 0's numbers, on every rank."""
        from pacs_megatron.utils.dist import all_gather_objects

        self.c.sync.sync(version=0)
        groups = self.c.engine.generate_step([r.prompt_ids for r in self.records], self.sampling, step)
        self.c.engine.sleep()
        # every rank gathered the same trajectories; rank 0's numbers decide, so no rounding can split the ranks
        return all_gather_objects(valid_call_metrics([r for g in groups for r in g]))[0]
