"""Multi-turn, tool-integrated rollouts (``rollout.multi_turn``): the turn loop's limits and the call format.
The tools themselves and their sandbox are ``tools:`` (config/tools.py)."""

from __future__ import annotations

from dataclasses import dataclass

from pacs_megatron.config.base import ConfigError, _choice, _positive

FORMATS = ("hermes",)
"""Tool-call formats the turn loop parses (rollout/multi_turn.py ``HermesFormat``)."""


@dataclass
class MultiTurnConfig:
    """A sample generates until it closes a tool call (or ends); the tool runs in the sandbox, its output is
    appended as a tool turn (context, never trained on), and generation continues, up to ``max_turns``
    assistant turns and ``rollout.max_response_length`` tokens in all (policy and tool tokens together: the
    whole trajectory must fit the step's padded length)."""

    max_turns: int = 0
    """Most assistant turns per sample; 0 = off (one generate call per sample, the single-turn rollout). With
    k, a sample makes at most k - 1 tool calls (a call closed in the last turn is not run)."""
    format: str = "hermes"
    """How the policy writes a call: "hermes" = ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
    (Qwen2.5 / Qwen3 / Hermes chat templates); generation stops on ``</tool_call>``."""
    max_tool_output_tokens: int = 256
    """A tool turn longer than this many tokens is cut (with a marker) before it enters the context."""
    instruction: str = (
        'You can run Python code: write <tool_call>{"name": "python", "arguments": {"code": "..."}}'
        "</tool_call> and its printed output comes back. Then give the final answer."
    )
    """Appended to each user prompt (after the task's own instruction) so the policy knows the tool and its
    format; empty to leave prompts unchanged (a template's own tool schema, a warm-up that taught it)."""

    def __post_init__(self) -> None:
        _positive("rollout.multi_turn.max_turns", self.max_turns, allow_zero=True)
        _choice("rollout.multi_turn.format", self.format, FORMATS)
        _positive("rollout.multi_turn.max_tool_output_tokens", self.max_tool_output_tokens)
        if self.max_turns == 1:
            raise ConfigError(
                "rollout.multi_turn.max_turns=1 allows no tool call (a call closed in the last turn is not run): "
                "use 0 for single-turn rollouts or >= 2 for tool use"
            )

    @property
    def enabled(self) -> bool:
        return self.max_turns > 0


def check_multi_turn(
    mt: MultiTurnConfig, tools: tuple[str, ...], routing_replay: str, placement: str, warmup_steps: int
) -> None:
    """Run-level conditions of tool-integrated rollouts (RunConfig calls it): one line naming the field and fix."""
    if not mt.enabled:
        return
    if not tools:
        raise ConfigError(
            f"rollout.multi_turn.max_turns={mt.max_turns} with tools.enabled=[]: name the tools the policy may call "
            "(e.g. tools.enabled=[python]), or set rollout.multi_turn.max_turns=0"
        )
    if routing_replay == "rollout":
        raise ConfigError(
            "rollout.multi_turn with actor.routing_replay=rollout: the engine records no routing for tool-output "
            "tokens it never generated; set actor.routing_replay=none, or rollout.multi_turn.max_turns=0"
        )
    if warmup_steps and placement == "separate":
        raise ConfigError(
            "rollout.multi_turn with trainer.sft_warmup_steps > 0 and rollout.placement=separate: the tool "
            "warm-up runs the demonstrations' calls in the trainer's turn loop; set rollout.placement=colocated "
            "or trainer.sft_warmup_steps=0"
        )
