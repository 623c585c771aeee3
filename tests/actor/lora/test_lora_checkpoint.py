"""LoRA checkpoints hold the adapters, not the frozen base (actor/lora/checkpoint.py, docs/lora.md).

One launch at TP = 2 (two gloo ranks), PACS v2's anchor on (the reference is the base, adapters off):

* actor A trains step 1, resets (the adapters merge into the base), trains step 2, saves, trains step 3;
  the checkpoint lists no base weight, only the adapters and the merged ones, and names the base and its
  hash; actor B, fresh (the pretrained base), loads it, replays the merge and trains step 3: the same
  metrics and every parameter (merged base included) bit for bit; ``load_model_weights`` (the export's
  load) gives the same merged base;
* a plain actor refuses the LoRA checkpoint, and a LoRA actor a plain one, in one line each;
* B resets until the merges outweigh the base: that checkpoint holds the merged base whole, and a fresh
  actor loads it exactly.

A second launch, one rank at TP = 1, loads the TP = 2 checkpoint: the same merged weights (W + (alpha / r) B A,
merges replayed). It caught ``linear_fc1``'s B saved as one TP slice where megatron saves the gated weight as
two (gate, up): at TP = 1 the up rows of B met the gate rows of W (4e-4 off, the merges' size 4e-3).

Then, in the test process (no ranks): the resume check refuses a different base in one line naming the
path, both hashes and the fix, and accepts the same weights split into other files.
"""

from __future__ import annotations

import json
import shutil
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from _dist import run_distributed
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/actor/_actor_helpers.py
from _actor_helpers import hf_config, make_qwen2, run_config, sample_batch

from pacs_megatron.batch.rows import as_train_batch
from pacs_megatron.config import ConfigError, LoRAConfig
from pacs_megatron.run.checkpoint_data import read_metadata
from pacs_megatron.run.resume import check_lora_base

VOCAB = 255


def _cfg(model_dir, rank=4):
    cfg = run_config(model_dir, tp=2, lr=0.05)
    algo = replace(cfg.algorithm, pacs=replace(cfg.algorithm.pacs, anchor="reference"), reference_reset_every=1)
    return replace(cfg, algorithm=algo, actor=replace(cfg.actor, lora=LoRAConfig(rank=rank, alpha=8.0)))


def _step(actor, batch) -> dict:
    old = actor.compute_logprobs(batch, 4, 1.0).token_logp
    return actor.train_step(as_train_batch(batch, old, ref_logp=actor.compute_ref_logprobs(batch, 4, 1.0)))


def _params(chunks) -> dict:
    from pacs_megatron.actor.weights import unwrap

    return {n: p.detach().clone() for c in chunks for n, p in unwrap(c).named_parameters()}


def _same(a: dict, b: dict) -> list[str]:
    return sorted(k for k in a if not torch.equal(a[k], b[k]))


def _refusal(actor, path) -> str:
    try:
        actor.load_checkpoint(path)
    except ConfigError as e:
        return str(e)
    return ""


def _body(rank, world, model_dir, ckpt):
    from pacs_megatron.actor.checkpoint import load_model_weights
    from pacs_megatron.actor.weights import unwrap
    from pacs_megatron.loop.build import build_actor
    from pacs_megatron.parallel import initialize_parallel

    cfg = _cfg(model_dir)
    groups = initialize_parallel(cfg.parallel, hf_config(model_dir))
    batches = [sample_batch(VOCAB, seed=s) for s in (1, 2, 3)]
    a = build_actor(cfg, groups, model_dir)
    _step(a, batches[0])
    a.reset_reference()
    _step(a, batches[1])
    a.save_checkpoint(f"{ckpt}/lora", {"step": 2})
    merged = {n: t.clone() for n, t in a.export_hf_weights()}
    ma, pa = _step(a, batches[2]), _params(a.model)

    b = build_actor(cfg, groups, model_dir)
    b.load_checkpoint(f"{ckpt}/lora")
    mb, pb = _step(b, batches[2]), _params(b.model)
    fresh = build_actor(cfg, groups, model_dir)
    chunks = [unwrap(c) for c in fresh.model]
    load_model_weights(chunks, f"{ckpt}/lora")  # what `export` does with an adapter-only checkpoint
    exported = {n: p for n, p in _params(chunks).items() if ".lora_" not in n}
    base_a = {n: p for n, p in _params(a.model).items() if ".lora_" not in n}

    plain_cfg = replace(cfg, actor=replace(cfg.actor, lora=LoRAConfig()))
    plain = build_actor(plain_cfg, groups, model_dir)
    plain.save_checkpoint(f"{ckpt}/plain", {"step": 0})
    refused = [_refusal(plain, f"{ckpt}/lora"), _refusal(fresh, f"{ckpt}/plain")]

    for _ in range(16):  # until the merges outweigh the base (r = 4 on a 64-wide model: ~7% of it each)
        b.reset_reference()
    b.save_checkpoint(f"{ckpt}/whole", {"step": 3})
    c = build_actor(cfg, groups, model_dir)
    c.load_checkpoint(f"{ckpt}/whole")
    return {
        "merged": merged,
        "ma": ma,
        "mb": mb,
        "diff": _same(pa, pb),
        "export_diff": _same(base_a, exported),
        "refused": refused,
        "whole_diff": _same(_params(b.model), _params(c.model)),
    }


