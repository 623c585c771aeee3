"""The run's record for the user: every launch's resolved config, and the end-of-run summary.

``OUTPUT_DIR/configs/launch_000.yaml``, ``launch_001.yaml``, ... hold the resolved config of each
launch that actually started (written after the checkpoint was restored, so a launch that failed
earlier leaves nothing), headed by comments saying where it resumed from and what changed;
``OUTPUT_DIR/config.yaml`` is a copy of the latest. At the end rank 0 logs a summary and writes the same data
to ``final.json`` (a launch that finds the run already complete logs it and leaves ``final.json`` as the run
wrote it): steps, wall time from the launch, the model's dtype and why, reward first -> last, the best
and the last validation pass@k per set, the last checkpoint and the shell-quoted commands that export and
evaluate it (the eval command repeats the run's validation: its sets, n, k, temperature, top-p, response length
and engine; the synthetic task's sets are written to ``OUTPUT_DIR/eval_sets/`` so that it names real
files). Everything is read back from
``metrics.jsonl``, so the summary covers all launches of the run. A run in which every optimizer
update was skipped (``actor/updates`` is 0 on every step: non-finite losses or gradients) ends with
status ``no_update``, not ``complete``, and the trainer exits 1: it learnt nothing.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import time
from pathlib import Path
from typing import Any

import psutil

from pacs_megatron.config import RunConfig, to_yaml
from pacs_megatron.run.layout import RunLayout
from pacs_megatron.run.metrics import format_duration
from pacs_megatron.run.resume import ResumePlan
from pacs_megatron.utils.logging import get_logger

logger = get_logger(__name__)

_VAL_KEY = re.compile(r"^val/(.+)/(pass@\d+)$")
LAUNCH_TIME_ENV = "PACS_LAUNCH_TIME"
"""When the ``pacs-megatron train`` command started (epoch seconds), set by the launching process (launch/cli.py)
and inherited by the ranks it spawns: a rank's own start comes seconds later."""
DTYPE_REASON_ENV = "PACS_MODEL_DTYPE_REASON"
"""Why the run has its ``model.dtype`` (set by launch/dtype.py when it resolves "auto"; the config holds the
value): written beside each launch's config and into final.json."""


def mark_launch() -> None:
    """This process is the launch: the run's wall time counts from now (:data:`LAUNCH_TIME_ENV`, inherited by
    the ranks it spawns). Now, not the process's create time: a shell that execs its last command (``bash -c
    "pip install ... && pacs-megatron train ..."``, a batch script's ``exec``) hands the command its own pid and
    start time, which counted a fresh clone's 4-minute install into its run's wall time."""
    os.environ[LAUNCH_TIME_ENV] = repr(time.time())


def launch_time() -> float:
    """The launch's start (:data:`LAUNCH_TIME_ENV`), else this process's (a rank started by torchrun or srun)."""
    try:
        return float(os.environ[LAUNCH_TIME_ENV])
    except (KeyError, ValueError):
        return psutil.Process().create_time()


