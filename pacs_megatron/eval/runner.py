"""Evaluation as a library: sample n answers per problem, score them, report pass@k per dataset.

    metrics, rows = evaluate(engine, {"math500": records}, sampling, k_list=[1, 4], scorer=scorer)
    metrics["val/math500/pass@1"], metrics["val/overall/pass@1"]        # flat keys, ready for the logger
    write_rollouts(path, rows); compute_metrics(read_rollouts(path), [1, 4])   # recompute from a file

The trainer calls :func:`evaluate` with its already-synced engine; ``sharded=True`` (on every rank) splits
generation over the engine replicas and scoring over ranks, and every rank gets the same metrics. A row is
one problem (the ``eval_rollout.jsonl`` format). ``overall`` is the unweighted mean over datasets (two or
more). The training loop's validation samples in chunks of at least :data:`MIN_CHUNK_SAMPLES` with a
progress line after :data:`QUIET_S` seconds. Rows, metrics and chunks: docs/eval.md, "The library".
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from pacs_megatron.eval.passk import dataset_metrics
from pacs_megatron.reward.rollouts import score_rollouts
from pacs_megatron.reward.verifiers import has_boxed
from pacs_megatron.rollout.multi_turn import turn_metrics
from pacs_megatron.rollout.types import Response, SamplingParams
from pacs_megatron.utils.logging import get_logger

logger = get_logger(__name__)

AVG = "overall"
"""Key of the mean over datasets (a dataset may not use this name)."""
SAMPLING = "sampling"
"""Key of the sampling settings in ``eval_metrics.json`` (a dataset may not use this name either)."""
QUIET_S = 10.0
"""A validation shorter than this prints no progress lines (only its results)."""
CHUNKS = 10
"""Generate calls a sharded validation is split into, for its progress lines (fewer for few samples)."""
MIN_CHUNK_SAMPLES = 128
"""Fewest samples per generate call when chunking: a small validation (the tiny recipe's 25 x 4) stays one
call, sampled exactly as before, and an engine's batch is not cut into slivers."""


def evaluate(
    engine,
    datasets: Mapping[str, Sequence[Any]],
    sampling: SamplingParams,
    k_list: Sequence[int],
    scorer,
    prefix: str = "val",
    sharded: bool = False,
    step: int = 0,
    progress=None,
) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Sample ``sampling.n`` responses per record, score them, and compute pass@k per dataset.

    Args:
        engine: a :class:`~pacs_megatron.rollout.base.RolloutEngine` holding the weights to evaluate.
        datasets: name -> :class:`~pacs_megatron.data.records.PromptRecord` list (``prompt_ids``,
            ``prompt_text``, ``answer``, ``id``, ``problem``, ``extra``).
        sampling: how to sample (``n`` samples per problem, temperature, top_p, max_tokens, seed).
        k_list: the k of the reported pass@k, each in 1..n.
        scorer: a :class:`~pacs_megatron.reward.RewardScorer` (``score(prompts, responses, answers, extras)``).
        prefix: key prefix of the flat metrics ("val" -> ``val/math500/pass@1``; "" -> ``math500/pass@1``).
        sharded: split generation over engine replicas and scoring over ranks (collective: every rank
            must call it); False runs everything in this process.
        step: mixed into the per-replica seeds when sharded (as training steps do).
        progress: an :class:`~pacs_megatron.eval.progress.EvalProgress` (unsharded only): generation
            then runs in chunks of ``progress.chunk`` prompts (seed + chunk index each), reported as
            they finish; None generates everything in one call.

    Returns:
        ``(metrics, rows)``: flat float metrics (plus ``{prefix}/reward_timeouts`` and
        ``{prefix}/reward_errors``), and one row per problem in dataset order.
    """
    check_k(k_list, sampling.n)
    for reserved in (AVG, SAMPLING):
        if reserved in datasets:
            raise ValueError(f"a dataset may not be named {reserved!r} (a reserved key of eval_metrics.json)")
    flat = [(name, rec) for name, recs in datasets.items() for rec in recs]
    if not flat:
        raise ValueError("evaluate: no problems to evaluate")
    prompt_ids = [list(rec.prompt_ids) for _, rec in flat]
    if sharded and progress is None:  # the training loop's validation: progress lines, chunk by chunk
        from pacs_megatron.eval.progress import EvalProgress

        chunk = max(-(-len(prompt_ids) // CHUNKS), -(-MIN_CHUNK_SAMPLES // sampling.n))
        label = f"validation (step {step}):"
        progress = EvalProgress(len(prompt_ids), "samples", chunk, False, label, sampling.n, QUIET_S)
    if progress is None:
        groups = _generate(prompt_ids, engine, sampling, sharded, step)
    else:
        groups = []
        for j, start in enumerate(range(0, len(prompt_ids), progress.chunk)):
            part = prompt_ids[start : start + progress.chunk]
            seed = None if sampling.seed is None else sampling.seed + j
            groups += _generate(part, engine, replace(sampling, seed=seed), sharded, step)
            progress.advance(len(part))
    pairs = [(rec, resp) for (_, rec), group in zip(flat, groups) for resp in group]
    scores, reward_metrics = score_rollouts(
        scorer,
        [rec.prompt_text for rec, _ in pairs],
        [resp.text for _, resp in pairs],
        [rec.answer for rec, _ in pairs],
        [dict(rec.extra) if rec.extra else None for rec, _ in pairs],
        sharded,
    )
    rows = []
    n = sampling.n
    for i, ((name, rec), group) in enumerate(zip(flat, groups)):
        rows.append(
            {
                "id": rec.id,
                "dataset": name,
                "problem": rec.problem,
                "prompt": rec.prompt_text,
                "answer": rec.answer,
                "responses": [r.text for r in group],
                "scores": [float(s) for s in scores[i * n : (i + 1) * n]],
                "finish_reasons": [r.finish_reason for r in group],
                "num_tokens": [len(r.token_ids) for r in group],
                # tool-integrated rollouts: every turn, tool output included (responses hold the policy's own)
                **({"transcripts": [r.turns.transcript for r in group]} if group and group[0].turns else {}),
                # the PACS reference's field names (src/inference.py), for existing analysis scripts
                "data_source": name,
                "output": [r.text for r in group],
                "score": [float(s) for s in scores[i * n : (i + 1) * n]],
            }
        )
    per_set = compute_metrics(rows, k_list)
    if sharded:  # the training loop's validation: its results on the console, not only in metrics.jsonl
        for line in result_lines(per_set):
            logger.info("validation (step %d): %s", step, line)
    metrics = flatten_metrics(per_set, prefix)
    p = f"{prefix}/" if prefix else ""
    for name in datasets:  # tool-integrated rollouts: each set's call rate, turns, errors (none single-turn)
        responses = [r for (ds, _), group in zip(flat, groups) if ds == name for r in group]
        metrics.update({f"{p}{name}/{k}": v for k, v in turn_metrics(responses).items()})
    metrics[f"{p}reward_timeouts"] = float(reward_metrics.get("reward/timeouts", 0.0))
    metrics[f"{p}reward_errors"] = float(reward_metrics.get("reward/errors", 0.0))
    return metrics, rows


def _generate(prompt_ids, engine, sampling: SamplingParams, sharded: bool, step: int) -> list[list[Response]]:
    if sharded:  # a training run's engine (rollout/base.py Generator): every rank gets every group
        return engine.generate_step(prompt_ids, sampling, step)
    groups = engine.generate(prompt_ids, sampling)
    if len(groups) != len(prompt_ids) or any(len(g) != sampling.n for g in groups):
        raise RuntimeError(
            f"engine returned {[len(g) for g in groups]} responses for {len(prompt_ids)} x n={sampling.n}"
        )
    return groups


def compute_metrics(rows: Sequence[Mapping[str, Any]], k_list: Sequence[int]) -> dict[str, dict[str, float]]:
    """Per-dataset metrics (and ``overall``: their mean) of rollout rows, in order of first appearance.

    Example:
        >>> rows = [{"dataset": "d", "scores": [1.0, 0.0]}, {"dataset": "d", "scores": [0.0, 0.0]}]
        >>> compute_metrics(rows, [1, 2])["d"]
        {'pass@1': 0.25, 'pass@2': 0.5, 'mean@n': 0.25, 'n': 2.0, 'num_problems': 2.0}
    """
    by_dataset: dict[str, list[Mapping[str, Any]]] = {}
    for i, row in enumerate(rows):
        for key in ("dataset", "scores"):
            if key not in row:
                raise ValueError(f"rollout row {i} has no {key!r} field")
        by_dataset.setdefault(row["dataset"], []).append(row)
    out: dict[str, dict[str, float]] = {}
    for name, drows in by_dataset.items():
        try:
            m = dataset_metrics([r["scores"] for r in drows], k_list)
        except ValueError as e:
            raise ValueError(f"dataset {name!r}: {e}") from None
        if all("num_tokens" in r for r in drows):
            lengths = [t for r in drows for t in r["num_tokens"]]
            m["response_length"] = sum(lengths) / len(lengths)
        if all("responses" in r for r in drows):
            texts = [t for r in drows for t in r["responses"]]
            m["boxed_rate"] = sum(map(has_boxed, texts)) / max(len(texts), 1)
        if all("finish_reasons" in r for r in drows):
            reasons = [f for r in drows for f in r["finish_reasons"]]
            m["truncation_rate"] = sum(f == "length" for f in reasons) / len(reasons)
        out[name] = m
    if len(out) >= 2:
        shared = set.intersection(*(set(m) for m in out.values())) - {"num_problems", "n"}
        avg = {k: sum(m[k] for m in out.values()) / len(out) for k in next(iter(out.values())) if k in shared}
        avg["num_problems"] = float(sum(m["num_problems"] for m in out.values()))
        out[AVG] = avg
    return out


def result_lines(per_set: Mapping[str, Mapping[str, float]]) -> list[str]:
    """One console line per set: pass@k, mean@n, boxed rate, truncation rate, response length.

    Example:
        >>> result_lines({"gsm8k": {"pass@1": 0.25, "pass@4": 0.5, "mean@n": 0.25, "n": 4.0, "num_problems": 40.0,
        ...                         "boxed_rate": 0.9, "truncation_rate": 0.05, "response_length": 120.5}})
        ['gsm8k: pass@1=0.250 pass@4=0.500 boxed=0.90 truncated=0.05 length=120 (40 problems x 4)']
    """
    out = []
    for name, m in per_set.items():
        parts = [f"{k}={v:.3f}" for k, v in m.items() if k.startswith("pass@")]
        parts += [
            f"{short}={m[k]:.2f}" for k, short in (("boxed_rate", "boxed"), ("truncation_rate", "truncated")) if k in m
        ]
        if "response_length" in m:
            parts.append(f"length={m['response_length']:.0f}")
        samples = f" x {int(m['n'])}" if "n" in m else ""
        out.append(f"{name}: {' '.join(parts)} ({int(m['num_problems'])} problems{samples})")
    return out


def flatten_metrics(metrics: Mapping[str, Mapping[str, float]], prefix: str = "val") -> dict[str, float]:
    """``{"math500": {"pass@1": x}}`` -> ``{"val/math500/pass@1": x}``.

    Example:
        >>> flatten_metrics({"d": {"pass@1": 0.5}})
        {'val/d/pass@1': 0.5}
    """
    p = f"{prefix}/" if prefix else ""
    return {f"{p}{name}/{k}": float(v) for name, m in metrics.items() for k, v in m.items()}


def write_rollouts(path: str | Path, rows: Sequence[Mapping[str, Any]]) -> None:
    """One JSON object per line, written to a temporary file and renamed (never a half-written file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def read_rollouts(path: str | Path) -> list[dict[str, Any]]:
    """Rows of an ``eval_rollout.jsonl``; a bad line raises naming the file and line."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{i}: not valid JSON ({e.msg}); delete the file to re-sample") from None
            if not isinstance(row, dict) or not isinstance(row.get("scores"), list) or "dataset" not in row:
                raise ValueError(f"{path}:{i}: a rollout row needs 'dataset' and a 'scores' list")
            rows.append(row)
    if not rows:
        raise ValueError(f"{path} holds no rollout rows; delete it to re-sample")
    return rows


def write_metrics(path: str | Path, metrics: Mapping[str, Any]) -> None:
    """``eval_metrics.json`` (pretty-printed, written atomically)."""
    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(metrics, indent=2, sort_keys=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def check_k(k_list, n: int) -> None:
    """Raise a clear ValueError unless ``k_list`` is non-empty and every k is in 1..n."""
    if n < 1:
        raise ValueError(f"n={n}: sample at least one response per problem")
    if not k_list:
        raise ValueError("k list is empty: give at least one k, e.g. --k 1")
    bad = [k for k in k_list if not 1 <= k <= n]
    if bad:
        raise ValueError(f"k={bad} outside 1..n={n}: pass@k needs at least k samples per problem (raise --n)")


def parse_k_list(text: str) -> list[int]:
    """``"1,4,16"`` -> ``[1, 4, 16]`` (sorted, unique), with a clear error for anything else.

    Example:
        >>> parse_k_list("16, 1,4,4")
        [1, 4, 16]
    """
    try:
        ks = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise ValueError(f"--k {text!r}: give comma-separated integers, e.g. --k 1,4,16") from None
    if not ks:
        raise ValueError(f"--k {text!r}: give at least one k")
    return ks
