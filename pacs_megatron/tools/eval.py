"""``pacs-megatron eval``: n samples per problem, verifiable rewards, unbiased pass@k per dataset.

    pacs-megatron eval --model CKPT_HF_DIR --data math500,aime2024,aime2025,amc23 --n 16 --k 1,4,16 \\
        --max-tokens 4096 --temperature 0.6 --top-p 0.95 [--engine hf|vllm] [--out DIR] [--limit N]

Writes ``eval_rollout.jsonl`` (a row per problem) and ``eval_metrics.json`` (per dataset and ``overall``)
into ``--out`` or the model directory, as the PACS reference does. Rollouts are cached under a key
(:mod:`pacs_megatron.eval.cache`): the same key only recomputes the metrics, another samples anew and says
what changed (``--reuse``, ``--resample`` override). ``--tool-turns N`` evaluates a tool-integrated policy
as the trainer's validation does. Every flag is checked before anything is sampled (one line, exit 2).
Files, cache, tools and prompts: docs/eval.md.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from pacs_megatron.config import ConfigError, RolloutConfig
from pacs_megatron.config.multi_turn import MultiTurnConfig
from pacs_megatron.config.tools import ToolsConfig
from pacs_megatron.eval.cache import cache_key, differences, read_key, write_key
from pacs_megatron.eval.progress import EvalProgress
from pacs_megatron.eval.runner import (
    SAMPLING,
    check_k,
    compute_metrics,
    evaluate,
    parse_k_list,
    read_rollouts,
    write_metrics,
    write_rollouts,
)
from pacs_megatron.launch.model_dir import check_model_dir
from pacs_megatron.utils.logging import get_logger, init_logging
from pacs_megatron.utils.paths import check_writable_dir
from pacs_megatron.utils.preemption import unwind_on_signals

logger = get_logger(__name__)

ROLLOUT_FILE = "eval_rollout.jsonl"
METRICS_FILE = "eval_metrics.json"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="Hugging Face model directory (config.json + safetensors)")
    p.add_argument(
        "--data",
        default="math500,aime2024,aime2025,amc23",
        help="comma-separated shared set names (math500, aime2024, aime2025, amc23, gsm8k_test, ...) or file paths",
    )
    p.add_argument("--n", type=int, default=16, help="samples per problem")
    p.add_argument("--k", default="1,4,16", help="comma-separated k of the reported pass@k (each <= n)")
    p.add_argument("--max-tokens", type=int, default=4096, help="most tokens per response")
    p.add_argument("--temperature", type=float, default=0.6, help="sampling temperature (0: greedy)")
    p.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling mass")
    p.add_argument("--top-k", type=int, default=-1, help="top-k sampling; -1 disables it")
    p.add_argument("--engine", choices=("hf", "vllm"), default="hf", help="rollout engine")
    p.add_argument("--device", default="auto", help="'auto' (cuda if available), 'cpu' or 'cuda[:i]'")
    p.add_argument(
        "--dtype", choices=("auto", "float32", "bfloat16"), default="auto", help="engine dtype (auto: fp32 on CPU)"
    )
    p.add_argument("--batch-size", type=int, default=64, help="hf engine: prompts per generate call")
    p.add_argument("--out", default=None, help="output folder (default: the model directory)")
    p.add_argument("--limit", type=int, default=0, help="first N problems of each set (0: all)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: --model)")
    p.add_argument(
        "--chat-template",
        choices=("auto", "model", "qwen2.5", "none"),
        default="auto",
        help="as data.chat_template: auto (the tokenizer's own; Qwen2.5 ChatML for a Qwen2 tokenizer without one), "
        "model, qwen2.5, none",
    )
    p.add_argument(
        "--shots",
        type=_shots,
        default=[],
        help='as data.shots: worked examples before each problem, JSON [["problem", "response"], ...]',
    )
    p.add_argument("--data-root", default="", help="folder of the shared sets (default: $PACS_DATA_ROOT)")
    p.add_argument("--max-prompt-length", type=int, default=8192, help="longer prompts are dropped (logged)")
    p.add_argument("--reward", default="math", help="'math', 'math_boxed', 'arith' or 'package.module:function'")
    p.add_argument("--reward-workers", type=int, default=2, help="reward processes (0: one)")
    p.add_argument("--reward-timeout", type=float, default=10.0, help="per-response reward timeout (s)")
    p.add_argument("--resample", action="store_true", help="sample again even if eval_rollout.jsonl exists")
    p.add_argument(
        "--reuse", action="store_true", help="recompute from eval_rollout.jsonl even if it was sampled differently"
    )
    p.add_argument(
        "--tool-turns",
        type=int,
        default=0,
        help="tool-integrated evaluation: up to N assistant turns, calling --tools in the sandbox between them "
        "(as rollout.multi_turn.max_turns; the tools: section's defaults); 0: single-turn",
    )
    p.add_argument("--tools", default="python", help="with --tool-turns: comma-separated tools (as tools.enabled)")
    p.add_argument(
        "--tool-sandbox",
        default="auto",
        help="with --tool-turns: the sandbox level (as tools.sandbox): auto (bubblewrap, or a refusal naming the "
        "install) or rlimits-trusted (root only, host files readable: docs/tools.md)",
    )
    p.add_argument(
        "--tool-instruction",
        default=MultiTurnConfig.instruction,
        help="with --tool-turns: appended to each prompt (as rollout.multi_turn.instruction; '' for none)",
    )
    p.add_argument("--log-level", default="INFO")


def _tool_configs(args: argparse.Namespace) -> tuple[MultiTurnConfig, ToolsConfig]:
    """``--tool-turns`` / ``--tools`` / ``--tool-instruction`` as the trainer's configs (checked by
    :func:`_check_tools` first)."""
    mt = MultiTurnConfig(max_turns=args.tool_turns, instruction=args.tool_instruction)
    enabled = tuple(t.strip() for t in args.tools.split(",") if t.strip())
    return mt, ToolsConfig(enabled=enabled, sandbox=getattr(args, "tool_sandbox", "auto"))


def _tool_sandbox(args: argparse.Namespace) -> dict | None:
    """With ``--tool-turns``: the sandbox level in force and its limits (envs/levels.py record), logged and kept
    with the rollouts' sampling settings (eval_metrics.json "sampling"); None without tools."""
    if args.tool_turns <= 0:
        return None
    from pacs_megatron.envs.sandbox import Sandbox

    record = Sandbox.from_config(_tool_configs(args)[1]).record()
    logger.info("tool sandbox: %s; NOT enforced: %s", record["level"], "; ".join(record["not_enforced"]))
    return record


