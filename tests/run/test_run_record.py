"""Resume rules (what may change, what is refused), launch configs, the end-of-run summary, side-log
trimming on resume (rollouts.jsonl, TensorBoard purge) and the plain-log progress line."""

import json
import logging

import pytest

from pacs_megatron.config import ConfigError, load_config
from pacs_megatron.run.metrics import MetricsWriter, Progress
from pacs_megatron.run.resume import (
    ResumePlan,
    check_lora_unchanged,
    check_model_unchanged,
    check_tiny_model_dir,
    config_changes,
    model_shape,
    preflight_resume,
)
from pacs_megatron.run.run_record import RunRecord, format_summary

HF = {"model_type": "qwen2", "vocab_size": 16, "hidden_size": 128, "num_hidden_layers": 2, "tie_word_embeddings": True}


def test_changes_listed_and_model_changes_refused(tmp_path):
    old = {"optimizer": {"lr": 0.001}, "rollout": {"n": 4}, "trainer": {"resume": "auto", "total_steps": 3}}
    new = {"optimizer": {"lr": 0.5}, "rollout": {"n": 4}, "trainer": {"resume": "never", "total_steps": 5}}
    assert config_changes(old, new) == ["optimizer.lr: 0.001 -> 0.5", "trainer.total_steps: 3 -> 5"]
    check_model_unchanged(model_shape(HF), dict(HF), "ckpt")  # same model: fine
    check_model_unchanged(None, HF, "ckpt")  # a checkpoint that recorded no shape: nothing to compare
    with pytest.raises(ConfigError, match=r"cannot resume from ckpt: .*vocab_size 16 -> 32; hidden_size 128 -> 64"):
        check_model_unchanged(model_shape(HF), HF | {"hidden_size": 64, "vocab_size": 32}, "ckpt")


def test_lora_settings_must_match_the_checkpoint():
    """LoRA asked of a checkpoint trained without it (or the reverse, or another rank) is refused in one line
    before any rank loads: the checkpoint holds other tensors than the run would train."""
    lora = load_config(None, ["actor.lora.rank=8"])
    full = load_config(None, [])
    saved_lora = {"actor": {"lora": {"rank": 8, "targets": ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]}}}
    check_lora_unchanged(saved_lora, lora, "ckpt")
    check_lora_unchanged({"actor": {}}, full, "ckpt")  # written before LoRA existed: full fine-tuning
    with pytest.raises(ConfigError, match=r"trained with actor.lora.rank=0, this run asks for actor.lora.rank=8 "):
        check_lora_unchanged({"actor": {}}, lora, "ckpt")
    with pytest.raises(ConfigError, match=r"trained with actor.lora.rank=8 targets=.*asks for actor.lora.rank=0;"):
        check_lora_unchanged(saved_lora, full, "ckpt")
    with pytest.raises(ConfigError, match=r"actor.lora.rank=4 targets"):
        check_lora_unchanged(saved_lora, load_config(None, ["actor.lora.rank=4"]), "ckpt")


def test_tiny_overrides_must_match_existing_model_dir(tmp_path):
    from pacs_megatron.data.synthetic import write_tiny_model_dir

    cfg = load_config(None, [f"model.path={tmp_path}/m", "model.init=tiny"])
    check_tiny_model_dir(cfg)  # no config.json yet: it will be written
    write_tiny_model_dir(tmp_path / "m", cfg.model.tiny)
    check_tiny_model_dir(cfg)
    bad = load_config(None, [f"model.path={tmp_path}/m", "model.init=tiny", "model.tiny.hidden_size=64"])
    with pytest.raises(ConfigError, match="model.tiny.hidden_size=64 but config.json has hidden_size=128"):
        check_tiny_model_dir(bad)


