"""``pacs-megatron parity``: Megatron log-probs vs Hugging Face transformers on the same sequences.

    pacs-megatron parity --hf-model DIR --tp 2 --pp 2 [--ep 2] [--data FILE] [--out FILE] [--tolerance 1e-4]

Loads the HF checkpoint into the Megatron actor with the given layout, computes per-token log-probs
of sample sequences (``--data``: JSONL rows with ``prompt_ids`` and ``response_ids``; else built-in
pseudo-random ones), computes the same with transformers (fp32, CPU, on rank 0) and reports the max
absolute difference per token (response tokens) and per sequence (sum over the response). Exit code
1 when a difference exceeds ``--tolerance`` (a sequence also passes when its difference relative to
HF's sequence log-prob is at most ``--rtol``: sums of long random sequences are of order 10^2).
Under torchrun the ranks exist; started by hand it
spawns ``tp * pp * dp`` local ranks itself, dp the smallest data-parallel size that EP fits in
(``--ep 2 --tp 1``: two ranks; EP ranks are drawn from the TP x DP ranks). The arguments are checked
before any rank starts (:func:`check_args`: the model directory as every command checks it, the layout
against its heads, layers and experts, ``--data`` readable, ``--out`` writable): one line, exit 2.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from pacs_megatron.launch.local import on_ranks
from pacs_megatron.utils.logging import get_logger, init_logging

if TYPE_CHECKING:
    import torch

logger = get_logger(__name__)

BUILTIN_SEED = 20250902


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hf-model", required=True, help="Hugging Face model directory (config.json + safetensors)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size (MoE models)")
    p.add_argument("--data", default=None, help="JSONL with prompt_ids and response_ids per row (default: built-in)")
    p.add_argument("--out", default=None, help="write one JSONL row per input with both models' log-probs")
    p.add_argument("--tolerance", type=float, default=1e-4, help="max allowed |megatron - hf| (per token and sequence)")
    p.add_argument("--rtol", type=float, default=1e-5, help="a sequence also passes at |d| / |hf seq log-prob| <= rtol")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="Megatron's dtype (bf16: GPU)")


def _argv(args: argparse.Namespace) -> list[str]:
    argv = ["pacs_megatron", "parity", "--hf-model", args.hf_model, "--tp", str(args.tp), "--pp", str(args.pp)]
    argv += ["--ep", str(args.ep)]
    argv += ["--tolerance", repr(args.tolerance), "--rtol", repr(args.rtol), "--dtype", args.dtype]
    for flag, value in (("--data", args.data), ("--out", args.out)):
        if value:
            argv += [flag, value]
    return argv


def load_samples(path: str | None, vocab_size: int) -> list[tuple[list[int], list[int]]]:
    """(prompt_ids, response_ids) pairs from a JSONL file, or 6 built-in pseudo-random sequences."""
    from pacs_megatron.data.records import DataFormatError

    if path:
        rows = []
        for i, line in enumerate(Path(path).read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if line.strip():
                try:
                    rec = json.loads(line)
                    ids = [int(t) for t in rec["prompt_ids"]], [int(t) for t in rec["response_ids"]]
                except (ValueError, KeyError, TypeError) as e:
                    raise DataFormatError(
                        f"--data {path}:{i}: each row needs 'prompt_ids' and 'response_ids' lists of token ids ({e})"
                    ) from None
                bad = [t for t in (*ids[0], *ids[1]) if not 0 <= t < vocab_size]
                if bad:
                    raise DataFormatError(
                        f"--data {path}:{i}: token id {bad[0]} outside the vocabulary 0..{vocab_size - 1}"
                    )
                rows.append(ids)
        if not rows:
            raise DataFormatError(f"--data {path} has no rows")
        return rows
    import torch  # here, not at the top: `parity --help` imports no torch

    g = torch.Generator().manual_seed(BUILTIN_SEED)
    lengths = [(3, 5), (8, 12), (5, 1), (16, 20), (2, 9), (11, 7)]
    return [
        (
            torch.randint(0, vocab_size, (p,), generator=g).tolist(),
            torch.randint(0, vocab_size, (r,), generator=g).tolist(),
        )
        for p, r in lengths
    ]


def hf_token_logprobs(model_dir: str, input_ids: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` fp32 log-probs from transformers (column 0 = 0), right padding needs no mask."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=input_ids).logits.float()
    lp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    return torch.nn.functional.pad(lp, (1, 0))


def _report(
    rows, batch, meg: torch.Tensor, ref: torch.Tensor, tolerance: float, out: str | None, rtol: float = 0.0
) -> bool:
    from rich.console import Console
    from rich.table import Table

    mask = batch.response_mask
    table = Table(title=f"Megatron vs HF log-probs (tolerance {tolerance:g})")
    for col in ("row", "prompt", "response", "max |d| per token", "|d| sequence"):
        table.add_column(col, justify="right")
    worst_tok = worst_seq = worst_rel = 0.0
    seq_ok = True
    records = []
    for b, (prompt, response) in enumerate(rows):
        m = mask[b]
        d_tok = (meg[b] - ref[b]).abs()[m]
        tok = float(d_tok.max()) if d_tok.numel() else 0.0
        seq_meg, seq_ref = float(meg[b][m].sum()), float(ref[b][m].sum())
        seq = abs(seq_meg - seq_ref)
        rel = seq / max(abs(seq_ref), 1e-30)
        worst_tok, worst_seq, worst_rel = max(worst_tok, tok), max(worst_seq, seq), max(worst_rel, rel)
        seq_ok = seq_ok and (seq <= tolerance or rel <= rtol)
        table.add_row(str(b), str(len(prompt)), str(len(response)), f"{tok:.3e}", f"{seq:.3e}")
        records.append(
            {
                "prompt_ids": prompt,
                "response_ids": response,
                "megatron_token_logp": meg[b][m].tolist(),
                "megatron_seq_logp": seq_meg,
                "hf_token_logp": ref[b][m].tolist(),
                "hf_seq_logp": seq_ref,
                "max_abs_diff_token": tok,
                "abs_diff_seq": seq,
            }
        )
    Console(stderr=True).print(table)
    ok = worst_tok <= tolerance and seq_ok
    logger.info(
        "parity %s: max |megatron - hf| per token %.3e, per sequence %.3e (relative %.1e) (tolerance %g, rtol %g)",
        "OK" if ok else "FAILED",
        worst_tok,
        worst_seq,
        worst_rel,
        tolerance,
        rtol,
    )
    if out:
        Path(out).write_text("".join(json.dumps(r) + "\n" for r in records))
    return ok


def min_dp(tp: int, ep: int) -> int:
    """Smallest data-parallel size with ep dividing tp * dp."""
    return ep // math.gcd(tp, ep)


def run(args: argparse.Namespace) -> int:
    """One rank's work (under a launcher)."""
    import torch
    import torch.distributed as dist

    from pacs_megatron.actor.actor import MegatronActor
    from pacs_megatron.actor.sections import ActorSections, TrainView
    from pacs_megatron.batch.build import build_rollouts
    from pacs_megatron.config import (
        ActorConfig,
        AlgorithmConfig,
        DataConfig,
        ModelConfig,
        OptimizerConfig,
        ParallelConfig,
        RolloutConfig,
        TrainerConfig,
    )
    from pacs_megatron.parallel import destroy_parallel, init_distributed, initialize_parallel

    hf = json.loads((Path(args.hf_model) / "config.json").read_text())
    init_distributed(ParallelConfig(tp=args.tp, pp=args.pp))
    # Extra ranks (world > tp * pp) become data-parallel replicas that compute the same rows.
    dp = max(1, dist.get_world_size() // (args.tp * args.pp))
    par = ParallelConfig(tp=args.tp, pp=args.pp, dp=dp, ep=args.ep)
    groups = initialize_parallel(par, hf, training=False)  # forward passes only
    # The actor's own sections: this model and layout, every other section a run's default (its micro-batching).
    train = TrainView.of(AlgorithmConfig(), RolloutConfig(), DataConfig(), TrainerConfig())
    model = ModelConfig(path=args.hf_model, dtype=args.dtype)
    sections = ActorSections(model, par, ActorConfig(), OptimizerConfig(), train)
    try:
        actor = MegatronActor(sections, groups, args.hf_model)
        rows = load_samples(args.data, actor.spec.vocab_size)
        batch = build_rollouts([p for p, _ in rows], [r for _, r in rows], [0.0] * len(rows), 1, pad_id=0)
        meg = actor.compute_logprobs(batch, micro_batch_size=len(batch), temperature=1.0).token_logp
        ok = True
        if groups.rank == 0:
            ref = hf_token_logprobs(args.hf_model, batch.input_ids)
            ok = _report(rows, batch, meg, ref, args.tolerance, args.out, args.rtol)
        flag = torch.tensor([0 if ok else 1], device=groups.device)
        dist.broadcast(flag, src=0)
        return int(flag.item())
    finally:
        destroy_parallel()


def check_args(args: argparse.Namespace) -> None:
    """Every argument, before any rank starts or any model loads; ConfigError naming the flag and the fix."""
    from pacs_megatron.config import ConfigError, ParallelConfig
    from pacs_megatron.launch.model_dir import check_model_dir
    from pacs_megatron.parallel import check_layout
    from pacs_megatron.utils.paths import check_readable_file, check_writable_file

    for flag, value in (("--tp", args.tp), ("--pp", args.pp), ("--ep", args.ep)):
        if value < 1:
            raise ConfigError(f"{flag} {value} must be >= 1")
    for flag, value in (("--tolerance", args.tolerance), ("--rtol", args.rtol)):
        if not value >= 0:
            raise ConfigError(f"{flag} {value} must be >= 0")
    hf = check_model_dir("--hf-model", args.hf_model, tokenizer=False)  # weights readable and agreeing
    try:
        par = ParallelConfig(tp=args.tp, pp=args.pp, dp=min_dp(args.tp, args.ep), ep=args.ep)
        check_layout(par, hf, training=False)
    except ConfigError as e:
        flags = (("parallel.tp", "--tp"), ("parallel.pp", "--pp"), ("parallel.ep", "--ep"), ("parallel.dp", "dp"))
        msg = str(e)
        for key, flag in flags:
            msg = msg.replace(key, flag)
        raise ConfigError(msg) from None
    if args.data:
        check_readable_file("--data", args.data)
    if args.out:
        check_writable_file("--out", args.out)


def main(args: argparse.Namespace) -> int:
    init_logging()
    check_args(args)
    return on_ranks(_argv(args), args.tp * args.pp * min_dp(args.tp, args.ep), lambda: run(args))


if __name__ == "__main__":
    from pacs_megatron.cli import run as run_command

    sys.exit(run_command("parity", sys.argv[1:], prog="pacs_megatron.tools.parity"))
