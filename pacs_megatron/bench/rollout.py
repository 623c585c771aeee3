"""Benchmark: rollout tokens/s of the vLLM engine beside the HF engine on CPU, and a weight sync into vLLM
beside a memcpy of the same bytes, in one process and one run.

    python -m pacs_megatron.bench.rollout                       # the CPU default's model and two shapes
    python -m pacs_megatron.bench.rollout --json rollout.json

Both engines load the same random tiny Qwen2 (the CPU default's shape, float32) and sample the same prompts
at T=1: the ``default`` shape (50 prompts x 16, at most 3 tokens) and ``long`` (16 x 16, at most 64). The
sync times ``VLLMEngine.update_weights`` against ``p.copy_(src)`` of the same tensors, for that model and,
with ``--sync-100m``, bench/sync.py's ~100M Qwen2. Medians of ``--repeat`` after a warm-up; mean response
lengths are reported (random models stop early). Results: docs/benchmarks.md, "vLLM on CPU".
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from pacs_megatron.utils.logging import get_logger, init_logging

logger = get_logger("pacs_megatron.bench.rollout")  # also when run as __main__
SHAPES = {"default": (50, 16, 3), "long": (16, 16, 64)}
"""name -> (prompts, n, max_tokens)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shapes", default="default,long", help=f"comma-separated of {sorted(SHAPES)}")
    p.add_argument("--repeat", type=int, default=3, help="timed calls after one warm-up (median)")
    p.add_argument("--json", default=None, help="write the report here")
    p.add_argument("--sync-100m", action="store_true", help="also time the sync of a ~100M-parameter model")


SYNC_100M = dict(hidden_size=768, num_layers=12, num_attention_heads=12, num_key_value_heads=4, intermediate_size=2048)
"""bench/sync.py's default ~100M-parameter Qwen2 (tied, vocab 32000), for a sync whose bytes dominate."""


def _model_dir(root: Path, vocab: int | None = None, **shape) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    from pacs_megatron.config import TinyModelConfig
    from pacs_megatron.data.synthetic import write_tiny_model_dir

    tiny = TinyModelConfig(max_position_embeddings=128, tie_word_embeddings=True, **shape)  # default: CPU default's
    model_dir = write_tiny_model_dir(root, tiny)
    if vocab is not None:  # vLLM runs without a tokenizer here: a larger embedding than the task's vocabulary
        config = json.loads((model_dir / "config.json").read_text())
        (model_dir / "config.json").write_text(json.dumps({**config, "vocab_size": vocab}))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(model_dir))).save_pretrained(str(model_dir))
    return model_dir


