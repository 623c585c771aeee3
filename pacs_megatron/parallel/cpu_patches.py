"""The few patches megatron-core 0.16.1 needs to run on a CPU-only torch (gloo), in one place.

megatron-core hard-codes CUDA in code paths this project uses. :func:`apply_cpu_patches` neutralises
exactly those, and only when no GPU is present (with a GPU it does nothing). It is idempotent.

Two kinds of patch:

* process-wide, on ``torch.cuda`` functions that raise on a CPU-only build anyway (so no working
  code can depend on them): ``current_device`` returns ``"cpu"`` (megatron's ~40
  ``device=torch.cuda.current_device()`` sites), ``synchronize`` / ``empty_cache`` are no-ops, and
  ``Tensor.cuda()`` returns the tensor unchanged;
* module-scoped: inside the listed megatron modules the name ``torch`` is re-bound to a proxy
  whose tensor factories build ``device="cuda"`` tensors on the CPU. Everything else resolves to
  the real ``torch``.

Plus one function replaced by a CPU equivalent (an assertion on the CUDA tensor type name), one
missing name defined (``moe_utils.te_general_gemm``, for MoE routers), and the constructors of the
bf16/fp16 optimizers (``Float16OptimizerWithFloat16Params``, ``DistributedOptimizer``), which sort
parameters by ``param.type()`` against the CUDA names (``torch.cuda.BFloat16Tensor``) and raise
``TypeError`` on any CPU parameter: while they run, a CPU tensor's ``type()`` reads as its CUDA name.
That is what lets ``model.dtype=bfloat16`` train on CPU (bf16 weights, fp32 main weights and grads).

And one for a rank's start, not for CUDA: :func:`import_megatron` imports megatron-core with its
``torch.compile`` decorations deferred to their first call (see there).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import sys
import types

import torch

_applied = False

# module -> the megatron call(s) whose literal device="cuda" the proxy covers
_CUDA_LITERAL_MODULES = {
    # forward_backward_{no_pipelining,pipelining_*}: total_num_tokens = torch.zeros(..., device="cuda")
    "megatron.core.pipeline_parallel.schedules": "total_num_tokens",
    # MixedPrecisionOptimizer/FP32Optimizer.__init__: found_inf, _dummy_overflow_buf, _scale_one, _scale
    "megatron.core.optimizer.optimizer": "optimizer scalars",
    # get_grad_norm_fp32 / count_zeros_fp32: total_norm_cuda, dummy_overflow_buf, grad_norm
    "megatron.core.optimizer.clip_grads": "grad-norm buffers",
    # local_multi_tensor_l2_norm (the no-Apex grad-norm kernel): l2_cuda
    "megatron.core.utils": "l2 norm result",
    # get_default_causal_mask (attention without an explicit mask): torch.ones(sq, sq, device="cuda")
    "megatron.core.transformer.utils": "causal mask",
    # _ParamAndGradBuffer: tmp_warmup_tensor (NCCL warm-up)
    "megatron.core.distributed.param_and_grad_buffer": "warm-up tensor",
    # get_pos_emb_on_this_cp_rank (RoPE under context parallelism): torch.tensor(..., pin_memory=True)
    "megatron.core.models.common.embeddings.rope_utils": "CP rank's RoPE slice",
}
_FACTORIES = ("zeros", "ones", "empty", "tensor", "full", "arange")


def _cpu_device(device):
    if device is None:
        return None
    if isinstance(device, torch.device):
        return torch.device("cpu") if device.type == "cuda" else device
    if isinstance(device, str) and device.startswith("cuda"):
        return "cpu"
    if isinstance(device, int):  # torch.cuda.current_device() style ordinal
        return "cpu"
    return device


def _on_cpu(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        # pinned memory needs an accelerator; a CPU-only torch raises on pin_memory=True
        kwargs.pop("pin_memory", None)
        return fn(*args, **kwargs)

    return wrapper


class _CpuTorch(types.ModuleType):
    """``torch`` as seen by one megatron module: factories map device="cuda" to the CPU."""

    def __init__(self) -> None:
        super().__init__("torch")
        for name in _FACTORIES:
            setattr(self, name, _on_cpu(getattr(torch, name)))

    def __getattr__(self, name):
        return getattr(torch, name)


def _clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
    """CPU stand-in for megatron.core.optimizer.clip_grads.clip_grad_by_total_norm_fp32, whose
    ``assert param.grad.type() == 'torch.cuda.FloatTensor'`` fails on CPU. Same maths: scale every
    fp32 grad by max_norm / (total_norm + 1e-6) when that is < 1."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [getattr(p, attr).detach() for p in parameters if getattr(p, attr, None) is not None]
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0:
        for g in grads:
            g.mul_(clip_coeff)