def test_preflight_refuses_another_model_before_any_rank(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(HF | {"hidden_size": 64}))
    ckpt = tmp_path / "out" / "checkpoints" / "step_00000002"
    ckpt.mkdir(parents=True)
    (ckpt / "COMPLETE").write_text("{}")
    (ckpt / "extra_state.json").write_text(json.dumps({"step": 2, "dataset": {}, "model": model_shape(HF)}))
    cfg = load_config(None, [f"model.path={tmp_path}/m", f"trainer.output_dir={tmp_path}/out"])
    with pytest.raises(ConfigError, match="hidden_size 128 -> 64"):
        preflight_resume(cfg)
    preflight_resume(
        load_config(None, [f"model.path={tmp_path}/m", f"trainer.output_dir={tmp_path}/out", "trainer.resume=never"])
    )


def test_launch_configs_and_summary(tmp_path, caplog):
    cfg = load_config(None, [f"model.path={tmp_path}/m", f"trainer.output_dir={tmp_path}", "trainer.val_k=[1,4]"])
    RunRecord(cfg, tmp_path, True, None).write_launch()
    plan = ResumePlan(tmp_path / "checkpoints" / "step_00000002", 2, ["optimizer.lr: 0.001 -> 0.5"])
    record = RunRecord(cfg, tmp_path, True, plan)
    assert record.write_launch().name == "launch_001.yaml"
    text = (tmp_path / "configs" / "launch_001.yaml").read_text()
    assert "resumed from" in text and "#   optimizer.lr: 0.001 -> 0.5" in text
    assert (tmp_path / "config.yaml").read_text() == text
    assert load_config(tmp_path / "config.yaml").trainer.val_k == [1, 4]  # the record loads as a config
    assert not RunRecord(cfg, tmp_path / "other", False, None).write_launch()  # rank > 0 writes nothing
    rows = [
        {"step": 1, "reward/mean": 0.1, "timing/step_s": 1.0},
        {"step": 2, "reward/mean": 0.5, "val/arith/pass@1": 0.6, "val/arith/pass@4": 0.9, "timing/step_s": 1.0},
        {"step": 3, "reward/mean": 0.7, "val/arith/pass@1": 0.8, "val/arith/pass@4": 0.85, "timing/step_s": 1.5},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with caplog.at_level(logging.INFO):
        s = record.finish(3, plan.path)
    assert json.loads((tmp_path / "final.json").read_text()) == s
    assert s["launches"] == 2 and s["train_time_s"] == 3.5
    assert s["reward_first"] == {"step": 1, "value": 0.1} and s["reward_last"] == {"step": 3, "value": 0.7}
    assert s["best_val"]["val/arith/pass@1"]["value"] == 0.8 and s["best_val"]["val/arith/pass@4"]["step"] == 2
    assert s["last_val"]["val/arith/pass@4"] == {"set": "arith", "metric": "pass@4", "value": 0.85, "step": 3}
    assert s["export_command"] == f"pacs-megatron export {plan.path} {tmp_path / 'hf'}"
    assert s["eval_command"] == (
        f"pacs-megatron eval --model {tmp_path / 'hf'} --data math500 --n 4 --k 1,4 --temperature 0.6 --top-p 0.95 "
        "--max-tokens 1024 --chat-template auto --reward math"
    )
    assert format_summary(s) in caplog.text and "0.100 (step 1) -> 0.700 (step 3)" in caplog.text
    assert "arith pass@4: best 0.900 (step 2), last 0.850 (step 3)" in caplog.text  # best AND last (issue 29)


def test_summary_commands_are_shell_quoted_and_name_real_files(tmp_path):
    """Issue 29: the printed commands broke on a path with a space, and eval's named a placeholder FILE.jsonl
    for the synthetic task; now its validation set is written into the run dir, in the PACS format."""
    import shlex

    from pacs_megatron.data import load_dataset
    from pacs_megatron.data.synthetic import build_arith_tokenizer

    out = tmp_path / "my run"
    config = "examples/configs/cpu_tiny.yaml"
    cfg = load_config(
        config, [f"trainer.output_dir={out}", "data.arith.test_fraction=0.2", "data.arith.val_fraction=0.2"]
    )
    s = RunRecord(cfg, out, True, None).summary(3, out / "checkpoints" / "step_00000003", "complete")
    export = shlex.split(s["export_command"])
    assert export == ["pacs-megatron", "export", str(out / "checkpoints" / "step_00000003"), str(out / "hf")]
    evaluate = shlex.split(s["eval_command"])
    files = evaluate[evaluate.index("--data") + 1].split(",")
    assert [f.rsplit("/", 1)[-1] for f in files] == ["arith_heldout.jsonl", "arith_val.jsonl"]
    assert evaluate[evaluate.index("--reward") + 1] == "arith" and "--max-tokens" in evaluate
    tok = build_arith_tokenizer()
    name, records = load_dataset(files[0], cfg.data, tok)
    assert name == "arith_heldout" and records and all(r.prompt_text.endswith("=") for r in records)
    assert all("+" in r.prompt_text and len(r.prompt_text) <= 4 for r in records)  # the raw "a+b=", as in training


def test_resume_trims_rollouts_and_purges_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    w = MetricsWriter(tmp_path, enabled=True, tensorboard=True)
    for s in (1, 2, 3):
        w.log(s, {"reward/mean": 0.1 * s})
    w.close()
    (tmp_path / "rollouts.jsonl").write_text(
        "".join(json.dumps({"step": s, "response": "1"}) + "\n" for s in (1, 2, 3))
    )
    resumed = MetricsWriter(tmp_path, enabled=True, tensorboard=True)
    resumed.truncate_after(2)
    resumed.log(3, {"reward/mean": 0.33})
    resumed.close()
    assert [json.loads(x)["step"] for x in (tmp_path / "rollouts.jsonl").read_text().splitlines()] == [1, 2]
    files = sorted((tmp_path / "tb").iterdir(), key=lambda p: p.stat().st_mtime_ns)
    assert len(files) == 2
    events = list(EventFileLoader(str(files[-1])).Load())
    # SessionLog.START at step 3: TensorBoard hides every older event of step >= 3.
    assert any(e.HasField("session_log") and e.session_log.status == 1 and e.step == 3 for e in events)


def test_plain_progress_line_with_eta(caplog):
    with caplog.at_level(logging.INFO):
        p = Progress(total=40, start=0, enabled=True)  # pytest's stderr is not a terminal
        for step in range(1, 41):
            p.update(step, {})
        p.close()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("progress:")]
    assert len(lines) == 20 and lines[-1].startswith("progress: step 40/40 (100%)") and "ETA" in lines[0]
    caplog.clear()
    Progress(total=40, start=0, enabled=False).update(2, {})
    assert "progress:" not in caplog.text