def _tp1_body(rank, world, model_dir, ckpt):
    from pacs_megatron.loop.build import build_actor
    from pacs_megatron.parallel import initialize_parallel

    cfg = _cfg(model_dir)
    cfg = replace(cfg, parallel=replace(cfg.parallel, tp=1))
    actor = build_actor(cfg, initialize_parallel(cfg.parallel, hf_config(model_dir)), model_dir)
    actor.load_checkpoint(f"{ckpt}/lora")
    return {n: t.clone() for n, t in actor.export_hf_weights()}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_ckpt")
    model_dir = make_qwen2(root / "m", vocab=VOCAB)
    return model_dir, root / "ckpt", run_distributed(_body, 2, model_dir, str(root / "ckpt"))


@pytest.mark.distributed
def test_adapter_only_checkpoint_loads_at_another_tp(run):
    model_dir, ckpt, results = run
    tp1, tp2 = run_distributed(_tp1_body, 1, model_dir, str(ckpt))[0], results[0]["merged"]
    worst = max(float((tp1[n] - tp2[n]).abs().max()) for n in tp2)
    assert worst <= 1e-6, f"merged weights at TP=1 differ from TP=2's by {worst}"  # measured: 0


@pytest.mark.distributed
def test_adapter_only_checkpoint_resumes_exactly_across_a_reset(run):
    _, ckpt, results = run
    for r in results:
        assert r["mb"] == r["ma"], "the step after loading differs from the uninterrupted run"
        assert not r["diff"], f"parameters differ after the resume: {r['diff'][:4]}"
        assert not r["export_diff"], f"the export's load gives another merged base: {r['export_diff'][:4]}"
    keys = set(read_metadata(ckpt / "lora" / "megatron").state_dict_metadata)
    assert not [k for k in keys if k.endswith((".weight", ".bias"))], "the frozen base was saved"
    assert any(k.startswith("lora_merges.0.") and k.endswith(".lora_b") for k in keys)
    record = json.loads((ckpt / "lora" / "extra_state.json").read_text())["lora"]
    assert record["adapters_only"] and record["merges"] == [2.0] and len(record["base"]["sha256"]) == 64


@pytest.mark.distributed
def test_lora_and_plain_checkpoints_refuse_each_other(run):
    _, ckpt, results = run
    to_plain, to_lora = results[0]["refused"]
    assert to_plain.startswith(f"cannot load {ckpt}/lora: it holds actor.lora.rank=4") and "\n" not in to_plain
    assert "asks for actor.lora.rank=0;" in to_plain and "trainer.resume=never" in to_plain
    assert to_lora.startswith(f"cannot load {ckpt}/plain: it holds no LoRA and this run asks for actor.lora.rank=4")


@pytest.mark.distributed
def test_merges_that_outweigh_the_base_save_it_whole(run):
    _, ckpt, results = run
    record = json.loads((ckpt / "whole" / "extra_state.json").read_text())["lora"]
    assert not record["adapters_only"] and record["merges"] is None
    keys = set(read_metadata(ckpt / "whole" / "megatron").state_dict_metadata)
    assert any(k.endswith("linear_qkv.weight") for k in keys) and not any(k.startswith("lora_merges") for k in keys)
    assert all(not r["whole_diff"] for r in results), results[0]["whole_diff"][:4]


@pytest.mark.distributed
def test_another_base_is_refused_in_one_line(run, tmp_path):
    model_dir, ckpt, _ = run
    extra = json.loads((ckpt / "lora" / "extra_state.json").read_text())
    # the same tensors in two files with an index: the same base
    split = tmp_path / "split"
    shutil.copytree(model_dir, split)
    tensors = load_file(split / "model.safetensors")
    (split / "model.safetensors").unlink()
    names = sorted(tensors)
    halves = {"a.safetensors": names[: len(names) // 2], "b.safetensors": names[len(names) // 2 :]}
    for f, part in halves.items():
        save_file({n: tensors[n] for n in part}, split / f, metadata={"format": "pt", "note": "resharded"})
    index = {"metadata": {}, "weight_map": {n: f for f, part in halves.items() for n in part}}
    (split / "model.safetensors.index.json").write_text(json.dumps(index))
    check_lora_base(extra, _cfg(str(split)), ckpt / "lora")
    # one weight changed: refused
    other = tmp_path / "other"
    shutil.copytree(model_dir, other)
    tensors["model.norm.weight"] = tensors["model.norm.weight"] + 1
    save_file(tensors, other / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConfigError) as e:
        check_lora_base(extra, _cfg(str(other)), ckpt / "lora")
    msg, saved = str(e.value), extra["lora"]["base"]["sha256"]
    assert "\n" not in msg and msg.startswith(f"cannot resume from {ckpt}/lora: its LoRA adapters were trained on")
    assert saved[:16] in msg and f"model.path={other} gives sha256" in msg and "point model.path" in msg
