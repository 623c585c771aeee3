"""The console says once, at start, why a PACS run with one update per step logs loss 0.6931 (issue 58, item 7):
pi_theta = pi_old when the loss is taken, so r = psi = 0 and the BCE is ln 2. Old code: nothing said so."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import torch

from pacs_megatron.config import load_config
from pacs_megatron.launch.checks.preflight import note_pacs_one_update, pacs_loss_is_ln2
from pacs_megatron.pacs.loss import pacs_loss

CONFIGS = Path(__file__).resolve().parents[2] / "examples" / "configs"


def test_which_recipes_read_ln2():
    assert pacs_loss_is_ln2(load_config(CONFIGS / "cpu_smollm2.yaml"))  # the SmolLM2 quick start
    assert not pacs_loss_is_ln2(load_config(CONFIGS / "cpu_smollm2_pacs_v1.yaml"))  # 4 updates a step
    assert not pacs_loss_is_ln2(load_config(CONFIGS / "cpu_smollm2_pacs_v2.yaml"))  # the reference anchor
    assert not pacs_loss_is_ln2(load_config(CONFIGS / "cpu_smollm2.yaml", ["algorithm.loss=grpo"]))


def test_one_line_at_start_and_none_in_a_spawned_rank(monkeypatch, caplog):
    cfg = load_config(CONFIGS / "cpu_smollm2.yaml")
    monkeypatch.delenv("PACS_LAUNCHER_KIND", raising=False)
    with caplog.at_level(logging.INFO, logger="pacs_megatron"):
        note_pacs_one_update(cfg)
    lines = [r.getMessage() for r in caplog.records if "ln 2" in r.getMessage()]
    assert len(lines) == 1 and "0.6931" in lines[0] and "pi_theta = pi_old" in lines[0]
    caplog.clear()
    monkeypatch.setenv("PACS_LAUNCHER_KIND", "local")  # a rank of the local launcher: its parent said it
    with caplog.at_level(logging.INFO, logger="pacs_megatron"):
        note_pacs_one_update(cfg)
    assert not [r for r in caplog.records if "ln 2" in r.getMessage()]


def test_the_loss_at_pi_old_is_ln2():
    """What the line claims, from the loss itself: logp = old gives 0.6931 whatever the scores."""
    from pacs_megatron.pacs.config import PACSConfig

    logp = torch.randn(4, 6)
    mask = torch.ones(4, 6)
    loss, _ = pacs_loss(logp, logp.clone(), mask, torch.tensor([1.0, 0.0, 1.0, 0.0]), 2, PACSConfig())
    assert math.isclose(float(loss), math.log(2), rel_tol=1e-6)