def test_doctests():
    import doctest

    from pacs_megatron.run import checkpoint_check, metrics, resume

    for module in (checkpoint_check, metrics, resume):
        assert doctest.testmod(module).failed == 0, module.__name__


def test_a_run_whose_updates_were_all_skipped_is_not_complete(tmp_path):
    cfg = load_config(None, [f"trainer.output_dir={tmp_path}", "trainer.total_steps=2"])
    rows = [{"step": s, "reward/mean": 0.0, "actor/updates": 0.0, "actor/skipped_steps": float(s)} for s in (1, 2)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    s = RunRecord(cfg, tmp_path, True, None).finish(2, None)
    assert s["status"] == "no_update" and s["optimizer_updates"] == 0
    assert format_summary(s).startswith("run FAILED: 2 steps but no optimizer update was applied")
    rows[1]["actor/updates"] = 1.0  # one update applied: the run learnt something
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    done = RunRecord(cfg, tmp_path, True, None).finish(2, None)
    assert done["status"] == "complete"
    text = format_summary(done)  # no checkpoint: said in words, never "None"
    assert "None" not in text and "checkpoint    (none)" in text and "(no checkpoint to export)" in text


def test_the_eval_command_carries_the_runs_engine(tmp_path):
    """Fails on the old code: a vLLM run's summary said `eval ...` without --engine vllm, which then sampled
    with the HF engine (~4x slower)."""
    import shlex

    out = tmp_path / "run"
    for engine, expected in (("vllm", ["--engine", "vllm"]), ("hf", [])):
        cfg = load_config("examples/configs/cpu_tiny.yaml", [f"trainer.output_dir={out}", f"rollout.engine={engine}"])
        argv = shlex.split(RunRecord(cfg, out, True, None).summary(1, None, "complete")["eval_command"])
        if expected:
            assert argv[argv.index("--engine") :][:2] == expected
        else:
            assert "--engine" not in argv  # hf is eval's default


def test_the_eval_command_of_a_tool_run_calls_the_tools(tmp_path):
    """Fails on the old code: a tool-integrated run's summary said `eval ...` without the turn loop, which then
    scored the policy single-turn, without the tool it was trained to call."""
    import argparse
    import shlex

    from pacs_megatron.tools.eval import add_arguments

    out = tmp_path / "run"
    on = ["rollout.multi_turn.max_turns=3", "rollout.multi_turn.instruction=Call python."]
    cfg = load_config("examples/configs/cpu_tiny.yaml", [f"trainer.output_dir={out}", *on])
    argv = shlex.split(RunRecord(cfg, out, True, None).summary(1, None, "complete")["eval_command"])
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(argv[2:])  # the command parses as eval's own flags
    assert (args.tool_turns, args.tools, args.tool_instruction) == (3, "python", "Call python.")


def test_the_tool_sandbox_level_is_in_the_summary_and_its_eval_command(tmp_path):
    """Issue 57: the level in force and its limits are in final.json and the summary's text; a run at the
    weaker level prints an eval command that asks for it by name (eval's default, auto, would refuse)."""
    import shlex

    out = tmp_path / "run"
    on = ["rollout.multi_turn.max_turns=3", "tools.sandbox=rlimits-trusted", f"trainer.output_dir={out}"]
    record = RunRecord(load_config("examples/configs/cpu_tiny.yaml", on), out, True, None)
    assert record.summary(1, None, "complete")["tool_sandbox"] is None  # not known before the loop sets it
    record.tool_sandbox = {"level": "rlimits-trusted", "memory_cap": "cgroup-v1", "not_enforced": ["file reads"]}
    s = record.finish(1, None)
    assert json.loads((out / "final.json").read_text())["tool_sandbox"]["level"] == "rlimits-trusted"
    assert "tool sandbox  rlimits-trusted, memory cap cgroup-v1; NOT enforced: file reads" in format_summary(s)
    argv = shlex.split(s["eval_command"])
    assert argv[argv.index("--tool-sandbox") + 1] == "rlimits-trusted"


def test_the_eval_command_builds_the_validations_own_prompts(tmp_path, data_root):
    """Fails on the old code: the eval sets of a word-problem run (the SmolLM2 recipes) were written as PACS
    messages, which eval renders as they are, without the instruction the trainer's validation gives each
    problem ("... put your final answer within \\boxed{}."): the printed command evaluated other prompts."""
    import argparse
    import shlex

    from pacs_megatron.data import load_dataset, load_tokenizer
    from pacs_megatron.loop.build import val_datasets
    from pacs_megatron.tools.eval import _data_config, add_arguments

    out = tmp_path / "run"
    tok_dir = data_root / "tokenizers" / "qwen2.5"
    words = ["data.task=arith", "data.arith.style=words", "data.arith.max_operand=19", "data.arith.modulo=0"]
    words += ["data.arith.num_problems=40", "data.arith.test_fraction=0.25", "data.chat_template=qwen2.5"]
    cfg = load_config(None, [f"trainer.output_dir={out}", f"model.tokenizer={tok_dir}", *words])
    argv = shlex.split(RunRecord(cfg, out, True, None).summary(1, None, "complete")["eval_command"])
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(argv[2:])
    tok = load_tokenizer(tok_dir, cfg.data.chat_template)
    _, evaluated = load_dataset(args.data, _data_config(args), tok)
    validated = val_datasets(cfg, tok)["arith_heldout"]
    assert [r.prompt_text for r in evaluated] == [r.prompt_text for r in validated]
    assert all("\\boxed{}" in r.prompt_text for r in evaluated) and [r.answer for r in evaluated] == [
        r.answer for r in validated
    ]
