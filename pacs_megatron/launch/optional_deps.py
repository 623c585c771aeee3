"""Which installed package each setting needs, checked before any rank starts.

    pacs-megatron train --config c.yaml logging.wandb_project=my-runs
    [.. E pacs_megatron.launch.errors] train: config error: logging.wandb_project='my-runs' needs wandb, which is
    not installed: pip install wandb (or pip install 'pacs-megatron[wandb]'), or unset logging.wandb_project
    (exit 2; nothing was spawned or loaded)

Without this check a missing package is found where it is first imported: inside the ranks, after the model
was built (wandb: 104 s on a loaded 2-core box, then two chained tracebacks and a gloo "Connection closed by
peer" from the other rank; issue 42). Each entry of :data:`NEEDS` is one setting, the module it imports, and
the pip command; presence is decided with ``importlib.util.find_spec`` (no import: ray's and vLLM's take
seconds). The declared dependencies (pyproject.toml) are listed too: a partial or hand-made environment is
where they go missing, and the line then says what to install rather than a traceback.

``rollout.engine=vllm`` and ``rollout.quantization`` keep their own, more specific messages
(launch/checks/device.py), which run first.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

from pacs_megatron.config import ConfigError, RunConfig


@dataclass(frozen=True)
class Need:
    """One optional package that a setting needs.

    Example:
        >>> Need("logging.wandb_project", lambda c: c.logging.wandb_project, "wandb", "pip install wandb", "").module
        'wandb'
    """

    key: str
    """The setting, as a user writes it in an override."""
    applies: Callable[[RunConfig], object]
    """Whether (truthy) this run's config uses the setting in a way that imports :attr:`module`."""
    module: str
    """The top-level module imported (what ``find_spec`` looks for)."""
    install: str
    """The pip command that provides it."""
    instead: str
    """The other way out: the setting that avoids the package (empty: none)."""


def _ray(cfg: RunConfig) -> bool:
    return cfg.launcher.kind == "ray" or cfg.reward.backend == "ray"


NEEDS: tuple[Need, ...] = (
    Need(
        "logging.wandb_project",
        lambda c: c.logging.wandb_project,
        "wandb",
        "pip install wandb (or pip install 'pacs-megatron[wandb]')",
        "unset logging.wandb_project",
    ),
    Need(
        "logging.tensorboard",
        lambda c: c.logging.tensorboard,
        "tensorboard",
        "pip install tensorboard",
        "set logging.tensorboard=false",
    ),
    Need(
        "logging.progress_bar",
        lambda c: c.logging.progress_bar,
        "rich",
        "pip install rich",
        "set logging.progress_bar=false",
    ),
    Need(
        "launcher.kind=ray / reward.backend=ray",
        _ray,
        "ray",
        "pip install 'ray>=2.40'",
        "use launcher.kind=local and reward.backend=local",
    ),
    Need(
        "reward.fn",
        lambda c: c.reward.fn in ("math", "math_boxed"),
        "math_verify",
        "pip install 'math-verify>=0.9'",
        "use reward.fn=arith or your own package.module:function",
    ),
    Need("model.init=gguf", lambda c: c.model.init == "gguf", "gguf", "pip install 'gguf>=0.10'", ""),
    Need("model.init=gguf", lambda c: c.model.init == "gguf", "accelerate", "pip install accelerate", ""),
    Need("trainer.export_hf", lambda c: c.trainer.export_hf, "safetensors", "pip install safetensors", ""),
)
"""Every optional package a setting imports (the GPU engine and modelopt: launch/checks/device.py)."""


def installed(module: str) -> bool:
    """Whether ``module`` can be imported here, without importing it (~ms)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a broken parent package, or a module with __spec__ None
        return False


def missing_line(key: str, value: object, module: str, install: str, instead: str) -> str:
    """The one line for a missing package: the setting, the package, the pip command, the way around it.

    Example:
        >>> missing_line("plot", "", "matplotlib", "pip install matplotlib", "")
        'plot needs matplotlib, which is not installed: pip install matplotlib'
    """
    what = f"{key}={value!r}" if value not in ("", None, True) and "=" not in key else key
    tail = f", or {instead}" if instead else ""
    return f"{what} needs {module}, which is not installed: {install}{tail}"


def check_optional_deps(cfg: RunConfig, have: Callable[[str], bool] | None = None) -> None:
    """Raise :class:`ConfigError` for the first setting of ``cfg`` whose package is not installed
    (``have`` decides presence, default :func:`installed`; tests pass their own)."""
    have = have or installed
    for need in NEEDS:
        used = need.applies(cfg)
        if used and not have(need.module):
            value = used if isinstance(used, str) else ""
            raise ConfigError(missing_line(need.key, value, need.module, need.install, need.instead))


def require(command: str, module: str, install: str) -> None:
    """A command's own optional package (``plot`` and ``compare`` draw with matplotlib): ConfigError if absent."""
    if not installed(module):
        raise ConfigError(missing_line(command, "", module, install, ""))
