"""Paired comparisons (issue 56): the pairs, the per-seed differences and their intervals by hand, blocks that
stay on one CPU, and for real on the CPU task: the runs of one seed share their step-1 rollouts and their
validation samples across PACS v1, PACS v2 and GRPO, finished runs are kept in --results and reused from there."""

from __future__ import annotations

import json
import math

import pytest
from _compare_helpers import GENERALIZE, SMALL

from pacs_megatron.tools.compare.paired import paired_differences, paired_table, parse_pairs
from pacs_megatron.tools.compare.report import interval
from pacs_megatron.tools.compare.results import order_blocks


def _rows(*vals, key="val/x/pass@1"):
    """A run that validated at steps 8 and 16 with ``vals`` (train reward 0.5 throughout)."""
    return [{"step": s, "reward/mean": 0.5, **({key: vals[s // 8 - 1]} if s % 8 == 0 else {})} for s in range(1, 17)]


def test_pairs_default_to_each_method_minus_the_last_and_refuse_an_unknown_one():
    assert parse_pairs("", ["pacs", "pacs_v2", "grpo"]) == [("pacs", "grpo"), ("pacs_v2", "grpo")]
    assert parse_pairs("pacs_v2-pacs", ["pacs", "pacs_v2", "grpo"]) == [("pacs_v2", "pacs")]
    with pytest.raises(ValueError, match=r"--pairs 'pacs-ppo': give A-B with two methods of --methods"):
        parse_pairs("pacs-ppo", ["pacs", "grpo"])


def test_paired_differences_by_hand():
    runs = {
        "pacs": {0: _rows(0.5, 0.70), 1: _rows(0.4, 0.60), 2: _rows(0.6, 0.80)},
        "grpo": {0: _rows(0.5, 0.65), 1: _rows(0.5, 0.62), 2: _rows(0.5, 0.74)},  # seed 2 of pacs only below
    }
    del runs["grpo"][2]
    [p] = paired_differences(runs, [("pacs", "grpo")], "val/x/pass@1", last=1)
    assert p["seeds"] == [0, 1]  # only the seeds both finished
    assert [r["diff"] for r in p["per_seed"]] == pytest.approx([0.05, -0.02])
    assert p["diff"]["mean"] == pytest.approx(0.015)
    assert p["diff"]["half_width"] == pytest.approx(12.706 * math.sqrt(((0.035**2) * 2) / 1) / math.sqrt(2))
    assert p["by_step"]["8"]["mean"] == pytest.approx(-0.05)
    assert p["by_step"]["16"] == pytest.approx(interval([0.05, -0.02]))
    [mean2] = paired_differences(runs, [("pacs", "grpo")], "val/x/pass@1", last=2)
    assert [r["diff"] for r in mean2["per_seed"]] == pytest.approx([0.025, -0.06])
    md = paired_table([p], "val/x/pass@1", 1)
    assert "| pacs - grpo | 2 | +0.015 +- " in md and "+0.050 -0.020" in md and "| step 8 | step 16 |" in md


def test_a_block_begun_on_another_cpu_waits_for_one_of_its_kind(tmp_path):
    def run(name, cpu, finished=True):
        d = tmp_path / name
        d.mkdir()
        (d / "launch.json").write_text(json.dumps({"ranks": [{"cpu": cpu}]}))
        if finished:
            (d / "final.json").write_text("{}")
        return d

    blocks = {
        0: [run("a0", "zen3"), run("b0", "zen3", finished=False)],  # begun here: first
        1: [run("a1", "xeon"), tmp_path / "b1"],  # begun on another CPU: deferred
        2: [tmp_path / "a2", tmp_path / "b2"],  # fresh
        3: [run("a3", "xeon", finished=False)],  # a run that did not finish pins nothing
        4: [run("a4", "xeon"), run("b4", "xeon")],  # complete on another CPU: nothing waits
    }
    order, deferred = order_blocks({4: blocks[4], 3: blocks[3], 2: blocks[2], 1: blocks[1], 0: blocks[0]}, "zen3")
    assert order == [0, 4, 2, 3] and deferred == {1: "xeon"}


@pytest.mark.slow
def test_one_seed_shares_its_first_batch_and_validation_samples_and_results_are_reused(tmp_path):
    from pacs_megatron.cli import main

    results = tmp_path / "results"

    def argv(out):
        return [
            "compare", "--config", str(GENERALIZE), "--out", str(out), "--results", str(results),
            "--methods", "pacs,pacs_v2,grpo", "--seeds", "1", "--lrs", "1e-3", "--reset-every", "1",
            "--steps", "2", "--jobs", "1", "--score-validations", "1", "--pairs", "pacs-grpo,pacs_v2-pacs",
            *SMALL, "trainer.sft_warmup_steps=1", "trainer.test_freq=2", "trainer.val_before_train=true",
            "trainer.save_freq=0", "trainer.val_n=2", "trainer.val_k=[1]", "trainer.log_rollouts=16",
            "trainer.val_sets=[arith_heldout]", "model.dtype=float32",
        ]  # fmt: skip

    assert main(argv(tmp_path / "a")) == 0
    runs = {m: next((tmp_path / "a" / "runs").glob(f"{m}_lr*")) for m in ("pacs", "pacs_v2", "grpo")}
    metrics = {m: [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()] for m, d in runs.items()}
    samples = {m: [json.loads(x) for x in (d / "rollouts.jsonl").read_text().splitlines()] for m, d in runs.items()}
    step1 = {m: [(s["prompt"], s["response"], s["score"]) for s in v if s["step"] == 1] for m, v in samples.items()}
    assert len(step1["pacs"]) == 16 and step1["pacs"] == step1["pacs_v2"] == step1["grpo"]
    for key in ("data/tokens", "reward/mean", "response/length_mean"):
        assert len({rows[1][key] for rows in metrics.values()}) == 1, key  # rows[1]: step 1 (rows[0]: step 0)
    # the base model's held-out validation: the same samples for every method (only the held-out set runs)
    base = {m: {k: v for k, v in rows[0].items() if k.startswith("val/")} for m, rows in metrics.items()}
    assert base["pacs"] == base["pacs_v2"] == base["grpo"] and "val/arith_val/pass@1" not in base["pacs"]
    summary = json.loads((results / "summary.json").read_text())
    assert [p["pair"] for p in summary["paired"]] == ["pacs - grpo", "pacs_v2 - pacs"]
    assert summary["methods"]["pacs_v2"]["reset_every"] == 1
    assert summary["methods"]["grpo"]["runs"]["0"]["dtype"] == "float32"
    assert summary["methods"]["grpo"]["runs"]["0"]["cpu"] != "unknown"
    kept = sorted(p.name for p in (results / "runs").iterdir())
    assert kept == sorted(d.name for d in runs.values())
    assert not list(results.glob("runs/*/checkpoints")) and (results / "summary.md").is_file()
    # A fresh machine: another --out, the same --results: every run is reused, none launched, same numbers.
    assert main(argv(tmp_path / "b")) == 0
    again = json.loads((results / "summary.json").read_text())
    assert again["paired"] == summary["paired"] and not list((tmp_path / "b" / "runs").glob("*/train.log"))
    report = [*argv(tmp_path / "c"), "--report-only", "--seeds", "2"]
    assert main(report) == 0
    partial = json.loads((results / "summary.json").read_text())
    assert partial["methods"]["pacs"]["pending_seeds"] == [1] and partial["methods"]["pacs"]["failed_seeds"] == []
    assert partial["paired"][0]["seeds"] == [0] and not list((tmp_path / "c" / "runs").glob("*_s1-*/train.log"))


def test_overrides_are_checked_with_each_methods_settings(tmp_path):
    """An override that needs a method's own settings (K needs PACS v2's anchor) was refused before any run:
    the check loaded the overrides without the method's (the K sweep, examples/k_sweep_cpu.sh, could not start)."""
    import argparse

    from pacs_megatron.config import ConfigError
    from pacs_megatron.tools.compare.protocol import add_arguments, check_args

    p = argparse.ArgumentParser()
    add_arguments(p)
    base = ["--config", str(GENERALIZE), "--out", str(tmp_path), "--lrs", "1e-3", "--steps", "2"]
    k = [*SMALL, "trainer.test_freq=2", "algorithm.reference_reset_every=2"]
    check_args(p.parse_args([*base, "--methods", "pacs_v2", *k]))
    with pytest.raises(ConfigError, match=r"^grpo: algorithm.reference_reset_every=2 resets a reference policy"):
        check_args(p.parse_args([*base, "--methods", "pacs_v2,grpo", *k]))


def test_an_auto_dtype_run_is_keyed_as_this_machine_resolves_it(tmp_path, monkeypatch):
    """model.dtype=auto is bf16 on a native-bf16 CPU and fp32 on another: the same settings compute in other
    dtypes there, so their runs must not share a key (an fp32 run reused as a bf16 one); an explicit dtype keeps
    one key everywhere (the paired protocol's runs, committed from any machine)."""
    import argparse

    import pacs_megatron.utils.cpu as cpu
    from pacs_megatron.tools.compare.runs import Runner

    def key(flags, *extra):
        monkeypatch.setattr(cpu, "cpu_bf16_flags", lambda: flags)
        args = argparse.Namespace(config=str(GENERALIZE), out=str(tmp_path), steps=2, overrides=[*SMALL, *extra])
        args.gpus = []
        return Runner(args).run_dir("pacs", 1e-3, 0).name

    auto = "model.dtype=auto"  # cpu_generalize.yaml's base (cpu_tiny.yaml) pins float32
    assert key([], auto) != key(["avx512_bf16"], auto)
    assert key([], auto) == key([], "model.dtype=float32")
    assert key([], "model.dtype=float32") == key(["amx_bf16"], "model.dtype=float32")


def test_an_auto_dtype_block_keeps_the_dtype_its_seed_began_in(tmp_path, monkeypatch):
    """Issue 56: a block's dtype is its machine's (auto), fixed when the block begins. A seed whose runs exist
    (committed in --results, or begun in --out) in fp32 stays fp32 on a native-bf16 CPU, so its remaining runs
    pair with the finished ones; a fresh seed takes this machine's bf16."""
    import argparse

    from omegaconf import OmegaConf

    import pacs_megatron.utils.cpu as cpu
    from pacs_megatron.config import load_config
    from pacs_megatron.tools.compare.runs import Runner

    monkeypatch.setattr(cpu, "cpu_bf16_flags", lambda: ["avx512_bf16"])

    def runner(*extra):
        args = argparse.Namespace(config=str(GENERALIZE), out=str(tmp_path / "out"), steps=2)
        args.overrides, args.results, args.gpus = [*SMALL, *extra], str(tmp_path / "results"), []
        return Runner(args)

    fp32 = runner("model.dtype=float32")
    kept = tmp_path / "results" / "runs" / fp32.run_dir("pacs", 1e-3, 0).name  # seed 0's PACS run, committed
    cfg = load_config(GENERALIZE, [*fp32.settings("pacs", 1e-3, 0), f"trainer.output_dir={kept}"])
    kept.mkdir(parents=True)
    OmegaConf.save(OmegaConf.structured(cfg), kept / "config.yaml")
    (kept / "final.json").write_text("{}")
    auto, bf16 = runner("model.dtype=auto"), runner("model.dtype=bfloat16")
    assert auto.run_dir("grpo", 1e-3, 0).name == fp32.run_dir("grpo", 1e-3, 0).name  # the block's dtype
    assert auto.run_dir("pacs", 1e-3, 0).name == kept.name
    assert auto.run_dir("grpo", 1e-3, 1).name == bf16.run_dir("grpo", 1e-3, 1).name  # a fresh block: this CPU's


def test_a_committed_run_under_an_older_key_is_rekeyed_in_the_results_and_restored(tmp_path):
    import argparse

    from omegaconf import OmegaConf

    from pacs_megatron.config import load_config
    from pacs_megatron.tools.compare.runs import Runner, Spec

    args = argparse.Namespace(config=str(GENERALIZE), out=str(tmp_path / "out"), steps=2, overrides=SMALL)
    args.results, args.gpus = str(tmp_path / "results"), []
    old = tmp_path / "results" / "runs" / "pacs_lr0.001_s0-0123456789"  # committed before the key changed
    cfg = load_config(GENERALIZE, [*Runner(args).settings("pacs", 1e-3, 0), f"trainer.output_dir={old}"])
    old.mkdir(parents=True)
    OmegaConf.save(OmegaConf.structured(cfg), old / "config.yaml")
    (old / "final.json").write_text("{}")
    (old / "metrics.jsonl").write_text('{"step": 1}\n')
    runner = Runner(args)
    new = runner.run_dir("pacs", 1e-3, 0)
    assert not old.exists() and (tmp_path / "results" / "runs" / new.name / "final.json").is_file()
    runner.restore(Spec("pacs", 1e-3, 0))
    assert (new / "metrics.jsonl").read_text() == '{"step": 1}\n'


@pytest.mark.subprocess
def test_the_kept_runs_of_every_results_folder_can_be_committed():
    """compare keeps each finished run in RESULTS/runs/ and says "commit it"; the repository's .gitignore once
    ignored every ``runs/`` folder, so no kept run of docs/results/ was ever committed (issue 56's reuse across
    sessions rested on files git would not take)."""
    import shutil
    import subprocess
    from pathlib import Path

    repo = Path(__file__).resolve().parents[3]
    if shutil.which("git") is None or not (repo / ".git").exists():
        pytest.skip("not a git checkout")
    folders = sorted(p for p in (repo / "docs" / "results").iterdir() if p.is_dir())
    paths = [str(f.relative_to(repo) / "runs" / "pacs_lr1e-05_s0-0123456789" / "metrics.jsonl") for f in folders]
    # a script's results folder per arm (examples/tool_recipe_dtypes.sh: RESULTS/<dtype>/runs/) was ignored
    paths.append("docs/results/smollm2_tools_cpu/dtypes/float32/runs/pacs_lr1e-05_s0-0123456789/metrics.jsonl")
    ignored = subprocess.run(["git", "check-ignore", *paths], cwd=repo, capture_output=True, text=True).stdout.split()
    assert not ignored, ignored
