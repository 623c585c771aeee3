"""The LM head on response tokens only (actor/logit_rows.py) gives the full pass's results where they are read.

One launch per world size runs every case of it (process start dominates): the response tokens' log-probs
and entropy of ``compute_logprobs(response_only=True)`` equal the full pass's (fp32, allclose) and hold 0
elsewhere; the training forward's loss sees logits of exactly the selected rows (``[1, n, V]``, n = the
response tokens, not b * T); and a whole RL step (reference KL, entropy bonus, old log-probs, update:
``update_stages.prepare_local_batch`` + ``update_actor``) gives the same metrics and weights with the selection
on and off. Cases: fixed and token-budget (THD-packed) micro-batches, PP=2, PP=2 x VPP=2 and TP=2 (the
vocabulary split over ranks). Sequence parallelism needs TE or Apex (not on CPU): there the output layer
gathers the sequence itself and no rows are selected (``selects_rows``, checked without a model).

The fused LM head (``model.fused_lm_head=true``, ops/head.py) runs in the same launch, with and without the
row selection: its loss functions get hidden states and the output weight (never ``[.., V]`` logits), and
its log-probs, entropy, step metrics and updated weights equal the unfused full pass's (tied embeddings:
the weight is the shared embedding; TP=2: grad_hidden all-reduced by the op as megatron's layer does).
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from types import SimpleNamespace

import pytest
import torch
from _actor_helpers import GROUP, hf_config, make_qwen2, run_config, sample_batch
from _dist import run_distributed

from pacs_megatron.actor.logit_rows import HeadInput, selects_rows

VOCAB = 255
VARIANTS = {"rows": (True, "false"), "full": (False, "false"), "fused_rows": (True, "true"), "fused": (False, "true")}
"""name -> (actor.response_logits, model.fused_lm_head); "full" is the baseline every other variant equals."""

# name -> (world, tp, pp, vpp, sequence parallel, dynamic batching)
CASES = {
    "fixed": (1, 1, 1, 1, False, False),
    "dynamic": (1, 1, 1, 1, False, True),
    "pp2_dynamic": (2, 1, 2, 1, False, True),
    "pp2vpp2_fixed": (2, 1, 2, 2, False, False),
    "tp2_fixed": (2, 2, 1, 1, False, False),
}


def _config(model_dir, tp, pp, vpp, sp, dynamic):
    cfg = run_config(model_dir, tp=tp, pp=pp, vpp=vpp, lr=1e-2, adam_eps=1e-8)
    algo = replace(
        cfg.algorithm, loss="grpo", dynamic_batching=dynamic, kl_loss_coef=0.5, kl_loss_type="k3", entropy_coeff=0.1
    )
    return replace(cfg, algorithm=algo, parallel=replace(cfg.parallel, sequence_parallel=sp))


def _case(model_dir, tp, pp, vpp, sp, dynamic):
    import pacs_megatron.actor.train_step as ts
    from pacs_megatron.loop import update_stages
    from pacs_megatron.loop.build import build_actor
    from pacs_megatron.parallel import initialize_parallel

    cfg = _config(model_dir, tp, pp, vpp, sp, dynamic)
    groups = initialize_parallel(cfg.parallel, hf_config(model_dir))
    batch = sample_batch(VOCAB)
    out = {"last": groups.is_last_stage}
    steps = {}
    for name, (rows_on, fused) in VARIANTS.items():
        actor = build_actor(replace(cfg, model=replace(cfg.model, fused_lm_head=fused)), groups, model_dir)
        actor.response_logits = rows_on
        lp = actor.compute_logprobs(batch, GROUP, 1.0, with_entropy=True, response_only=True)
        out[f"logp_{name}"], out[f"entropy_{name}"] = lp.token_logp, lp.entropy
        rows = []  # the rows of the logits each training loss function sees
        real = ts.token_logprobs
        ts.token_logprobs = partial(_recording, rows, real)
        try:
            local, old, m1 = update_stages.prepare_local_batch(cfg, actor, batch, groups.dp_rank, groups.dp_size)
            m2 = update_stages.update_actor(cfg, actor, local, old, groups.dp_size)
        finally:
            ts.token_logprobs = real
        out[f"rows_{name}"] = rows
        weights = {n: t.detach().clone() for n, t in actor.export_hf_weights()}
        steps[name] = ({k: float(v) for k, v in (m1 | m2).items()}, weights)
    out["steps"] = steps
    return out


def _recording(seen: list, real, logits, *args, **kwargs):
    """Records (kind, leading shape) of what the loss function got: "head" for the fused LM head's input."""
    x = logits.hidden if isinstance(logits, HeadInput) else logits
    seen.append(("head" if isinstance(logits, HeadInput) else "logits", tuple(x.shape[:-1])))
    return real(logits, *args, **kwargs)


