"""The TRL side of bench/rl_step.py: one ``trl.GRPOTrainer`` run in this (child) process, timed per step.

    python -m pacs_megatron.bench.trl_step --model DIR --prompts FILE.jsonl --steps 4 --dtype float32 --out OUT.json

TRL is the benchmark's optional extra (``pip install -e ".[bench-trl]"``, trl==1.16.0), never a dependency of
the package: only this module imports it. The run is what a TRL user picks for this job: GRPOTrainer on the same
HF directory, the same raw prompts in the same order (no chat template, no shuffling), ``num_generations=n``,
one generation batch of ``prompts x n`` completions per optimizer step (``per_device_train_batch_size``), at most
``max_tokens`` new tokens at T=1, the same learning rate, no weight decay, grad-norm clip 1, no KL term (TRL's
default beta=0), one update per generation (TRL then skips its old-log-prob pass, as pi_old = pi_theta), the
math-verify reward of this project in the trainer's process. ``--dtype bfloat16`` sets TRL's ``bf16=True``
(autocast); float32 sets ``bf16=False``. Everything else is TRL's default, gradient checkpointing included.

Per step: wall and process-CPU time of the whole step, of generation (``_generate_single_turn``) and of
``_generate_and_score_completions`` (generation + rewards + advantages); the update is the rest. Tokens are
TRL's own count (prompt + completion tokens, ``num_input_tokens_seen``); memory as utils/memory.py (the
step's own high-water mark, and what it held beyond the RSS at its start).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from pacs_megatron.utils.memory import peak_rss_bytes, reset_peak_rss, rss_bytes


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="Hugging Face model directory")
    p.add_argument("--prompts", required=True, help="JSONL rows {prompt, answer}, used in file order")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--prompts-per-step", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--loss-type", default="grpo", help="TRL loss_type (token aggregation)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="JSON file for the per-step records")


class _Clock:
    """Accumulates wall and CPU seconds of named calls within the current step."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str):
        w, c = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            self.spent[f"{name}_s"] = self.spent.get(f"{name}_s", 0.0) + time.perf_counter() - w
            self.spent[f"{name}_cpu_s"] = self.spent.get(f"{name}_cpu_s", 0.0) + time.process_time() - c


def _timed(obj, method: str, clock: _Clock, name: str) -> None:
    original = getattr(obj, method)

    def wrapper(*args, **kwargs):
        with clock(name):
            return original(*args, **kwargs)

    setattr(obj, method, wrapper)


def run(args: argparse.Namespace) -> list[dict]:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from pacs_megatron.reward.verifiers import math_reward

    rows = [json.loads(line) for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    rows = rows[: args.steps * args.prompts_per_step]
    dataset = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows])

    def reward(prompts, completions, answer, **_):  # noqa: ARG001 - TRL's reward signature
        return [math_reward(c, a) for c, a in zip(completions, answer)]

    batch = args.prompts_per_step * args.n
    config = GRPOConfig(
        output_dir=str(Path(args.out).with_suffix(".trl")),
        use_cpu=True,
        bf16=args.dtype == "bfloat16",
        learning_rate=args.lr,
        weight_decay=0.0,
        max_grad_norm=1.0,
        lr_scheduler_type="constant",
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=1,
        num_generations=args.n,
        max_completion_length=args.max_tokens,
        temperature=1.0,
        num_iterations=1,
        beta=0.0,
        loss_type=args.loss_type,
        shuffle_dataset=False,
        max_steps=args.steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=args.seed,
        dataloader_num_workers=0,
    )
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    clock = _Clock()
    records: list[dict] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, targs, state, control, **kw):  # noqa: ARG002
            clock.spent.clear()
            reset_peak_rss()
            self.base, self.tokens = rss_bytes(), state.num_input_tokens_seen
            self.wall, self.cpu = time.perf_counter(), time.process_time()

        def on_step_end(self, targs, state, control, **kw):  # noqa: ARG002
            rec = dict(clock.spent)
            rec.update(
                step=state.global_step,
                step_s=time.perf_counter() - self.wall,
                step_cpu_s=time.process_time() - self.cpu,
                tokens=float(state.num_input_tokens_seen - self.tokens),
                peak_rss_gb=peak_rss_bytes() / 1e9,
                step_rss_gb=(peak_rss_bytes() - self.base) / 1e9,
            )
            records.append(rec)

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[StepTimer()],
    )
    _timed(trainer, "_generate_single_turn", clock, "generate")
    _timed(trainer, "_generate_and_score_completions", clock, "rollout")
    trainer.train()
    return records


def main(args: argparse.Namespace) -> int:
    records = run(args)
    Path(args.out).write_text(json.dumps(records, indent=1))
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="pacs_megatron.bench.trl_step", description=__doc__.splitlines()[0])
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
