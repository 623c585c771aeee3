"""LoRA adapters on megatron's column- and row-parallel linears (actor/lora/adapters.py), on CPU with gloo ranks.

A two-layer block ``y = row(col(x))`` (the MLP's shape: column-parallel fc1, row-parallel fc2) is built at
TP = 1 and TP = 2 from the same full weights; the adapters' outputs, gradients and merged weights are checked
against the dense formula ``W x + (alpha / r) B A x`` computed in plain torch on the full matrices.
"""

from __future__ import annotations

import pytest
import torch
from _dist import run_distributed

IN, MID, OUT, R, ALPHA, TOKENS = 16, 12, 10, 4, 8.0, 6


def _full(seed=0):
    g = torch.Generator().manual_seed(seed)
    t = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return {
        "w1": t(MID, IN),
        "w2": t(OUT, MID),
        "b2": t(OUT),
        "a1": t(R, IN),
        "b1": t(MID, R),
        "a2": t(R, MID),
        "bb2": t(OUT, R),
        "x": t(TOKENS, 1, IN),
        "up": t(TOKENS, 1, OUT),
    }


def _dense(f, enabled=True):
    """The reference: both layers as plain matmuls on the full weights, and the gradients of the factors."""
    s = ALPHA / R
    p = {k: v.clone().requires_grad_() for k, v in f.items() if k in ("a1", "b1", "a2", "bb2")}
    x = f["x"].clone().requires_grad_()
    h = x @ f["w1"].t() + (s * (x @ p["a1"].t()) @ p["b1"].t() if enabled else 0)
    y = h @ f["w2"].t() + (s * (h @ p["a2"].t()) @ p["bb2"].t() if enabled else 0) + f["b2"]
    (y * f["up"]).sum().backward()
    return y.detach(), x.grad, {k: v.grad for k, v in p.items()}


def _body(rank, world, f):
    from megatron.core import parallel_state
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    from pacs_megatron.actor.lora.adapters import adapters_off, allreduce_replicated_grads, apply_lora, merged_weight
    from pacs_megatron.parallel.cpu_patches import apply_cpu_patches

    apply_cpu_patches()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    cfg = ModelParallelConfig(tensor_model_parallel_size=world, use_cpu_initialization=True, params_dtype=torch.float32)
    init = torch.nn.init.zeros_
    block = torch.nn.Module()
    block.linear_fc1 = ColumnParallelLinear(IN, MID, config=cfg, init_method=init, bias=False, gather_output=False)
    block.linear_fc2 = RowParallelLinear(
        MID, OUT, config=cfg, init_method=init, bias=True, input_is_parallel=True, skip_bias_add=False
    )
    m, o = MID // world, rank
    with torch.no_grad():
        block.linear_fc1.weight.copy_(f["w1"][o * m : (o + 1) * m])
        block.linear_fc2.weight.copy_(f["w2"][:, o * m : (o + 1) * m])
        block.linear_fc2.bias.copy_(f["b2"])
    adapters = apply_lora(block, ["linear_fc1", "linear_fc2"], R, ALPHA)
    base_only = block.linear_fc2(block.linear_fc1(f["x"])[0])[0].detach()  # B = 0: the base model exactly
    fc1, fc2 = adapters
    with torch.no_grad():
        fc1.lora_a.copy_(f["a1"])
        fc1.lora_b.copy_(f["b1"][o * m : (o + 1) * m])
        fc2.lora_a.copy_(f["a2"][:, o * m : (o + 1) * m])
        fc2.lora_b.copy_(f["bb2"])
    x = f["x"].clone().requires_grad_()
    y = block.linear_fc2(block.linear_fc1(x)[0])[0]
    (y * f["up"]).sum().backward()
    allreduce_replicated_grads(block, parallel_state.get_tensor_model_parallel_group())
    with adapters_off([block]), torch.no_grad():
        off = block.linear_fc2(block.linear_fc1(f["x"])[0])[0]
    out = {
        "base_only": base_only,
        "y": y.detach(),
        "x_grad": x.grad,
        "off": off,
        "grads": {"a1": fc1.lora_a.grad, "b1": fc1.lora_b.grad, "a2": fc2.lora_a.grad, "bb2": fc2.lora_b.grad},
        "merged": (merged_weight(fc1), merged_weight(fc2)),
        "names": sorted(block.state_dict()),
        "trainable": sorted(n for n, p in block.named_parameters() if p.requires_grad),
    }
    parallel_state.destroy_model_parallel()
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("tp", [1, 2])
def test_lora_matches_the_dense_formula(tp):
    f = _full()
    ref_y, ref_xg, ref_g = _dense(f)
    base_y, _, _ = _dense(f, enabled=False)
    s = ALPHA / R
    m = MID // tp
    for rank, r in enumerate(run_distributed(_body, tp, f)):
        sl = slice(rank * m, (rank + 1) * m)
        assert torch.allclose(r["base_only"], base_y, rtol=1e-5, atol=1e-4)  # PEFT's init: B = 0 is the base
        assert torch.allclose(r["y"], ref_y, rtol=1e-5, atol=1e-4) and torch.allclose(
            r["x_grad"], ref_xg, rtol=1e-5, atol=1e-4
        )
        assert torch.allclose(r["off"], base_y, rtol=1e-5, atol=1e-4)  # adapters off: the reference policy
        g = r["grads"]
        assert torch.allclose(g["a1"], ref_g["a1"], rtol=1e-5, atol=1e-4)  # replicated, summed over the TP group
        assert torch.allclose(g["b1"], ref_g["b1"][sl], rtol=1e-5, atol=1e-4)
        assert torch.allclose(g["a2"], ref_g["a2"][:, sl], rtol=1e-5, atol=1e-4)
        assert torch.allclose(g["bb2"], ref_g["bb2"], rtol=1e-5, atol=1e-4)  # replicated, summed over the TP group
        w1 = f["w1"] + s * f["b1"] @ f["a1"]
        w2 = f["w2"] + s * f["bb2"] @ f["a2"]
        assert torch.allclose(r["merged"][0], w1[sl], rtol=1e-5, atol=1e-4) and torch.allclose(
            r["merged"][1], w2[:, sl], atol=1e-5
        )
        assert r["trainable"] == [f"linear_fc{i}.lora_{ab}" for i in (1, 2) for ab in "ab"]
        # the base keeps its names (checkpoints, HF name maps, weight sync), the adapter sits beside it
        assert {"linear_fc1.weight", "linear_fc2.weight", "linear_fc2.bias"} <= set(r["names"])


def test_bad_targets_and_ranks_name_what_exists():
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear  # noqa: F401  (the import must work)

    from pacs_megatron.actor.lora.adapters import apply_lora

    with pytest.raises(ValueError, match=r"\['linear_qkvv'\] not in this model; its linears are \[\]"):
        apply_lora(torch.nn.Linear(2, 2), ["linear_qkvv"], 4, 8.0)
    with pytest.raises(ValueError, match="rank=0 must be >= 1"):
        apply_lora(torch.nn.Linear(2, 2), [], 0, 8.0)