def _sync(engine, model_dir: Path, repeat: int) -> dict:
    """``engine.update_weights`` of the model's HF state vs ``copy_`` of the same tensors."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32)
    state = [(k, v.detach().clone()) for k, v in hf.state_dict().items() if k != "lm_head.weight" or not _tied(hf)]
    nbytes = sum(t.numel() * t.element_size() for _, t in state)
    sync_s, _ = _time(lambda: engine.update_weights([state]), repeat)
    dst = [torch.empty_like(t) for _, t in state]
    memcpy_s, _ = _time(lambda: [d.copy_(t) for d, (_, t) in zip(dst, state)], repeat)
    return {"bytes": nbytes, "vllm_s": sync_s, "memcpy_s": memcpy_s, "ratio": sync_s / memcpy_s}


def _tied(hf) -> bool:
    return bool(getattr(hf.config, "tie_word_embeddings", False))


def _time(fn, repeat: int) -> tuple[float, object]:
    out = fn()  # warm-up
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def _rollout(engine, prompts, n: int, max_tokens: int, repeat: int) -> dict:
    from pacs_megatron.rollout.types import SamplingParams

    sp = SamplingParams(n=n, temperature=1.0, max_tokens=max_tokens, seed=1)
    seconds, groups = _time(lambda: engine.generate(prompts, sp), repeat)
    tokens = sum(len(r.token_ids) for g in groups for r in g)
    return {
        "seconds": seconds,
        "tokens": tokens,
        "tokens_per_s": tokens / seconds,
        "mean_len": tokens / (n * len(prompts)),
    }


def run(args: argparse.Namespace) -> dict:
    from transformers import AutoTokenizer

    from pacs_megatron.config import load_config
    from pacs_megatron.loop.build import engine_run
    from pacs_megatron.rollout.hf_engine import HFEngine
    from pacs_megatron.rollout.vllm.engine import VLLMEngine, single_rank_launcher_env

    with tempfile.TemporaryDirectory() as tmp, single_rank_launcher_env():
        model_dir = _model_dir(Path(tmp) / "model")
        tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
        longest = max(SHAPES[s][2] for s in args.shapes.split(","))
        cfg = load_config(
            None,
            [f"model.path={model_dir}", "rollout.engine=vllm", "data.max_prompt_length=8",
             f"rollout.max_response_length={longest}", "rollout.vllm.max_num_seqs=256"],
        )  # fmt: skip
        start = time.perf_counter()
        vllm_engine = VLLMEngine(cfg.rollout, engine_run(cfg), model_dir=model_dir, tokenizer=tok, device="cpu")
        vllm_start = time.perf_counter() - start
        hf = HFEngine(model_dir, tok, device="cpu", dtype=torch.float32, batch_size=64, seed=0)
        report: dict = {"rollout": {}, "vllm_start_s": vllm_start}
        try:
            for name in args.shapes.split(","):
                count, n, max_tokens = SHAPES[name]
                prompts = [tok(f"{i % 5}+{i // 5 % 5}=", add_special_tokens=False)["input_ids"] for i in range(count)]
                row = {
                    e: _rollout(eng, prompts, n, max_tokens, args.repeat)
                    for e, eng in (("hf", hf), ("vllm", vllm_engine))
                }
                row["shape"] = {"prompts": count, "n": n, "max_tokens": max_tokens}
                report["rollout"][name] = row
                logger.info("%s: %s", name, {e: round(row[e]["tokens_per_s"], 1) for e in ("hf", "vllm")})
            report["sync"] = {"cpu_default": _sync(vllm_engine, model_dir, args.repeat)}
        finally:
            vllm_engine.close()
        if args.sync_100m:
            big = _model_dir(Path(tmp) / "m100", vocab=32000, **SYNC_100M)
            lengths = ["data.max_prompt_length=8", "rollout.max_response_length=8"]
            big_cfg = load_config(None, [f"model.path={big}", "rollout.engine=vllm", *lengths])
            engine = VLLMEngine(big_cfg.rollout, engine_run(big_cfg), model_dir=big, tokenizer=tok, device="cpu")
            try:
                report["sync"]["qwen2_100m"] = _sync(engine, big, args.repeat)
            finally:
                engine.close()
    report["machine"] = {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads()}
    report["date"] = dt.date.today().isoformat()
    return report


def main(args: argparse.Namespace) -> int:
    init_logging()
    report = run(args)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    for name, row in report["rollout"].items():
        s = row["shape"]
        logger.info(
            "rollout %-7s %3d prompts x n=%d, <= %2d tokens: HF %7.1f tok/s (mean len %.1f) | vLLM %7.1f tok/s "
            "(mean len %.1f) | vLLM/HF %.2fx",
            name, s["prompts"], s["n"], s["max_tokens"], row["hf"]["tokens_per_s"], row["hf"]["mean_len"],
            row["vllm"]["tokens_per_s"], row["vllm"]["mean_len"],
            row["vllm"]["tokens_per_s"] / row["hf"]["tokens_per_s"],
        )  # fmt: skip
    for name, sync in report["sync"].items():
        logger.info(
            "sync into vLLM, %s, %.1f MB: %.3f s (reload) vs memcpy %.4f s: %.1fx",
            name, sync["bytes"] / 1e6, sync["vllm_s"], sync["memcpy_s"], sync["ratio"],
        )  # fmt: skip
    logger.info("vLLM engine start: %.1f s", report["vllm_start_s"])
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    raise SystemExit(main(parser.parse_args()))