def _body(rank, world, model_dir, cases):  # noqa: ARG001
    return {case: _case(model_dir, *CASES[case][1:]) for case in cases}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_qwen2(tmp_path_factory.mktemp("qwen2_rows") / "m", vocab=VOCAB, tie=True)


@pytest.mark.distributed
@pytest.mark.parametrize("world", [1, pytest.param(2, marks=pytest.mark.distributed)])
def test_response_logits_equal_full_logits(world, model_dir):
    cases = [k for k, c in CASES.items() if c[0] == world]
    results = run_distributed(_body, world, model_dir, cases)
    mask = sample_batch(VOCAB).response_mask.bool()
    for case in cases:
        sp = CASES[case][4]
        for r in results:
            _check(case, r[case], mask, sp)


def _check(case, r, mask, sp):
    off = r["logp_full"]
    assert bool(off[~mask].ne(0).any()), f"{case}: the full pass has prompt log-probs"
    for name, (rows_on, fused) in VARIANTS.items():
        where = f"{case} {name}"
        on = r[f"logp_{name}"]
        assert torch.allclose(on[mask], off[mask], rtol=0, atol=1e-5), f"{where}: response log-probs differ"
        assert torch.allclose(r[f"entropy_{name}"][mask], r["entropy_full"][mask], rtol=0, atol=1e-5), where
        if not sp and rows_on:
            assert not on[~mask].any() and not r[f"entropy_{name}"][~mask].any(), f"{where}: values outside"
        if not rows_on:
            assert torch.allclose(on, off, rtol=0, atol=1e-5), f"{where}: prompt log-probs differ"
        if r["last"]:
            seen = r[f"rows_{name}"]
            kind = "head" if fused == "true" else "logits"
            assert seen and all(k == kind for k, _ in seen), f"{where}: loss functions got {seen}"
            shapes = [s for _, s in seen]
            n = int(mask[:, 1:].sum())  # the first token of a row is predicted by nothing
            if sp or not rows_on:  # no selection: the whole sequence reaches the head
                assert sum(s[0] * s[1] for s in shapes) > n, where
            else:
                assert all(s[0] == 1 for s in shapes), f"{where}: selected rows are [1, n, .]: {shapes}"
                assert sum(s[1] for s in shapes) == n, f"{where}: {shapes} rows for {n} response tokens"
        (m_on, w_on), (m_off, w_off) = r["steps"][name], r["steps"]["full"]
        assert m_on.keys() == m_off.keys()
        for k, v in m_off.items():
            assert m_on[k] == pytest.approx(v, rel=1e-4, abs=1e-6), f"{where}: {k} {m_on[k]} != {v}"
        assert m_on["actor/grad_norm"] > 0
        for key, w in w_off.items():
            assert torch.allclose(w_on[key], w, rtol=0, atol=1e-5), f"{where}: {key} differs after the step"


def test_no_selection_where_the_output_layer_gathers_the_sequence():
    def chunk(post, layer):
        return SimpleNamespace(module=SimpleNamespace(post_process=post, output_layer=layer))

    assert selects_rows(chunk(True, SimpleNamespace(sequence_parallel=False)))
    assert not selects_rows(chunk(True, SimpleNamespace(sequence_parallel=True)))  # input: this rank's slice
    assert not selects_rows(chunk(False, None))  # an earlier pipeline stage or virtual chunk


def test_fused_lm_head_switch():
    """Issue 58 item 6: auto fuses where one micro-batch's logits pass a share of the rank's memory, not on every
    CPU (the SmolLM2 recipes' <= 0.85 GB of logits on a 24 GiB host stay unfused: fused is 6-15 % slower a step)."""
    from pacs_megatron.actor.logit_rows import logits_bytes
    from pacs_megatron.config import ConfigError
    from pacs_megatron.config.model import AUTO_FUSE_SHARE, ModelConfig

    with pytest.raises(ConfigError, match="model.fused_lm_head"):
        ModelConfig(path="/m", fused_lm_head="yes")
    assert ModelConfig(path="/m", fused_lm_head=False).fused_lm_head == "false"  # YAML's bare false
    assert ModelConfig(path="/m", fused_lm_head="true").use_fused_lm_head(0, 1 << 40)
    assert not ModelConfig(path="/m", fused_lm_head="false").use_fused_lm_head(1 << 40, 1)
    auto = ModelConfig(path="/m")
    assert auto.fused_lm_head == "auto"
    recipe = logits_bytes(16 * 208, 49152, torch.float32)  # SmolLM2's v1 recipe: 16 rows of 160 + 48 tokens
    assert not auto.use_fused_lm_head(recipe, 24 << 30)
    assert auto.use_fused_lm_head(logits_bytes(32768, 151936, torch.bfloat16), 80 << 30)  # Qwen, 32k tokens
    share = int(AUTO_FUSE_SHARE * (10 << 30))
    assert not auto.use_fused_lm_head(share, 10 << 30) and auto.use_fused_lm_head(share + 1, 10 << 30)