def _check_tools(args: argparse.Namespace) -> None:
    """The tool flags as configs and, with ``--tool-turns``, the trainer's preflight of tools (they load, the
    sandbox starts here, the chat template renders a tool turn), before any model loads; one line naming the
    flags."""
    from pacs_megatron.config import DataConfig, ModelConfig, RunConfig
    from pacs_megatron.launch.checks.tools import check_tools

    try:
        multi_turn, tools = _tool_configs(args)
        if multi_turn.enabled:
            check_tools(
                RunConfig(
                    model=ModelConfig(path=args.model, tokenizer=args.tokenizer or ""),
                    data=DataConfig(chat_template=args.chat_template),
                    rollout=RolloutConfig(multi_turn=multi_turn),
                    tools=tools,
                )
            )
    except ConfigError as e:
        msg = str(e).replace("tools.sandbox=", "--tool-sandbox ")  # the flag that sets it here
        raise ConfigError(f"--tool-turns {args.tool_turns} --tools {args.tools!r}: {msg}") from None


def validate(args: argparse.Namespace) -> list[int]:
    """Check the flags before any model loads; the k list, or ConfigError naming the flag."""
    from pacs_megatron.launch.checks.device import check_engine_installed
    from pacs_megatron.launch.checks.preflight import check_reward_fn

    if args.n < 1:
        raise ConfigError(f"--n {args.n}: sample at least one response per problem")
    try:
        ks = parse_k_list(args.k)
        check_k(ks, args.n)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    for flag, value, ok, need in (
        ("--max-tokens", args.max_tokens, args.max_tokens >= 1, ">= 1"),
        ("--temperature", args.temperature, args.temperature >= 0, ">= 0 (0: greedy)"),
        ("--top-p", args.top_p, 0 < args.top_p <= 1, "in (0, 1]"),
        ("--limit", args.limit, args.limit >= 0, ">= 0 (0: all problems)"),
        ("--batch-size", args.batch_size, args.batch_size >= 1, ">= 1"),
    ):
        if not ok:
            raise ConfigError(f"{flag} {value} must be {need}")
    if args.temperature == 0 and args.n > 1:
        logger.warning("--temperature 0 is greedy: the %d samples of a problem will be identical", args.n)
    if not [d for d in args.data.split(",") if d.strip()]:
        raise ConfigError("--data is empty: name at least one set, e.g. --data math500")
    check_reward_fn("--reward", args.reward)  # before any model loads
    _check_tools(args)
    _check_device(args.device)
    check_engine_installed(RolloutConfig(engine=args.engine))
    return ks


def _check_device(device: str) -> None:
    """``--device``: auto, cpu, or a CUDA device this machine has."""
    import torch

    if device == "auto":
        return
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ConfigError(f"--device {device}: not a device; use auto, cpu or cuda[:i]") from None
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"--device {device}: use auto, cpu or cuda[:i]")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {device}: this machine has no CUDA device; use --device cpu (or auto)")
    if dev.type == "cuda" and (dev.index or 0) >= torch.cuda.device_count():
        raise ConfigError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")


