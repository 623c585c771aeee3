"""When the supervised warm-up before RL stops (``trainer.sft_warmup_stop``): after ``trainer.sft_warmup_steps``
steps, or, for the tool warm-up, once the policy's calls parse and run on held-out prompts (loop/warmup.py)."""

from __future__ import annotations

from dataclasses import dataclass

from pacs_megatron.config.base import ConfigError, _choice, _positive

UNTIL = ("steps", "valid_calls")
"""The stopping rules: a fixed count, or the tool warm-up's measured criterion."""


@dataclass
class WarmupStopConfig:
    """The warm-up's stopping rule; ``trainer.sft_warmup_steps`` is its length ("steps") or its maximum."""

    until: str = "steps"
    """"steps": exactly trainer.sft_warmup_steps supervised steps (a fixed warm-up, reproduced bit for bit);
    "valid_calls" (the tool warm-up, rollout.multi_turn): stop at the first check whose valid-call rate is
    >= threshold, else after trainer.sft_warmup_steps steps with a warning. The lr schedule counts the maximum."""
    threshold: float = 0.8
    """Valid-call rate at which "valid_calls" stops, in (0, 1]: the share of held-out samples that call a tool
    and whose every call parses and runs. RL's reward is reachable only through a call that runs, so most
    samples must make one: at 0.8, 8 rollouts of a prompt hold ~6 that can earn reward."""
    check_every: int = 2
    """"valid_calls": measure after every this many steps (and after the last); a check samples
    held_out x samples trajectories with the engine, after a weight sync."""
    held_out: int = 8
    """"valid_calls": train prompts the check samples, drawn with their own RNG from those the warm-up does not
    train on (never the demonstrations; the RL prompt stream is untouched)."""
    samples: int = 4
    """"valid_calls": trajectories per held-out prompt, at the RL rollout's temperature and length."""

    def __post_init__(self) -> None:
        _choice("trainer.sft_warmup_stop.until", self.until, UNTIL)
        if not 0 < self.threshold <= 1:
            raise ConfigError(f"trainer.sft_warmup_stop.threshold={self.threshold} must be in (0, 1], e.g. 0.8")
        for key in ("check_every", "held_out", "samples"):
            _positive(f"trainer.sft_warmup_stop.{key}", getattr(self, key))


def check_warmup_stop(stop: WarmupStopConfig, warmup_steps: int, multi_turn: bool) -> None:
    """Run-level conditions of "valid_calls" (RunConfig calls it): one line naming the field and the fix."""
    if stop.until != "valid_calls":
        return
    if not multi_turn:
        raise ConfigError(
            "trainer.sft_warmup_stop.until=valid_calls measures the tool warm-up's calls: it needs "
            "rollout.multi_turn.max_turns >= 2 and tools.enabled; use trainer.sft_warmup_stop.until=steps"
        )
    if warmup_steps < 1:
        raise ConfigError(
            "trainer.sft_warmup_stop.until=valid_calls takes trainer.sft_warmup_steps as its maximum: set "
            "trainer.sft_warmup_steps > 0 (e.g. 30)"
        )
