"""What a tool call gives back (:class:`ToolResult`), the truncation every tool's text goes through, and the
batch's metrics (``tools/calls``, ``tools/errors``, ``tools/timeouts``, ``tools/seconds``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class ToolResult:
    """One call's outcome: the text the model sees next, how it ended, and how long it took."""

    text: str
    """Goes back into the model's context as the tool's answer (already truncated)."""
    kind: str = "ok"
    """"ok"; a sandbox's end (``timeout``, ``cpu_limit``, ``memory_limit``, ``output_limit``, ``crash``,
    ``error``, ``sandbox_error``; sandbox.KINDS); ``bad_call`` (unknown tool, bad arguments: the model's
    mistake), ``tool_error`` (a tool raised), ``worker_error`` (a Ray task was lost)."""
    seconds: float = 0.0
    name: str = ""
    """The tool called (as the model named it)."""

    @property
    def ok(self) -> bool:
        """The call ran and succeeded."""
        return self.kind == "ok"


def cut_marker(n: int) -> str:
    """The line that stands where ``n`` characters were cut."""
    return f"\n[... {n} characters cut ...]\n"


def truncate(head: str, tail: str, max_chars: int) -> str:
    """``head + tail`` in at most about ``max_chars`` characters: the tail (an error's last lines) keeps up to
    half of them from its end, the head (the output) the rest from its start, a marker where text was cut.

    Example:
        >>> truncate("a" * 50, "", 20)
        'aaaaaaaaaaaaaaaaaaaa\\n[... 30 characters cut ...]\\n'
    """
    if len(head) + len(tail) <= max_chars:
        return head + tail
    if len(tail) > max_chars // 2:
        keep = max_chars // 2
        tail = cut_marker(len(tail) - keep) + tail[len(tail) - keep :]
    room = max(0, max_chars - len(tail))
    if len(head) > room:
        head = head[:room] + cut_marker(len(head) - room)
    return head + tail


def tool_metrics(results: Sequence[ToolResult]) -> dict[str, float]:
    """The batch's tool counters: calls, errors (every call not ok), timeouts, total and slowest seconds.

    Example:
        >>> tool_metrics([ToolResult("1", seconds=0.5), ToolResult("", "timeout", 2.0)])["tools/errors"]
        1.0
    """
    seconds = [r.seconds for r in results]
    return {
        "tools/calls": float(len(results)),
        "tools/errors": float(sum(not r.ok for r in results)),
        "tools/timeouts": float(sum(r.kind == "timeout" for r in results)),
        "tools/seconds": float(sum(seconds)),
        "tools/seconds_max": float(max(seconds, default=0.0)),
    }
