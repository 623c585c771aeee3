"""Post-update PACS diagnostics: the loss re-evaluated with the actor's new log-probs."""

import math
from types import SimpleNamespace

import pytest
import torch

from pacs_megatron.batch.build import build_rollouts
from pacs_megatron.batch.rows import as_train_batch
from pacs_megatron.config import RunConfig
from pacs_megatron.loop.diagnostics import post_update_metrics
from pacs_megatron.pacs.loss import pacs_loss


class _Actor:
    """Returns fixed 'post-update' log-probs: the old ones shifted per row."""

    def __init__(self, shift):
        self.shift = shift
        self.groups = SimpleNamespace(dp_size=1, dp_group=None, device=torch.device("cpu"))

    def compute_logprobs(self, batch, micro_batch_size, temperature, with_entropy=False, response_only=False):
        return SimpleNamespace(token_logp=batch.old_logp + self.shift[:, None] * batch.response_mask)


def test_post_update_metrics_match_the_loss_on_new_logprobs():
    scores = [1.0, 0.0, 0.0, 1.0]
    batch = build_rollouts([[1, 2]] * 4, [[3], [4, 5], [6], [7]], scores, group_size=2, pad_id=0)
    batch = as_train_batch(batch, torch.full(batch.input_ids.shape, -1.0))
    shift = torch.tensor([0.3, -0.2, -0.1, 0.4])  # the update raised the correct responses' log-probs
    cfg = RunConfig()
    m = post_update_metrics(cfg, _Actor(shift), batch)
    loss, ref = pacs_loss(
        batch.old_logp + shift[:, None] * batch.response_mask,
        batch.old_logp,
        batch.response_mask,
        batch.scores,
        2,
        cfg.algorithm.pacs,
    )
    assert m["pacs/post_loss"] == float(loss) and m["pacs/post_loss"] < math.log(2)
    assert m["pacs/post_classifier_acc"] == 1.0  # psi > 0 exactly on the correct responses
    assert m["pacs/post_psi_abs_mean"] == float(ref["pacs/psi_abs_mean"]) > 0
    assert "pacs/post_mixed_group_frac" not in m
    cfg.logging.post_update_metrics = False
    assert post_update_metrics(cfg, _Actor(shift), batch) == {}


def test_post_update_metrics_leave_out_the_rows_the_loss_dropped():
    from dataclasses import replace

    scores = [1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 1.0, 0.0]
    batch = build_rollouts([[1, 2]] * 8, [[3], [4, 5], [6], [7], [3], [4], [5, 6], [7]], scores, 4, pad_id=0)
    batch = as_train_batch(batch, torch.full(batch.input_ids.shape, -1.0))
    w = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0])  # row 3 dropped (masked IS, a truncated row)
    batch = replace(batch, is_weights=w)
    shift = torch.tensor([0.3, -0.2, -0.1, 5.0, 0.2, -0.3, 0.1, -0.4])  # the dropped row moved the most
    cfg = RunConfig()
    m = post_update_metrics(cfg, _Actor(shift), batch)
    new = batch.old_logp + shift[:, None] * batch.response_mask
    loss, ref = pacs_loss(new, batch.old_logp, batch.response_mask, batch.scores, 4, cfg.algorithm.pacs, is_weights=w)
    assert m["pacs/post_loss"] == pytest.approx(float(loss))
    for key in ("psi_abs_mean", "brier", "classifier_acc", "implicit_reward_abs_mean"):
        assert m[f"pacs/post_{key}"] == pytest.approx(float(ref[f"pacs/{key}"])), key
    # the quantiles are over the 7 kept rows' psi (old: all 8, the dropped row's 5-nat shift among them)
    assert m["pacs/post_psi_p90"] < 1.0
