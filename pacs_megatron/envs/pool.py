"""Run a batch of tool calls at once, answers in input order: threads on this machine, or Ray tasks.

    pool = make_pool(cfg.tools)                      # checks the sandbox level and loads the tools first
    results = pool.run([("python", {"code": "print(1)"}), ("python", '{"code": "1/0"}')])
    metrics = tool_metrics(results)                  # tools/calls, tools/errors, tools/timeouts, tools/seconds

- ``tools.backend=local``: ``tools.workers`` threads, each waiting on one sandboxed process at a time (the work
  is in the child processes, so threads are enough; the GIL is free while they wait).
- ``tools.backend=ray``: each call is a Ray task (1 CPU, SPREAD over the nodes, at the job's priority as the
  reward actors are), at most ``tools.workers`` in flight; each worker process builds the toolbox once. A
  task lost with its node, or not back ``wall_seconds + 60`` s after it was handed over, is a
  ``worker_error`` / ``timeout`` result, never an exception. The pool joins ``$RAY_ADDRESS``'s cluster, else
  starts a private Ray instance (and stops it on :meth:`RayToolPool.close`). ``ray`` is imported only here.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Protocol

from pacs_megatron.envs.registry import Toolbox
from pacs_megatron.envs.result import ToolResult
from pacs_megatron.utils.proc import ray_job_runtime_env

if TYPE_CHECKING:
    from pacs_megatron.config.tools import ToolsConfig

ToolCall = tuple[str, "Mapping[str, Any] | str | None"]
"""``(tool name, arguments)``: arguments as a dict or the model's JSON text."""
RAY_SLACK_S = 60.0
"""Beyond a call's own wall limit, how long a Ray task may take to be scheduled and to start its worker."""


class ToolPool(Protocol):
    """Runs calls; ``run`` returns one result per call, in the order given, and never raises for a call."""

    def run(self, calls: Sequence[ToolCall]) -> list[ToolResult]: ...

    def close(self) -> None: ...


def make_pool(cfg: ToolsConfig) -> LocalToolPool | RayToolPool:
    """The pool ``tools.backend`` asks for (the sandbox level and the tools checked here, before any call)."""
    if cfg.backend == "ray":
        return RayToolPool(cfg)
    return LocalToolPool(cfg)


class LocalToolPool:
    """``cfg.workers`` threads over one :class:`Toolbox`."""

    def __init__(self, cfg: ToolsConfig, toolbox: Toolbox | None = None) -> None:
        self.toolbox = toolbox if toolbox is not None else Toolbox(cfg)
        self._executor = ThreadPoolExecutor(max_workers=cfg.workers, thread_name_prefix="pacs-tool")

    def run(self, calls: Sequence[ToolCall]) -> list[ToolResult]:
        """One result per call, in input order."""
        return list(self._executor.map(lambda call: self.toolbox.call(*call), calls))

    def close(self) -> None:
        """Wait for running calls (each ends by its wall limit) and stop the threads."""
        self._executor.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> LocalToolPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_WORKER_TOOLBOXES: dict[str, Toolbox] = {}
"""In a Ray worker process: its toolbox per config (built at its first task, kept for the next)."""


def _ray_call(cfg: ToolsConfig, sys_path: list[str], name: str, arguments: Any) -> ToolResult:
    """One call in a Ray worker: user tool modules resolve as in the driver."""
    key = repr(cfg)
    box = _WORKER_TOOLBOXES.get(key)
    if box is None:
        sys.path[:] = list(dict.fromkeys(sys_path + sys.path))
        box = _WORKER_TOOLBOXES[key] = Toolbox(cfg)
    return box.call(name, arguments)


class RayToolPool:
    """Calls as Ray tasks, at most ``cfg.workers`` in flight; :meth:`run` mirrors :class:`LocalToolPool`."""

    def __init__(self, cfg: ToolsConfig) -> None:
        import ray

        self.toolbox = Toolbox(cfg)  # the tools load and the sandbox starts here too: config errors fail here
        """The driver's own toolbox: its :meth:`~Toolbox.schemas` for the chat template (calls go to Ray)."""
        self.cfg = cfg
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            ray.init(address=os.environ.get("RAY_ADDRESS") or None, log_to_driver=False)
        self._task = ray.remote(
            num_cpus=1, max_retries=0, scheduling_strategy="SPREAD", runtime_env=ray_job_runtime_env()
        )(_ray_call)

    def run(self, calls: Sequence[ToolCall]) -> list[ToolResult]:
        """One result per call, in input order; a lost or overdue task is an error result."""
        import ray

        results: list[ToolResult | None] = [None] * len(calls)
        flying: dict[Any, tuple[int, float]] = {}  # ObjectRef -> (call index, when handed over)
        sys_path = list(sys.path)
        budget = self.cfg.wall_seconds + RAY_SLACK_S
        submitted = 0
        while submitted < len(calls) or flying:
            while submitted < len(calls) and len(flying) < self.cfg.workers:
                name, arguments = calls[submitted]
                flying[self._task.remote(self.cfg, sys_path, name, arguments)] = (submitted, time.monotonic())
                submitted += 1
            wait_s = max(0.0, min(t0 + budget for _, t0 in flying.values()) - time.monotonic())
            done, _ = ray.wait(list(flying), num_returns=1, timeout=wait_s)
            for ref in done:
                i, t0 = flying.pop(ref)
                try:
                    results[i] = ray.get(ref)
                except ray.exceptions.RayError as e:
                    results[i] = ToolResult(
                        f"error: the tool call was lost ({type(e).__name__})",
                        "worker_error",
                        time.monotonic() - t0,
                        calls[i][0],
                    )
            now = time.monotonic()
            for ref, (i, t0) in list(flying.items()):
                if now - t0 > budget:
                    ray.cancel(ref, force=True)
                    del flying[ref]
                    results[i] = ToolResult(
                        f"[stopped: no answer within {budget:g} s]", "timeout", now - t0, calls[i][0]
                    )
        return [r if r is not None else ToolResult("error: no result", "worker_error") for r in results]

    def close(self) -> None:
        """Stop Ray if this pool started it (tasks end by themselves)."""
        import ray

        if self._owns_ray and ray.is_initialized():
            ray.shutdown()

    def __enter__(self) -> RayToolPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