def progress_chunk(engine: str, batch_size: int, total: int) -> int:
    """Problems per generate call, so that a long eval prints ~20 progress lines.

    vLLM takes a twentieth of the problems a call (at least ``--batch-size``: its batches are cheap). The HF
    engine takes a twentieth too but never more than its ``--batch-size``: 64 problems x 16 samples on a CPU
    were minutes without a line (issue 42).

    Example:
        >>> progress_chunk("hf", 64, 500), progress_chunk("vllm", 64, 500), progress_chunk("hf", 64, 30)
        (25, 64, 2)
    """
    twentieth = -(-total // 20)
    return min(batch_size, twentieth) if engine == "hf" else max(batch_size, twentieth)


def main(args: argparse.Namespace) -> int:
    init_logging(args.log_level)
    # SIGTERM stops eval as Ctrl-C does; a second one ends it at once, even inside a long generate
    unwind_on_signals("the evaluation stopped before its results were written")
    ks = validate(args)
    model_dir = Path(args.model)
    out_dir = Path(args.out) if args.out else model_dir
    check_writable_dir("--out", out_dir)  # before sampling: a result that cannot be written is never computed
    rollout_path, metrics_path = out_dir / ROLLOUT_FILE, out_dir / METRICS_FILE
    data_cfg = _data_config(args)
    _check_data_root(args, data_cfg)  # before the cache and the model: a mistyped set name is one line
    key = cache_key(args, model_dir, data_cfg.resolved_root())

    cached = read_key(rollout_path) if rollout_path.is_file() else None
    changed = differences(cached, key) if rollout_path.is_file() else []
    if rollout_path.is_file() and not args.resample and (not changed or args.reuse):
        if changed:
            logger.warning("--reuse: recomputing from %s although it differs: %s", rollout_path, "; ".join(changed))
        else:
            logger.info("found %s sampled with these settings: recomputing metrics only", rollout_path)
        key = cached or key
        try:
            rows = read_rollouts(rollout_path)
            metrics = compute_metrics(rows, ks)
        except ValueError as e:
            n = (cached or {}).get("n", "?")
            raise ConfigError(f"{rollout_path}: {e} (its rollouts hold n={n} samples per problem)") from None
    else:
        if changed and not args.resample:
            logger.info("sampling anew: %s was sampled with other settings (%s)", rollout_path, "; ".join(changed))
        # weights readable and agreeing with config.json, a tokenizer: launch/model_dir.py, as every command
        check_model_dir("--model", model_dir, tokenizer_key="--tokenizer", tokenizer_dir=args.tokenizer)
        metrics, rows = _sample_and_score(args, ks, model_dir, data_cfg)
        sandbox = _tool_sandbox(args)
        key = key if sandbox is None else {**key, "tool_sandbox": sandbox}  # a fresh key has none: never compared
        write_rollouts(rollout_path, rows)
        write_key(rollout_path, key)
        logger.info("wrote %d rollout rows to %s", len(rows), rollout_path)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_metrics(metrics_path, {**metrics, SAMPLING: key})
    for name, m in metrics.items():
        shown = ", ".join(f"{k}={v:.4f}" for k, v in m.items() if k.startswith(("pass@", "mean@", "tools/call")))
        logger.info("%-12s %s (%d problems)", name, shown, int(m["num_problems"]))
    logger.info("wrote %s", metrics_path)
    return 0


def _shots(text: str) -> list[list[str]]:
    """``--shots`` JSON -> [[problem, response], ...] (DataConfig checks the pairs)."""
    import json

    try:
        shots = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e})") from None
    if not isinstance(shots, list):
        raise argparse.ArgumentTypeError("give a JSON list of [problem, response] pairs")
    return shots


def _data_config(args: argparse.Namespace):
    from pacs_megatron.config import DataConfig

    return DataConfig(
        data_root=args.data_root,
        chat_template=args.chat_template,
        shots=args.shots,
        max_prompt_length=args.max_prompt_length,
        overlong_prompts="drop",
        bad_records="error",
    )


def _check_data_root(args: argparse.Namespace, data_cfg) -> None:
    """Each ``--data`` entry is a shared set name whose file is under the data root, or an existing file: said
    in eval's own terms (--data-root, not data.data_root), with the closest set names for a typo."""
    import difflib

    from pacs_megatron.data.sources import DATASETS

    root = data_cfg.resolved_root()
    for spec in (d.strip() for d in args.data.split(",") if d.strip()):
        if spec not in DATASETS and not Path(spec).is_file():
            close = difflib.get_close_matches(spec, list(DATASETS), n=3, cutoff=0.6)
            hint = f"did you mean {' or '.join(close)}?" if close else f"the shared sets are {', '.join(DATASETS)}"
            raise ConfigError(f"--data {spec!r}: neither a known name nor an existing file; {hint}")
        if spec in DATASETS and not (root / DATASETS[spec]).is_file():
            raise ConfigError(
                f"--data {spec}: {root / DATASETS[spec]} does not exist; pass --data-root (or set $PACS_DATA_ROOT) "
                "to the folder holding eval/ and train/"
            )


