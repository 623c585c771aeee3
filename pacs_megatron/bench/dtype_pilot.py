"""Pilot: does a bf16 actor learn as an fp32 one does from the same rollouts? (issue 56's gate on bf16)

    python -m pacs_megatron.bench.dtype_pilot --model-dir DIR --json pilot.json      # SmolLM2, 3 steps
    python -m pacs_megatron.bench.dtype_pilot --model-dir DIR --steps 1 --overrides rollout.n=4

One process, one rank. The PACS v1 recipe (examples/configs/cpu_smollm2_pacs_v1.yaml: 4 mini-batches a step,
lr 1e-5) draws ``--steps`` rollout batches from the base model once, with an fp32 engine; then an fp32 actor and
a bf16 actor (``model.bf16_rounding`` as configured: stochastic by default) each train on the same batches, one
recipe step per batch, the arms in turn (``--json`` is rewritten after every step: a stopped pilot keeps them).
The update's effect on a batch is each row's change of summed response log-prob,
``delta_i = sum_t (logp_after - logp_before)``, both measured by the actor that trained. Per step it reports
each dtype's mean |delta|, their ratio and their correlation over rows, and the verdict: bf16 learns as fp32
does when, on every step, the ratio lies in [RATIO_LOW, RATIO_HIGH] and the correlation is at least MIN_CORR.
Only bf16's rounding is tested: on a CPU without native bf16 the arithmetic is emulated, the numbers the same
kind (docs/results/smollm2_pacs_cpu_paired/README.md says which CPU ran it).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from pacs_megatron.pacs.registry import POST_PREFIX
from pacs_megatron.utils.cpu import cpu_description
from pacs_megatron.utils.logging import get_logger, init_logging

logger = get_logger("pacs_megatron.bench.dtype_pilot")
RECIPE = Path(__file__).resolve().parents[2] / "examples" / "configs" / "cpu_smollm2_pacs_v1.yaml"
RATIO_LOW, RATIO_HIGH, MIN_CORR = 0.67, 1.5, 0.7
"""The verdict's bounds: bf16's mean |delta| within -33%/+50% of fp32's and a row correlation >= 0.7. A stalled
bf16 update (round-to-nearest at lr 1e-5: docs/benchmarks.md, "bf16 parameters") gives a ratio near 0."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-dir", required=True, help="the SmolLM2 HF directory (model.path; imported if empty)")
    p.add_argument("--config", default=str(RECIPE), help="the recipe (default: PACS v1 on SmolLM2)")
    p.add_argument("--steps", type=int, default=3, help="rollout batches, one recipe step each")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", default="outputs/dtype_pilot", help="the run directory the pieces are built in")
    p.add_argument("--overrides", nargs="*", default=[], help="extra a.b=c of the recipe (both dtypes)")
    p.add_argument("--json", default=None, help="write the report here")


def _config(args: argparse.Namespace, dtype: str):
    from pacs_megatron.config import load_config

    seeds = [f"{k}={args.seed}" for k in ("trainer.seed", "model.seed", "data.seed", "rollout.seed")]
    return load_config(
        args.config,
        [
            f"model.path={args.model_dir}",
            f"model.dtype={dtype}",
            f"trainer.output_dir={args.workdir}",
            "rollout.engine=hf",  # the rollouts' dtype is fp32 whatever the actor's: one engine draws them all
            "algorithm.old_logp_from_forward=false",  # every row's pi_old from one no-grad pass, before and after
            "trainer.sft_warmup_steps=0",
            "logging.progress_bar=false",
            *seeds,
            *args.overrides,
        ],
    )