class RunRecord:
    """Launch configs and the final summary of one run (writes on rank 0 only)."""

    def __init__(self, cfg: RunConfig, output_dir: Path, is_rank0: bool, resume: ResumePlan | None) -> None:
        self.cfg, self.output_dir, self.is_rank0, self.resume = cfg, Path(output_dir), is_rank0, resume
        self.layout = RunLayout(self.output_dir)
        self._t0 = launch_time()  # this launch's wall time includes start-up and loading
        self.tool_sandbox: dict | None = None
        """The tools' sandbox level and limits in force this launch (envs/levels.py record); None: no tools."""

    def write_launch(self) -> Path | None:
        """``configs/launch_NNN.yaml`` (NNN = launches so far) and ``config.yaml`` (the latest)."""
        if not self.is_rank0:
            return None
        self.layout.configs.mkdir(parents=True, exist_ok=True)
        index = len(self.layout.launch_configs())
        header = [f"# launch {index}, started {time.strftime('%Y-%m-%d %H:%M:%S %Z')}"]
        if self.resume is None:
            header.append("# fresh run")
        else:
            header.append(f"# resumed from {self.resume.path} (step {self.resume.step}); changed since then:")
            header += [f"#   {c}" for c in self.resume.changes] or ["#   (nothing)"]
        if os.environ.get(DTYPE_REASON_ENV):
            header.append(f"# model.dtype={self.cfg.model.dtype}: {os.environ[DTYPE_REASON_ENV]}")
        text = "\n".join(header) + "\n" + to_yaml(self.cfg)
        path = self.layout.launch_config(index)
        path.write_text(text)
        self.layout.config.write_text(text)
        return path

    def summary(self, last_step: int, last_checkpoint: Path | None, status: str) -> dict:
        """The run's summary (also final.json), from metrics.jsonl."""
        rows = _read_rows(self.layout.metrics)
        rewards = [(r["step"], r["reward/mean"]) for r in rows if isinstance(r.get("reward/mean"), float)]
        updates = [r["actor/updates"] for r in rows if "actor/updates" in r]
        if status == "complete" and updates and sum(updates) == 0:
            status = "no_update"  # every optimizer step was skipped: the run learnt nothing
        best: dict[str, dict] = {}
        last: dict[str, dict] = {}
        for r in rows:
            for key, value in r.items():
                m = _VAL_KEY.match(key)
                if m and isinstance(value, float):
                    last[key] = {"set": m.group(1), "metric": m.group(2), "value": value, "step": r["step"]}
                    if key not in best or value > best[key]["value"]:
                        best[key] = last[key]
        launches = len(self.layout.launch_configs())
        hf_dir = self.layout.export
        ckpt = str(last_checkpoint) if last_checkpoint else None
        return {
            "status": status,
            "last_step": last_step,
            "total_steps": self.cfg.trainer.total_steps,
            "launches": launches,
            "optimizer_updates": int(sum(updates)) if updates else None,
            "wall_time_s": round(time.time() - self._t0, 3),
            "train_time_s": round(sum(r.get("timing/step_s", 0.0) for r in rows), 3),
            "reward_first": {"step": rewards[0][0], "value": rewards[0][1]} if rewards else None,
            "reward_last": {"step": rewards[-1][0], "value": rewards[-1][1]} if rewards else None,
            "best_val": dict(sorted(best.items())),
            "last_val": dict(sorted(last.items())),
            "output_dir": str(self.output_dir),
            "model_dtype": {"dtype": self.cfg.model.dtype, "reason": os.environ.get(DTYPE_REASON_ENV)},
            "last_checkpoint": ckpt,
            # a LoRA run's eval needs a whole model: the merged export (a plain export is a PEFT adapter)
            "export_command": shlex.join(
                ["pacs-megatron", "export", ckpt, str(hf_dir)] + (["--merge"] if self.cfg.actor.lora.enabled else [])
            )
            if ckpt
            else None,
            "eval_command": self._eval_command(hf_dir),
            "tool_sandbox": self.tool_sandbox,
        }

    def _eval_command(self, hf_dir: Path) -> str:
        """The ``eval`` command that repeats this run's validation on the exported model (shell-quoted)."""
        t, data, cfg = self.cfg.trainer, self.cfg.data, self.cfg
        sets = [str(p) for p in self.write_eval_sets()] or list(data.val_files) or ["math500,aime2024,aime2025,amc23"]
        argv = ["pacs-megatron", "eval", "--model", str(hf_dir), "--data", ",".join(sets)]
        argv += [
            "--n",
            str(t.val_n),
            "--k",
            ",".join(str(k) for k in t.val_k),
            "--temperature",
            f"{t.val_temperature:g}",
        ]
        argv += ["--top-p", f"{t.val_top_p:g}", "--max-tokens", str(cfg.rollout.max_response_length)]
        argv += ["--chat-template", data.chat_template, "--reward", cfg.reward.fn]
        if cfg.rollout.engine != "hf":  # the run's engine: the default HF engine is ~4x slower than vLLM's
            argv += ["--engine", cfg.rollout.engine]
        if data.shots:
            argv += ["--shots", json.dumps(data.shots)]
        if data.data_root and data.task != "arith":
            argv += ["--data-root", data.data_root]
        mt = cfg.rollout.multi_turn
        if mt.enabled:  # tool-integrated: the same turn loop, tools and instruction as the validation
            argv += ["--tool-turns", str(mt.max_turns), "--tools", ",".join(cfg.tools.enabled)]
            argv += ["--tool-sandbox", cfg.tools.sandbox] if cfg.tools.sandbox != "auto" else []
            argv += ["--tool-instruction", mt.instruction]
        return shlex.join(argv)

    def write_eval_sets(self) -> list[Path]:
        """The synthetic task's validation sets as JSONL files in the run dir (``eval_sets/NAME.jsonl``), so the
        printed eval command names real files that eval renders into the trainer's own prompts: the PACS
        message format with the raw ``a+b=`` prompt (``data.arith.style=raw``), or plain ``problem`` rows that
        eval gives the PACS instruction, as the trainer does (``words``). [] for file-based tasks (their
        ``data.val_files`` are the files). Rank 0 writes."""
        if self.cfg.data.task != "arith":
            return []
        from pacs_megatron.data.synthetic import arith_splits

        splits = arith_splits(self.cfg.data.arith)
        named = {"arith_heldout" if self.cfg.data.arith.test_fraction else "arith": splits["test"]}
        if splits["val"]:
            named["arith_val"] = splits["val"]
        out = []
        for name, problems in named.items():
            path = self.layout.eval_set(name)
            if self.is_rank0:  # rewritten each time: a file of an older version would not match
                path.parent.mkdir(parents=True, exist_ok=True)
                rows: list[dict[str, Any]]
                if self.cfg.data.arith.style == "words":
                    rows = [{"id": p.id, "problem": p.problem, "answer": p.answer, "source": name} for p in problems]
                else:
                    rows = [
                        {"id": p.id, "prompt": [{"role": "user", "content": p.problem}], "data_source": name}
                        | {"reward_model": {"ground_truth": p.answer}}
                        for p in problems
                    ]
                path.write_text("".join(json.dumps(r) + "\n" for r in rows))
            out.append(path)
        return out

    def finish(self, last_step: int, last_checkpoint: Path | None, status: str = "complete") -> dict:
        """Log the summary and write ``final.json`` (rank 0; other ranks get an empty dict). A start that finds
        the run already complete leaves an existing ``final.json`` as it was."""
        if not self.is_rank0:
            return {}
        s = self.summary(last_step, last_checkpoint, status)
        if status == "already_complete" and self.layout.final.is_file():
            # a start of a finished run trains nothing: the run's own record (its status, wall time) stays
            logger.info("%s", format_summary(s))
            return s
        self.layout.final.write_text(json.dumps(s, indent=2) + "\n")
        logger.info("%s", format_summary(s))
        return s


