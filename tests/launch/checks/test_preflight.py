"""Early errors: the launcher checks what the config allows before any rank or model starts, and
answers with one line and exit code 2 (``pacs-megatron train --config ... bad.override``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pacs_megatron.config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[3]
CONFIG = REPO / "examples" / "configs" / "cpu_tiny.yaml"
USER_FNS = REPO / "tests" / "reward"


def test_rloo_and_grpo_need_two_responses_per_prompt():
    small = ["algorithm.micro_batch_size=10"]
    with pytest.raises(ConfigError, match="rollout.n=1 with algorithm.pacs.adv_estimator=rloo"):
        load_config(CONFIG, [*small, "rollout.n=1"])
    with pytest.raises(ConfigError, match="algorithm.policy.adv_estimator=grpo"):
        load_config(CONFIG, [*small, "rollout.n=1", "algorithm.loss=grpo"])
    with pytest.raises(ConfigError, match="algorithm.policy.adv_estimator=rloo"):
        load_config(CONFIG, [*small, "rollout.n=1", "algorithm.loss=ppo"])
    cfg = load_config(CONFIG, [*small, "rollout.n=1", "algorithm.pacs.adv_estimator=naive"])
    assert cfg.rollout.n == 1  # the naive estimator does not compare within a group


@pytest.mark.slow
def test_launcher_refuses_early_with_one_line(tmp_path):
    out = tmp_path / "run"
    bad_first_row = tmp_path / "bad.jsonl"
    bad_first_row.write_text('{"problem": "1+1?"}\n')
    bad_model = tmp_path / "bad_model"
    bad_model.mkdir()
    (bad_model / "config.json").write_text('{"model_type": "qwen2",}')
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text(f"base: {CONFIG}\nrollout: {{n: 4\n")
    math = ["data.task=math", "reward.fn=math"]
    cases = {
        "rollout.n=1": (["rollout.n=1", "algorithm.micro_batch_size=10"], "rollout.n=1"),
        "signature": (["reward.fn=reward_user_fns:two_args"], "cannot take (prompt, response, ground_truth, extra)"),
        "import": (["reward.fn=no_such_module:score"], "module 'no_such_module' not found"),
        "resume": (["--resume", str(tmp_path / "nope")], "no such checkpoint directory"),
        "data file": ([*math, f"data.train_files=[{tmp_path / 'missing.jsonl'}]"], "data.train_files has"),
        "first row": ([*math, f"data.train_files=[{bad_first_row}]"], "missing field 'answer'"),
        "yaml": (None, f"{bad_yaml}:3:1: YAML syntax error"),
        "nvfp4 on CPU": (["rollout.quantization=nvfp4"], "rollout.quantization=nvfp4 needs CUDA"),
        "config.json": ([f"model.path={bad_model}", "model.init=random"], "config.json is not valid JSON"),
    }
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(USER_FNS), os.environ.get("PYTHONPATH", "")]))
    procs = {}
    for name, (overrides, _) in cases.items():  # all at once: each is a short CPU-bound start-up
        args = ["--config", str(bad_yaml)] if overrides is None else ["--config", str(CONFIG), *overrides]
        cmd = [sys.executable, "-m", "pacs_megatron", "train", *args, f"trainer.output_dir={out}"]
        procs[name] = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        lines = [ln for ln in (stdout + stderr).splitlines() if ln.strip()]
        assert proc.returncode == 2, (name, stderr[-2000:])
        assert len(lines) == 1 and "config error" in lines[0], (name, lines)
        assert cases[name][1] in lines[0], (name, lines[0])
    assert not out.exists()  # no rank started: nothing was written


def test_every_model_path_is_checked_before_any_rank(tmp_path):
    from pacs_megatron.data.synthetic import write_tiny_model_dir
    from pacs_megatron.launch.checks.preflight import check_model_paths

    model = tmp_path / "model"
    tiny = load_config(CONFIG, [f"model.path={model}", f"trainer.output_dir={tmp_path}/out"])
    check_model_paths(tiny)  # the tiny model dir does not exist yet: the run writes it
    write_tiny_model_dir(model, tiny.model.tiny)
    check_model_paths(tiny)
    gae = [f"model.path={model}", "algorithm.loss=ppo", "algorithm.policy.adv_estimator=gae"]
    with pytest.raises(ConfigError, match=r"critic.init='/no/such/critic': no such directory"):
        check_model_paths(load_config(CONFIG, [*gae, "critic.init=/no/such/critic"]))
    with pytest.raises(ConfigError, match=r"critic.init='.*model' holds no \*.safetensors weights"):
        check_model_paths(load_config(CONFIG, [*gae, f"critic.init={model}"]))
    with pytest.raises(ConfigError, match=r"model.tokenizer='/no/tok': no such tokenizer directory"):
        check_model_paths(load_config(CONFIG, [f"model.path={model}", "model.tokenizer=/no/tok"]))
    with pytest.raises(ConfigError, match=r"model.path='.*model' holds no \*.safetensors weights"):
        check_model_paths(load_config(CONFIG, [f"model.path={model}", "model.init=pretrained"]))
    (model / "config.json").write_text('{"model_type": "qwen2",\n "hidden_size": 128,,}')
    with pytest.raises(ConfigError, match=r"model.path='.*model': .*config.json is not valid JSON \(Expecting"):
        check_model_paths(tiny)


def test_critic_settings_without_a_critic_are_named():
    from pacs_megatron.launch.checks.preflight import unused_critic_settings

    cfg = load_config(CONFIG, ["critic.optim.lr=0.01", "critic.cliprange_value=0.2"])  # loss=pacs
    assert unused_critic_settings(cfg) == ["critic.cliprange_value: 0.5 -> 0.2", "critic.optim.lr: 1e-05 -> 0.01"]
    gae = ["algorithm.loss=ppo", "algorithm.policy.adv_estimator=gae", "critic.optim.lr=0.01"]
    assert unused_critic_settings(load_config(CONFIG, gae)) == []
    assert unused_critic_settings(load_config(CONFIG, [])) == []


def test_a_disk_too_small_for_one_checkpoint_is_refused_at_launch(tmp_path, capfd):
    """Issue 29 item 3 at launch: the free-space check had nothing to compare with before the first
    checkpoint; now an estimate from the model's size (a real 1 MiB tmpfs here, as the issue's repro)."""
    from _bad_inputs import small_disk

    from pacs_megatron.cli import main

    with small_disk(tmp_path / "full", "1m") as disk:
        if disk is None:
            pytest.skip("needs root to mount a small tmpfs")
        capfd.readouterr()
        assert main(["train", "--config", str(CONFIG), f"trainer.output_dir={disk}/run"]) == 2
        lines = [ln for ln in capfd.readouterr().err.splitlines() if ln.strip()]
        assert len(lines) == 1 and "has 1.0 MiB free but a checkpoint takes about 5.7 MiB" in lines[0], lines
        assert not (disk / "run").exists()


def test_gguf_model_is_checked_before_any_rank(tmp_path):
    from _gguf_helpers import tiny_llama, write_gguf

    from pacs_megatron.hf.gguf_import import import_gguf
    from pacs_megatron.launch.checks.preflight import check_model_paths
    from pacs_megatron.launch.cli import layout_summary

    model = tmp_path / "model"
    src = write_gguf(tiny_llama(layers=2), tmp_path / "tiny.gguf")
    base = [f"model.path={model}", "model.init=gguf", f"trainer.output_dir={tmp_path}/out"]
    with pytest.raises(ConfigError, match="model.init=gguf needs model.gguf"):
        load_config(CONFIG, base)
    with pytest.raises(ConfigError, match="model.gguf is read only with model.init=gguf"):
        load_config(CONFIG, ["model.gguf=x.gguf"])
    with pytest.raises(ConfigError, match=r"model.gguf='/no/m.gguf': GGUF file /no/m.gguf does not exist"):
        check_model_paths(load_config(CONFIG, [*base, "model.gguf=/no/m.gguf"]))
    cfg = load_config(CONFIG, [*base, f"model.gguf={src}"])
    check_model_paths(cfg)  # model.path does not exist yet: the first run imports the file
    assert layout_summary(cfg)["tp"] == 2  # tp=2 divides the GGUF's 4 heads and 2 KV heads
    with pytest.raises(ConfigError, match="must divide the model's num_key_value_heads=2"):
        layout_summary(load_config(CONFIG, [*base, f"model.gguf={src}", "parallel.tp=4"]))
    import_gguf(src, model)
    check_model_paths(cfg)
    assert layout_summary(cfg)["model"]["model_type"] == "llama"
    other = write_gguf(tiny_llama(layers=2, seed=1), tmp_path / "other.gguf")
    with pytest.raises(ConfigError, match=r"model.path='.*model' was imported from .*tiny.gguf"):
        check_model_paths(load_config(CONFIG, [*base, f"model.gguf={other}"]))