def row_deltas(cfg, actor, batch) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """One recipe step of ``actor`` on ``batch``: (each row's summed response log-prob change, the rows'
    advantages, the update's metrics). pi_old's and the updated policy's log-probs come from the same pass."""
    from pacs_megatron.loop.update_stages import prepare_local_batch, update_actor

    rows, old, _ = prepare_local_batch(cfg, actor, batch, 0, 1)
    metrics = update_actor(cfg, actor, rows, old, 1)
    mbs = cfg.algorithm.logprob_micro_batch_size or cfg.algorithm.micro_batch_size
    after = actor.compute_logprobs(
        rows, mbs, cfg.rollout.temperature, mini_batch_groups=cfg.mini_batch_prompts, response_only=True
    ).token_logp
    mask = rows.response_mask.float()
    adv = rows.advantages.float()
    if adv.dim() == 2:  # per-token advantages: the row's mean over its response
        adv = (adv * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
    return ((after - old.logp) * mask).sum(-1), adv, metrics


def compare_steps(deltas: dict[str, list[torch.Tensor]]) -> list[dict]:
    """Per step: each dtype's mean |delta|, bf16's over fp32's, and their Pearson correlation over rows.

    Example:
        >>> d = {"float32": [torch.tensor([1.0, -1.0, 2.0])], "bfloat16": [torch.tensor([1.1, -0.9, 2.0])]}
        >>> r = compare_steps(d)[0]
        >>> round(r["ratio"], 3), r["corr"] > 0.99
        (1.0, True)
    """
    out = []
    for step, (a, b) in enumerate(zip(deltas["float32"], deltas["bfloat16"], strict=True), start=1):
        corr = float(torch.corrcoef(torch.stack([a, b]))[0, 1])
        ratio = float(b.abs().mean() / a.abs().mean().clamp(min=1e-12))
        out.append(
            {"step": step, "fp32_mean_abs": float(a.abs().mean()), "bf16_mean_abs": float(b.abs().mean()),
             "ratio": ratio, "corr": corr}
        )  # fmt: skip
    return out


def verdict(steps: list[dict]) -> bool:
    """bf16 learns as fp32 does: every step's ratio within the bounds and its correlation at least MIN_CORR."""
    return all(RATIO_LOW <= s["ratio"] <= RATIO_HIGH and s["corr"] >= MIN_CORR for s in steps)


def run(args: argparse.Namespace) -> dict:
    from pacs_megatron.loop.build import build_actor
    from pacs_megatron.loop.runtime import build_components, setup, teardown
    from pacs_megatron.loop.sources import rollout_source

    cfg32 = _config(args, "float32")
    rt = setup(cfg32)
    c = None
    try:
        c = build_components(cfg32, rt)
        c.sync.sync(version=0)  # the engine holds the actor's fp32 weights, verified
        source = rollout_source(cfg32, c, 0)
        batches = [source.take(step)[0] for step in range(1, args.steps + 1)]
        logger.info("drew %d rollout batches of %d rows (fp32 engine)", len(batches), len(batches[0]))
        # both arms start from the same file; the bf16 one rounds it to bf16 on load, as a bf16 run does
        configs = {"float32": cfg32, "bfloat16": _config(args, "bfloat16")}
        actors = {"float32": c.actor, "bfloat16": build_actor(configs["bfloat16"], rt.groups, str(rt.model_dir))}
        deltas: dict[str, list[torch.Tensor]] = {}
        metrics: dict[str, list[dict]] = {}
        seconds = dict.fromkeys(actors, 0.0)
        for i, batch in enumerate(batches, start=1):  # the arms step by step: a stopped pilot keeps its steps
            for dtype, actor in actors.items():
                start = time.perf_counter()
                delta, adv, m = row_deltas(configs[dtype], actor, batch)
                seconds[dtype] += time.perf_counter() - start
                deltas.setdefault(dtype, []).append(delta)
                metrics.setdefault(dtype, []).append({k: float(v) for k, v in m.items() if k.startswith(POST_PREFIX)})
                logger.info(
                    "step %d, %s: mean |delta| %.4g nats, corr(delta, advantage) %.3f, %.0f s so far",
                    i, dtype, float(delta.abs().mean()), float(torch.corrcoef(torch.stack([delta, adv]))[0, 1]),
                    seconds[dtype],
                )  # fmt: skip
            if args.json:  # after every step: what a stopped pilot measured stays
                report = _report(args, cfg32, batches, deltas, metrics, seconds)
                Path(args.json).write_text(json.dumps(report, indent=1))
        return _report(args, cfg32, batches, deltas, metrics, seconds)
    finally:
        if c is not None:
            c.scorer.close()
            c.engine.close()
        teardown(rt)


def _report(args, cfg, batches, deltas: dict, metrics: dict, seconds: dict) -> dict:
    """The pilot's record so far: its settings, each finished step's comparison and the verdict on them."""
    steps = compare_steps(deltas)
    return {
        "cpu": cpu_description(),
        "torch": torch.__version__,
        "config": args.config,
        "overrides": args.overrides,
        "seed": args.seed,
        "lr": cfg.optimizer.lr,
        "bf16_rounding": cfg.model.bf16_rounding,
        "rows": len(batches[0]),
        "steps": steps,
        "post_update": metrics,
        "seconds": seconds,
        "bounds": {"ratio": [RATIO_LOW, RATIO_HIGH], "min_corr": MIN_CORR},
        "steps_planned": args.steps,
        "bf16_learns_as_fp32": verdict(steps) if len(steps) == args.steps else None,
    }


def main(args: argparse.Namespace) -> int:
    init_logging("INFO")
    report = run(args)
    for s in report["steps"]:
        logger.info(
            "step %d: mean |delta| fp32 %.4g, bf16 %.4g (ratio %.3f), corr %.3f",
            s["step"], s["fp32_mean_abs"], s["bf16_mean_abs"], s["ratio"], s["corr"],
        )  # fmt: skip
    logger.info("bf16 learns as fp32 does: %s (%s)", report["bf16_learns_as_fp32"], report["cpu"])
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_arguments(parser)
    raise SystemExit(main(parser.parse_args()))
