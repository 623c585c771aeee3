"""Every subcommand turns a bad path, file, model or setting into one line naming it and the fix, exit 2,
before any heavy work (cli.py's error boundary, launch/errors.py; the validators in utils/paths.py,
launch/model_dir.py, launch/checks/preflight.py).

One table per subcommand, run in this process (each case fails before a rank, a model or a sampler
starts, so the whole table takes seconds). The user's tries from issue 29 are marked with their item
number; the others are the ones they did not make.
"""

from __future__ import annotations

import importlib.util
import json
import warnings
from pathlib import Path

import pytest
import torch
from _bad_inputs import broken_models, make_hf_model, read_only_dir

from pacs_megatron.cli import main

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "examples" / "configs" / "cpu_tiny.yaml"


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The files the cases point at (names -> paths); a read-only directory when one can be made."""
    root = tmp_path_factory.mktemp("world")
    good = make_hf_model(root / "model")
    w = {"root": root, "good": good, **broken_models(good, root / "broken")}
    w["file"] = root / "a_file"
    w["file"].write_text("x")
    w["arith"] = root / "arith.jsonl"
    rows = [
        {"prompt": [{"role": "user", "content": f"{a}+{a}="}], "reward_model": {"ground_truth": str(2 * a)}}
        for a in (1, 2)
    ]
    w["arith"].write_text("".join(json.dumps(r) + "\n" for r in rows))
    w["latin1"] = root / "latin1.jsonl"
    w["latin1"].write_bytes(b'{"problem": "1+1=", "answer": "2"}\n{"problem": "caf\xe9", "answer": "1"}\n')
    w["run"] = _run_dir(root / "run", good)
    w["ckpt"] = w["run"] / "checkpoints" / "step_00000002"
    w["dir_yaml"] = root / "conf.yaml"
    w["dir_yaml"].mkdir()
    w["orphan_yaml"] = root / "orphan.yaml"
    w["orphan_yaml"].write_text("base: no_such_base.yaml\n")
    with read_only_dir(root / "ro") as ro:
        w["ro"] = ro
        yield w


def _run_dir(run: Path, model: Path) -> Path:
    """A run's output dir with one complete checkpoint laid out as actor/checkpoint.py writes it."""
    import torch.distributed.checkpoint as dcp

    ckpt = run / "checkpoints" / "step_00000002"
    meg = ckpt / "megatron"
    meg.mkdir(parents=True)
    with warnings.catch_warnings():  # "no process group": the single-process path is what we want
        warnings.simplefilter("ignore")
        dcp.save({"embedding.word_embeddings.weight": torch.zeros(16, 16)}, checkpoint_id=str(meg))
    torch.save({"layout": {"tp": 1, "pp": 1}}, meg / "common.pt")
    (meg / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    extra = {"step": 2, "dataset": {"position": 0}, "config": {"model": {"path": str(model), "tokenizer": ""}}}
    (ckpt / "extra_state.json").write_text(json.dumps(extra))
    (ckpt / "COMPLETE").write_text("{}")
    (run / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 0.5}\n{"step": 2, "reward/mean": 0.7}\n')
    return run


def _check(capfd, argv: list[str], words: str) -> None:
    """``pacs-megatron ARGV`` exits 2 with one line that holds ``words``."""
    capfd.readouterr()
    code = main(argv)
    out, err = capfd.readouterr()
    lines = [ln for ln in (out + err).splitlines() if ln.strip()]
    assert code == 2, (argv, lines[-5:])
    assert len(lines) == 1, (argv, lines)
    assert words in lines[0], (argv, lines[0])


def _fill(w: dict, argv: list[str]) -> list[str]:
    """``{name}`` in ``argv`` -> the world's path of that name."""
    if any("{ro}" in a for a in argv) and w["ro"] is None:
        pytest.skip("no read-only directory can be made here")
    return [a.format(**{k: str(v) for k, v in w.items()}) for a in argv]


TRAIN = [
    # (issue item, arguments after `train --config cpu_tiny.yaml trainer.output_dir=TMP/t`, words)
    ("5", ["trainer.output_dir={ro}/run"], "cannot write in"),
    ("5", ["trainer.output_dir={file}"], "is a file, not a directory"),
    ("5", ["trainer.output_dir={file}/run"], "is a file, so no directory can be made under it"),
    ("6", ["model.path={truncated}", "model.init=pretrained"], "model.safetensors is damaged"),
    ("6", ["model.path={mismatch}", "model.init=pretrained"], "config.json disagrees with the weights"),
    ("6", ["model.path={bad_json}", "model.init=pretrained"], "config.json is not valid JSON"),
    ("", ["model.path={no_weights}", "model.init=pretrained"], "holds no *.safetensors weights"),
    ("", ["model.path={no_tokenizer}", "model.init=pretrained"], "holds no tokenizer"),
    ("", ["model.path={run}", "model.init=random"], "training run's output dir"),
    ("8", ["data.task=math", "reward.fn=math", "data.train_files={latin1}"], "latin1.jsonl:2: byte 0xe9"),
    ("", ["--resume", "yes"], "trainer.resume='yes'"),  # not YAML's 'True'
]


@pytest.mark.parametrize(("item", "args", "words"), TRAIN, ids=[f"{i or '-'}:{a[-1][:40]}" for i, a, _ in TRAIN])
def test_train(world, capfd, tmp_path, item, args, words):
    base = ["train", "--config", str(CONFIG), f"trainer.output_dir={tmp_path}/t"]
    _check(capfd, _fill(world, [*base, *args]), words)
    assert not (tmp_path / "t").exists()  # nothing was written


def test_train_config_files_and_engine(world, capfd, monkeypatch):
    _check(capfd, ["train", "--config", str(world["dir_yaml"])], "is a directory, not a YAML file")
    _check(capfd, ["train", "--config", str(world["root"] / "nope.yaml")], "does not exist")
    _check(capfd, ["train", "--config", str(world["orphan_yaml"])], f"(named by 'base:' in {world['orphan_yaml']})")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    out = f"trainer.output_dir={world['root']}/t"
    _check(capfd, ["train", "--config", str(CONFIG), out, "rollout.engine=vllm"], "vllm is not installed")  # item 5


EVAL = [
    ("1", ["--model", "{no_weights}"], "holds no *.safetensors weights"),
    ("2", ["--model", "{good}", "--out", "{ro}/out"], "--out {ro}/out: cannot write in {ro}"),
    ("2", ["--model", "{good}", "--out", "{file}"], "is a file, not a directory"),
    ("4", ["--model", "{no_tokenizer}"], "holds no tokenizer"),
    ("6", ["--model", "{truncated}"], "model.safetensors is damaged"),
    ("6", ["--model", "{mismatch}"], "config.json disagrees with the weights"),
    ("6", ["--model", "{bad_json}"], "config.json is not valid JSON"),
    ("8", ["--model", "{good}", "--data", "{latin1}"], "latin1.jsonl:2: byte 0xe9 at column 17 is not UTF-8"),
    ("9", ["--model", "{good}", "--device", "cuda" if not torch.cuda.is_available() else "tpu"], "--device"),
    ("", ["--model", "{no_weights}", "--reward", "no_such_module:score"], "--reward no_such_module:score"),
    ("", ["--model", "{root}/nope"], "no such directory"),
    ("", ["--model", "{run}"], "training run's output dir"),
    ("", ["--model", "{good}", "--tokenizer", "{root}/nope"], "--tokenizer {root}/nope: no such tokenizer"),
    ("", ["--model", "{good}", "--data", "{root}/nope.jsonl"], "neither a known name"),
    ("", ["--model", "{good}", "--n", "2", "--k", "1,4"], "k=[4] outside 1..n=2"),
    ("", ["--model", "{good}", "--top-p", "0"], "--top-p 0.0 must be in (0, 1]"),
]


@pytest.mark.parametrize(("item", "args", "words"), EVAL, ids=[f"{i or '-'}:{a[-1][:40]}" for i, a, _ in EVAL])
def test_eval(world, capfd, item, args, words):
    base = ["eval", "--data", "{arith}", "--chat-template", "none", "--reward", "arith", "--n", "2", "--k", "1"]
    base += ["--reward-workers", "0", "--out", "{root}/eval_out"]
    argv = _fill(world, [*base, *args])
    _check(capfd, argv, _fill(world, [words])[0])
    assert not (world["root"] / "eval_out" / "eval_rollout.jsonl").exists()


OTHERS = [
    # (issue item, argv, words): export, parity, plot, selftest, compare, doctor
    ("7", ["export", "{ckpt}", "{root}/hf", "--tp", "3"], "--tp=3 must divide the model's num_attention_heads=2"),
    ("7", ["export", "{ckpt}", "{file}"], "OUT_DIR {file} is a file, not a directory"),
    ("", ["export", "{root}/nope", "{root}/hf"], "CHECKPOINT_DIR {root}/nope does not exist"),  # not "no COMPLETE"
    ("", ["export", "{run}", "{root}/hf"], "is a run's output dir: give one of its checkpoints, e.g. {ckpt}"),
    ("", ["export", "{ckpt}", "{ro}/hf"], "OUT_DIR {ro}/hf: cannot write in"),
    ("", ["export", "{ckpt}", "{ckpt}/hf"], "is inside the checkpoint"),
    ("", ["export", "{ckpt}", "{root}/hf", "--tp", "-1"], "--tp -1 must be >= 1"),
    ("", ["export", "{ckpt}", "{root}/hf", "--model-dir", "{no_tokenizer}"], "holds no tokenizer"),
    ("", ["export", "{ckpt}", "{root}/hf", "--model-dir", "{bad_json}"], "config.json is not valid JSON"),
    ("7", ["parity", "--hf-model", "{good}", "--tp", "3"], "--tp=3 must divide the model's num_attention_heads=2"),
    ("7", ["parity", "--hf-model", "{root}/nope"], "--hf-model {root}/nope: no such directory"),
    ("7", ["parity", "--hf-model", "{run}"], "training run's output dir: export a model first"),
    ("", ["parity", "--hf-model", "{no_weights}"], "holds no *.safetensors weights"),
    ("", ["parity", "--hf-model", "{truncated}"], "model.safetensors is damaged"),
    ("", ["parity", "--hf-model", "{good}", "--out", "{ro}/p.jsonl"], "--out {ro}/p.jsonl: cannot write in"),
    ("", ["parity", "--hf-model", "{good}", "--data", "{root}/nope.jsonl"], "--data {root}/nope.jsonl: no such file"),
    ("", ["parity", "--hf-model", "{good}", "--pp", "0"], "--pp 0 must be >= 1"),
    ("", ["parity", "--hf-model", "{good}", "--ep", "2"], "--ep=2 needs a MoE model"),
    ("9", ["plot", "{root}/nope"], "run {root}/nope does not exist"),
    ("", ["plot", "{good}"], "has no metrics.jsonl"),
    ("", ["plot", "{run}", "--out", "{ro}/c.png"], "--out {ro}/c.png: cannot write in"),
    ("", ["plot", "{run}", "--keys", "no/such"], "--keys: none of the requested metric keys"),
    ("9", ["selftest", "--quick", "--out", "{file}"], "--out {file} is a file, not a directory"),
    ("", ["selftest", "--only", "no_such_check"], "--only 'no_such_check': unknown check(s)"),
    ("9", ["compare", "--config", str(CONFIG), "--out", "{root}/cmp", "--lrs", "1e-3,fast"], "--lrs '1e-3,fast'"),
    ("", ["compare", "--config", str(CONFIG), "--out", "{file}"], "--out {file} is a file"),
    ("", ["compare", "--config", str(CONFIG), "--out", "{root}/cmp", "--seeds", "0"], "--seeds 0 must be >= 1"),
    ("", ["compare", "--config", "{root}/nope.yaml", "--out", "{root}/cmp"], "does not exist"),
    ("", ["doctor", "--config", "{root}/nope.yaml"], "config file '{root}/nope.yaml' does not exist"),
    (
        "",
        ["import-gguf", "--gguf", "{root}/nope.gguf", "--out", "{root}/m"],
        "GGUF file {root}/nope.gguf does not exist",
    ),
    ("", ["import-gguf", "--gguf", "{file}", "--out", "{root}/m"], "is not a GGUF file"),
    ("", ["import-gguf", "--gguf", "{file}", "--out", "{file}"], "--out {file} is a file, not a directory"),
    ("", ["import-gguf", "--gguf", "{file}", "--out", "{good}"], "already exists and is not empty"),
    ("", ["doctor", "--gpu-gib", "0"], "--gpu-gib 0.0 must be > 0"),
]


@pytest.mark.parametrize(
    ("item", "argv", "words"), OTHERS, ids=[f"{i or '-'}:{'_'.join(a)[:48]}" for i, a, _ in OTHERS]
)
def test_command(world, capfd, item, argv, words):
    _check(capfd, _fill(world, argv), _fill(world, [words])[0])
    assert not (world["root"] / "hf").exists() and not (world["root"] / "cmp").exists()


def test_flags_between_overrides_and_a_bare_list_value(world, capfd):
    """``a=1 --resume never b=2`` parses (argparse alone stops at the flag), and a list field takes one
    value without brackets (``data.train_files=/x/my.jsonl``)."""
    out = world["root"] / "dry"
    argv = ["train", "--config", str(CONFIG), "data.task=math", "--resume", "never", "reward.fn=math"]
    argv += [f"data.train_files={world['arith']}", "--dry-run", "trainer.test_freq=0", f"trainer.output_dir={out}"]
    assert main(argv) == 0
    printed = capfd.readouterr().out
    assert f"- {world['arith']}" in printed and "resume: never" in printed
    assert not out.exists()


def test_ctrl_c_is_one_line_and_exit_130(monkeypatch, capfd):
    from pacs_megatron.tools import doctor

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(doctor, "main", interrupted)
    assert main(["doctor"]) == 130
    lines = [ln for ln in capfd.readouterr().err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "doctor: interrupted" in lines[0]


def test_the_tables_cover_every_subcommand():
    from pacs_megatron.cli import COMMANDS

    tested = {"train", "eval"} | {argv[0] for _, argv, _ in OTHERS}
    assert tested == set(COMMANDS), "a new subcommand needs its table of bad inputs here"


@pytest.mark.subprocess
def test_every_subcommands_help_imports_no_torch():
    """``--help`` is fast: no subcommand's module imports torch, transformers, vllm or megatron at the top
    (a second each on a laptop). One fresh interpreter runs every command's help and names the modules."""
    import subprocess
    import sys

    from pacs_megatron.cli import COMMANDS

    code = (
        "import contextlib, io, sys\n"
        "from pacs_megatron.cli import run\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    try: run(sys.argv[1], ['--help'])\n"
        "    except SystemExit: pass\n"
        "print(sorted(m for m in ('torch', 'transformers', 'vllm', 'megatron') if m in sys.modules))\n"
    )
    heavy = {}
    for name in COMMANDS:
        out = subprocess.run([sys.executable, "-c", code, name], capture_output=True, text=True, check=True).stdout
        if out.strip() != "[]":
            heavy[name] = out.strip()
    assert not heavy, heavy


@pytest.mark.subprocess
def test_the_launchers_parent_imports_no_torch(tmp_path):
    """``pacs-megatron train`` started by hand checks the run (config, preflight, layout, a finished run) and
    starts the ranks without importing torch: that import was ~1.8 s of every launch before a rank started
    (the parent's own, in series; each rank imports torch again). Old code: the logger's rank lookup, the
    layout check, the metrics module and the device checks each imported it."""
    import subprocess
    import sys

    out = tmp_path / "run"
    code = (
        "import sys\n"
        "import pacs_megatron.launch.local as local\n"
        "def on_ranks(argv, world_size, rank_main, engines=None):\n"
        "    print(world_size, sorted(m for m in ('torch', 'transformers', 'megatron', 'vllm') if m in sys.modules))\n"
        "    return 0\n"
        "local.on_ranks = on_ranks\n"
        "from pacs_megatron.cli import run\n"
        "sys.exit(run('train', sys.argv[1:]))\n"
    )
    argv = ["--config", str(CONFIG), f"trainer.output_dir={out}", f"model.path={out}/model"]
    res = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split("\n")[0] == "2 []", res.stdout