def _read_rows(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


def format_summary(s: dict) -> str:
    """The summary as the multi-line text logged at the end of a run."""
    head = {
        "complete": f"run complete: step {s['last_step']}/{s['total_steps']}",
        "no_update": f"run FAILED: {s['last_step']} steps but no optimizer update was applied (every update was "
        "skipped: see actor/skipped_steps, actor/nan_skipped_steps and reward/errors in metrics.jsonl); nothing was "
        "learnt",
        "already_complete": f"run already complete at step {s['last_step']} (trainer.total_steps="
        f"{s['total_steps']}): nothing to train; raise trainer.total_steps to continue it",
    }.get(s["status"], f"run {s['status']} at step {s['last_step']}")
    lines = [
        head,
        f"  launches      {s['launches']}; wall time {format_duration(s['wall_time_s'])} this launch, "
        f"{format_duration(s['train_time_s'])} in training steps over all launches",
    ]
    if s["reward_first"]:
        first, last = s["reward_first"], s["reward_last"]
        lines.append(
            f"  reward/mean   {first['value']:.3f} (step {first['step']}) -> {last['value']:.3f} (step {last['step']})"
        )
    for key, v in s["best_val"].items():
        last = s.get("last_val", {}).get(key, v)
        lines.append(
            f"  val           {v['set']} {v['metric']}: best {v['value']:.3f} (step {v['step']}), "
            f"last {last['value']:.3f} (step {last['step']})"
        )
    if s.get("model_dtype"):
        d = s["model_dtype"]
        lines.append(f"  model dtype   {d['dtype']}" + (f" ({d['reason']})" if d.get("reason") else ""))
    lines += [
        f"  output dir    {s['output_dir']}",
        f"  checkpoint    {s['last_checkpoint'] or '(none)'}",
        f"  export        {s['export_command'] or '(no checkpoint to export)'}",
        f"  evaluate      {s['eval_command']}",
    ]
    if s.get("tool_sandbox"):
        sb = s["tool_sandbox"]
        open_ = "; ".join(sb["not_enforced"])
        lines.append(f"  tool sandbox  {sb['level']}, memory cap {sb['memory_cap']}; NOT enforced: {open_}")
    return "\n".join(lines)