def _vllm_run_config(run_cfg, args: argparse.Namespace, datasets: dict):
    """``--engine vllm`` (CPU or GPU): vLLM's ``max_model_len`` from the longest prompt + ``--max-tokens``,
    checked against the model's ``max_position_embeddings`` as the trainer's preflight does."""
    from dataclasses import replace

    from pacs_megatron.launch.checks.preflight import check_vllm_context

    longest = max((len(r.prompt_ids) for recs in datasets.values() for r in recs), default=1)
    run_cfg = replace(
        run_cfg,
        data=replace(run_cfg.data, max_prompt_length=longest),
        rollout=replace(run_cfg.rollout, max_response_length=args.max_tokens),
    )
    check_vllm_context(run_cfg)
    return run_cfg


def _sample_and_score(args: argparse.Namespace, ks: list[int], model_dir: Path, data_cfg):
    import torch

    from pacs_megatron.config import ModelConfig, RunConfig
    from pacs_megatron.data import load_dataset, load_tokenizer
    from pacs_megatron.data.factory import check_row_tools
    from pacs_megatron.loop.build import build_rollout_engine, prompt_run, with_run_tools

    tokenizer = load_tokenizer(args.tokenizer or model_dir, args.chat_template)
    multi_turn, tools = _tool_configs(args)
    run_cfg = RunConfig(
        model=ModelConfig(path=str(model_dir), dtype=args.dtype),
        data=data_cfg,
        rollout=RolloutConfig(engine=args.engine, batch_size=args.batch_size, seed=args.seed, multi_turn=multi_turn),
        tools=tools,
    )
    datasets = {}
    for spec in (d.strip() for d in args.data.split(",") if d.strip()):
        name, records = load_dataset(
            spec, data_cfg, tokenizer, limit=args.limit, suffix=prompt_run(run_cfg).instruction
        )
        if name in datasets:
            raise ConfigError(f"--data names {name!r} twice")
        datasets[name] = check_row_tools(records, prompt_run(run_cfg).tools, name)
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    records = [r for recs in datasets.values() for r in recs]

    def engine(cfg: RunConfig):
        return with_run_tools(build_rollout_engine(cfg, model_dir, tokenizer, device), cfg, tokenizer, records)

    if args.engine == "vllm":
        from pacs_megatron.rollout.vllm.engine import single_rank_launcher_env

        run_cfg = _vllm_run_config(run_cfg, args, datasets)
        with single_rank_launcher_env():  # a world of one rank for vLLM's external launcher, unless torchrun
            return _sample_with(engine(run_cfg), args, ks, datasets, device)
    return _sample_with(engine(run_cfg), args, ks, datasets, device)


def _sample_with(engine, args: argparse.Namespace, ks: list[int], datasets: dict, device):
    from pacs_megatron.config import RewardConfig
    from pacs_megatron.reward import RewardScorer
    from pacs_megatron.rollout.types import SamplingParams

    greedy = args.temperature == 0  # the engines sample; top_k=1 at T=1 is greedy decoding
    sampling = SamplingParams(
        n=args.n,
        temperature=1.0 if greedy else args.temperature,
        top_p=args.top_p,
        top_k=1 if greedy else args.top_k,
        max_tokens=args.max_tokens,
        seed=args.seed,
    )
    total = sum(len(r) for r in datasets.values())
    logger.info(
        "sampling %d x %d responses (%s) with %s on %s", total, args.n, ", ".join(datasets), args.engine, device
    )
    reward_cfg = RewardConfig(fn=args.reward, num_workers=args.reward_workers, timeout_s=args.reward_timeout)
    chunk = progress_chunk(args.engine, args.batch_size, total)
    try:
        with RewardScorer(reward_cfg) as scorer, EvalProgress(total, "problems", chunk) as progress:
            flat, rows = evaluate(engine, datasets, sampling, ks, scorer, prefix="", progress=progress)
    finally:
        engine.close()  # vLLM: shut its in-process engine down
    for key in ("reward_timeouts", "reward_errors"):
        if flat.get(key):
            logger.warning("%s: %d", key, int(flat[key]))
    metrics = compute_metrics(rows, ks)
    for name, m in metrics.items():  # --tool-turns: each set's call rate, turns, errors (rows keep transcripts)
        m.update({k.split("/", 1)[1]: v for k, v in flat.items() if k.startswith(f"{name}/tools/")})
    return metrics, rows
