"""pacs/registry.py: each loss declares its traits at registration, and nothing outside the registry compares a
loss's name (issue 60 item 3): a new loss is one registration, and the trainer asks the registry what it needs."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from pacs_megatron.config import ConfigError, RunConfig, critic_enabled
from pacs_megatron.config.training import AlgorithmConfig
from pacs_megatron.pacs.config import ADV_ESTIMATORS, POLICY_ADV_ESTIMATORS, PolicyLossConfig
from pacs_megatron.pacs.registry import LOSSES, LossTraits, get_loss, register_loss

PACKAGE = Path(__file__).resolve().parents[2] / "pacs_megatron"
REGISTRY = PACKAGE / "pacs" / "registry.py"
NAME_FIELDS = {"loss", "loss_name"}
"""Attributes and variables that hold a loss's name (``cfg.algorithm.loss``, ``loss_name``)."""


def _only_loss_names() -> set[str]:
    """Registered names that are nothing else: "grpo" is also an advantage estimator, compared as one."""
    return set(LOSSES) - set(ADV_ESTIMATORS) - set(POLICY_ADV_ESTIMATORS)


def _names_a_loss(node: ast.expr) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr in NAME_FIELDS) or (
        isinstance(node, ast.Name) and node.id in NAME_FIELDS
    )


def name_comparisons(source: str) -> list[int]:
    """Lines of ``source`` that branch on a loss's name: ``==``/``!=``/``in`` with a loss name (``x.loss``,
    ``loss_name``) on either side, a comparison with a literal that can only be a loss's name ("pacs"), or a
    tuple / list / set literal of such names (``_BUILTIN_LOSSES`` was one)."""
    only, names = _only_loss_names(), set(LOSSES)
    if not re.search(rf"\.loss\b|\bloss_name\b|[\"']({'|'.join(only)})[\"']", source):
        return []  # nothing to parse (most modules: the scan of the package stays at a second)
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare) and all(
            isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)) for op in node.ops
        ):
            sides = [node.left, *node.comparators]
            literal = any(isinstance(s, ast.Constant) and s.value in only for s in sides)
            if literal or any(_names_a_loss(s) for s in sides):
                lines.append(node.lineno)
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            values = {e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
            if values & only and len(values & names) >= 2:
                lines.append(node.lineno)
    return sorted(set(lines))


def test_the_scan_finds_the_comparisons_it_forbids():
    caught = [
        'if cfg.algorithm.loss == "pacs": pass',
        'x = algo.loss in ("ppo", "grpo")',
        "if name != algo.loss: pass",
        'if loss_name == "grpo": pass',
        'if "gspo" == name: pass',
        '_BUILTIN = ("pacs", "grpo", "ppo", "gspo")',
    ]
    assert all(name_comparisons(src) == [1] for src in caught), [src for src in caught if not name_comparisons(src)]
    allowed = [
        'if estimator in ("rloo", "grpo"): pass',  # advantage estimators
        "if loss_name is None: pass",
        "x = get_loss(cfg.algorithm.loss).traits",
        'msg = "algorithm.loss=pacs"',
    ]
    assert not [src for src in allowed if name_comparisons(src)]


def test_no_loss_name_is_compared_outside_the_registry():
    found = {
        str(path.relative_to(PACKAGE.parent)): lines
        for path in sorted(PACKAGE.rglob("*.py"))
        if path != REGISTRY and (lines := name_comparisons(path.read_text()))
    }
    assert not found, f"ask the loss's traits (pacs/registry.py LossTraits) instead of its name: {found}"


def test_the_built_in_losses_declare_their_traits():
    pacs, grpo, ppo, gspo, sft = (get_loss(n).traits for n in ("pacs", "grpo", "ppo", "gspo", "sft"))
    assert (pacs.section, pacs.correction_unit, pacs.shaped_rewards, pacs.gae, pacs.anchored) == (
        "pacs",
        "row",
        False,
        False,
        True,
    )
    assert pacs.post_update is not None and pacs.outcome_advantages is not None
    assert (grpo.section, grpo.auto_estimator, ppo.auto_estimator, grpo.gae, ppo.gae) == (
        "policy",
        "grpo",
        "rloo",
        True,
        True,
    )
    assert (gspo.section, gspo.gae, gspo.correction_unit, gspo.post_update) == ("gspo", False, "token", None)
    assert (sft.section, sft.outcome_advantages, sft.shaped_rewards) == (None, None, False)
    assert AlgorithmConfig(loss="sft").loss_config() is None  # reads none: its cfg is None
    assert AlgorithmConfig().loss_config("grpo") == PolicyLossConfig(adv_estimator="grpo")
    with pytest.raises(ValueError, match="correction_unit"):
        LossTraits(correction_unit="group")


@pytest.fixture
def toy():
    """A loss added by registration alone, removed after the test (the registry is process-wide)."""
    register_loss("toy_token", unit="token", traits=LossTraits(section="policy", gae=True, auto_estimator="rloo"))(
        lambda b, logp, cfg, entropy=None: (logp.sum(), {})
    )
    yield "toy_token"
    del LOSSES["toy_token"]


def test_a_registered_loss_is_selectable_and_its_traits_answer(toy):
    a = AlgorithmConfig(loss=toy, is_level="token")
    assert a.loss_config().adv_estimator == "rloo"  # its auto_estimator
    assert (a.resolved_is_level, a.correction().unit, a.needs_reference) == ("token", "token", False)
    gae = RunConfig(algorithm=AlgorithmConfig(loss=toy, policy=PolicyLossConfig(adv_estimator="gae")))
    assert critic_enabled(gae)
    with pytest.raises(ConfigError, match="is for loss grpo/ppo/toy_token"):
        RunConfig(algorithm=AlgorithmConfig(loss="gspo", policy=PolicyLossConfig(adv_estimator="gae")))
    with pytest.raises(ConfigError, match="algorithm.loss='dpo' is not registered"):
        AlgorithmConfig(loss="dpo")


def test_a_loss_that_weighs_rows_refuses_token_level_ratios():
    with pytest.raises(ConfigError, match="algorithm.is_level=token with algorithm.loss=pacs"):
        AlgorithmConfig(loss="pacs", is_level="token")
    assert AlgorithmConfig(loss="pacs").resolved_is_level == "sequence"
    assert AlgorithmConfig(loss="pacs", rollout_correction="tis").correction().unit == "row"


@pytest.mark.subprocess
def test_the_registry_imports_no_torch():
    """The config layer asks the traits in the launcher's parent, which imports no torch (tests/test_cli.py)."""
    import subprocess
    import sys

    code = (
        "import sys, pacs_megatron.config, pacs_megatron.pacs.registry as r\n"
        "print(sorted(r.LOSSES), 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "['grpo', 'gspo', 'pacs', 'ppo', 'sft'] False"
