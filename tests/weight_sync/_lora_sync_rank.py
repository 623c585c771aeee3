"""One rank (a world of one) with a real LoRA MegatronActor and a real vLLM-on-CPU engine serving its adapter
(``sync.lora=adapter``): run by tests/weight_sync/test_lora_sync.py as a child process (vLLM's external
launcher and megatron's groups in one fresh process). Prints one JSON line of what it saw.

    python tests/weight_sync/_lora_sync_rank.py WORKDIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: _vllm

SEQS = [[1, 5, 7, 9, 3, 4, 6, 12, 2], [6, 13, 8, 14, 5, 5, 10, 11, 9, 3, 4, 1]]


def _move_adapters(actor, seed: int, scale: float = 0.05) -> None:
    """B away from zero (A is PEFT's random init already): the adapter now changes the policy."""
    from pacs_megatron.actor.lora.adapters import lora_modules
    from pacs_megatron.actor.weights import unwrap

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for c in actor.model:
            for m in lora_modules(unwrap(c)).values():
                m.lora_b.copy_(scale * torch.randn(m.lora_b.shape, generator=g))


def main(workdir: Path) -> dict:
    from _vllm import saved_model
    from transformers import AutoTokenizer

    from pacs_megatron.config import load_config
    from pacs_megatron.loop.build import build_actor, engine_run
    from pacs_megatron.parallel import destroy_parallel, initialize_parallel
    from pacs_megatron.rollout.vllm.engine import VLLMEngine, single_rank_launcher_env
    from pacs_megatron.weight_sync import WeightSync, WeightSyncError

    model_dir = saved_model(workdir / "model", tied=True, seed=3)
    out: dict = {}
    with single_rank_launcher_env():
        cfg = load_config(
            None,
            [
                f"model.path={model_dir}",
                "model.init=pretrained",
                "model.dtype=float32",
                "parallel.tp=1",
                "rollout.engine=vllm",
                "actor.lora.rank=4",
                "actor.lora.alpha=8",
                "sync.lora=adapter",
                "algorithm.pacs.anchor=reference",  # a LoRA reference: the v2 reset below
                "data.max_prompt_length=16",
                "rollout.max_response_length=8",
            ],
        )
        groups = initialize_parallel(cfg.parallel, json.loads((model_dir / "config.json").read_text()))
        engine = None
        try:
            actor = build_actor(cfg, groups, str(model_dir))
            tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
            engine = VLLMEngine(cfg.rollout, engine_run(cfg), model_dir=model_dir, tokenizer=tok, device="cpu")
            sync = WeightSync(actor, engine, cfg.sync, actor.hf_config.vocab_size, actor.param_dtype, cfg.rollout)
            first = sync.sync()  # the base (adapters off) and the adapter (B = 0)
            out["first"] = first.metrics()
            out["lora_request"] = engine._lora().lora_int_id
            _move_adapters(actor, seed=1)
            second = sync.sync()  # the adapter alone
            out["second"] = second.metrics()
            out["held"] = sorted(engine.llm.llm_engine.list_loras())
            out["dirs"] = sorted(p.name for p in sync.adapter.root.iterdir())
            # the engine serves the adapter: its log-probs moved with B, and match the actor's
            actor_lp = sync.reference_logprobs(sync.probe_batch())[0]
            out["probe_rows"] = int(actor_lp.shape[0])
            with_adapter = engine.logprobs(SEQS)
            slot, engine._adapter.request = engine._adapter.request, None
            engine._adapter.required = False
            base_only = engine.logprobs(SEQS)  # the base under the adapter
            engine._adapter.request, engine._adapter.required = slot, True
            out["adapter_effect"] = max(float((a - b).abs().max()) for a, b in zip(with_adapter, base_only))

            # a wrong adapter: B scaled by 1.5 on the way (a scaling or split bug) must fail the probe
            peft_adapter = actor.peft_adapter

            def scaled_b():
                tensors, config = peft_adapter()
                return {k: v * 1.5 if "lora_B" in k else v for k, v in tensors.items()}, config

            actor.peft_adapter = scaled_b
            try:
                sync.sync()
                out["broken"] = "passed"
            except WeightSyncError as e:
                out["broken"] = str(e)
            finally:
                actor.peft_adapter = peft_adapter

            # a PACS v2 reset merges the adapters into the base: the next sync sends the base again
            actor.reset_reference()
            actor.reference.reset_step = 7
            _move_adapters(actor, seed=2, scale=0.02)
            third = sync.sync()
            out["third"] = third.metrics()
            out["third_id"] = engine._lora().lora_int_id
            out["held_after_reset"] = sorted(engine.llm.llm_engine.list_loras())
            root = sync.adapter.root
            sync.adapter.close()
            out["root_removed"] = not root.exists()
        finally:
            if engine is not None:
                engine.close()
            destroy_parallel()
    return out


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(Path(sys.argv[1]))), flush=True)