def _cuda_type_name(type_fn):
    """``Tensor.type`` that names a CPU tensor as its CUDA twin when asked for its name (no argument)."""

    @functools.wraps(type_fn)
    def type_(self, *args, **kwargs):
        name = type_fn(self, *args, **kwargs)
        if args or kwargs or self.device.type != "cpu":
            return name
        return name.replace("torch.", "torch.cuda.", 1)

    type_._pacs_cuda_names = True  # type: ignore[attr-defined]
    return type_


def _with_cuda_type_names(init):
    """``init`` run while ``torch.Tensor.type`` names CPU tensors as CUDA ones (re-entrant: the
    distributed optimizer's constructor calls its base class's)."""

    @functools.wraps(init)
    def wrapper(*args, **kwargs):
        original = torch.Tensor.type
        if getattr(original, "_pacs_cuda_names", False):
            return init(*args, **kwargs)
        torch.Tensor.type = _cuda_type_name(original)
        try:
            return init(*args, **kwargs)
        finally:
            torch.Tensor.type = original

    return wrapper


@contextlib.contextmanager
def _torch_compile_deferred():
    """While it is open, ``torch.compile(fn)`` returns a wrapper that compiles ``fn`` on its first call."""
    real = torch.compile

    def deferred(model=None, **kwargs):
        if model is None:  # the @torch.compile(mode=...) form
            return lambda fn: deferred(fn, **kwargs)
        compiled = []

        @functools.wraps(model)
        def call(*args, **kw):
            if not compiled:
                compiled.append(real(model, **kwargs))
            return compiled[0](*args, **kw)

        return call

    torch.compile = deferred
    try:
        yield
    finally:
        torch.compile = real


def import_megatron() -> None:
    """Import megatron-core, on a CPU-only torch with its ``torch.compile`` decorations deferred.

    megatron.core.jit binds ``jit_fuser = torch.compile``, and its fused kernels (fusions/fused_bias_*.py)
    are decorated with it as the package imports. Building each compiled wrapper imports dynamo and
    inductor (sympy, networkx, triton): ~2-3 s of every CPU rank's start, and most of megatron's import
    time (measured in docs/benchmarks.md, "A launch's start and exit"). This project turns those fusions off
    (actor/model.py: bias_*_fusion=False), so nothing calls the wrappers; deferred, one that is called
    still compiles as it would have, at its first call. With a GPU, megatron imports untouched."""
    if "megatron.core" in sys.modules or torch.cuda.is_available():
        import megatron.core  # noqa: F401

        return
    with _torch_compile_deferred():
        import megatron.core  # noqa: F401


def apply_cpu_patches() -> bool:
    """Patch megatron-core for a CPU-only run; returns True when patches are (already) in place."""
    global _applied
    if torch.cuda.is_available():
        return False
    if _applied:
        return True
    import_megatron()
    # ~40 sites: device=torch.cuda.current_device() (rotary inv_freq move, p2p shape buffers,
    # grad buffers, checkpoint async helpers, ...).
    torch.cuda.current_device = lambda: "cpu"
    # p2p_communication._communicate (batch_p2p_sync) and dist_checkpointing save/load.
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.empty_cache = lambda *a, **k: None
    # LanguageModule.setup_embeddings_and_output_layer: weight.data.cuda() before the all-reduce
    # that ties the first stage's embedding to the last stage's output layer (PP > 1).
    torch.Tensor.cuda = lambda self, *a, **k: self
    proxy = _CpuTorch()
    for name in _CUDA_LITERAL_MODULES:
        importlib.import_module(name).torch = proxy
    optimizer_mod = importlib.import_module("megatron.core.optimizer.optimizer")
    optimizer_mod.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_fp32
    distrib_mod = importlib.import_module("megatron.core.optimizer.distrib_optimizer")
    for cls in (optimizer_mod.Float16OptimizerWithFloat16Params, distrib_mod.DistributedOptimizer):
        cls.__init__ = _with_cuda_type_names(cls.__init__)
    # MoE router gating (RouterGatingLinearFunction) tests ``te_general_gemm is not None``, but the
    # name is only bound when Transformer Engine imports: a NameError without TE. None selects the
    # torch.mm fallback that is already there.
    moe_utils = importlib.import_module("megatron.core.transformer.moe.moe_utils")
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    _applied = True
    return True
