"""The comparison's tuning rules on synthetic metrics (runs are rows made from their spec): grid growth until
the optimum is interior, each method on its own lr grid, PACS v2's reset period K tuned after its lr."""

from __future__ import annotations

import math

import pytest
from _compare_helpers import GENERALIZE, SMALL

from pacs_megatron.tools.compare.protocol import grid_step, tune
from pacs_megatron.tools.compare.runs import Runner, Spec, run_name


class _Synthetic(Runner):
    """A runner whose runs are metrics rows made from the spec: the tuning rules in isolation."""

    def __init__(self, tune_seeds, score):
        import argparse

        super().__init__(argparse.Namespace(out="/nonexistent", tune_seeds=tune_seeds))
        self.score, self.ran = score, []

    def run_dir(self, *spec):  # no run has a directory: nothing to restore, no CPU or dtype on record
        from pathlib import Path

        return Path(self.args.out) / "runs" / run_name(*spec)

    def restore(self, spec):
        pass

    def run_all(self, specs):
        self.ran += [Spec(*s) for s in specs]
        rows = lambda s: [  # noqa: E731
            {"step": 1, "reward/mean": 0.5, "val/tune/pass@1": self.score(s), "val/report/pass@1": -self.score(s)}
        ]
        return {Spec(*s): rows(Spec(*s)) for s in specs}


def test_grid_grows_until_the_optimum_is_interior():
    assert grid_step([3e-5, 1e-4, 3e-4, 1e-3, 3e-3], 1) == 1e-2 and grid_step([3e-5, 1e-4], -1) == 1e-5
    peak = 1e-5  # below the grid: two growth steps reach it, then one more value shows it is interior
    runner = _Synthetic(2, lambda s: -abs(math.log10(s.lr / peak)))
    out = tune(runner, {"pacs": [3e-4, 1e-4]}, lambda m, lr, seed: Spec(m, lr, seed), "val/tune/pass@1", 3)
    assert out["pacs"]["chosen"] == pytest.approx(1e-5) and out["pacs"]["interior"]
    assert out["pacs"]["grid"] == pytest.approx([3e-6, 1e-5, 3e-5, 1e-4, 3e-4])
    assert {s.seed for s in runner.ran} == {1000, 1001}  # tuning never touches the reported seeds
    # Bounded: with max_extend=1 an optimum still at the edge is chosen and flagged as not interior.
    out = tune(
        _Synthetic(1, lambda s: -s.lr),
        {"grpo": [1e-4, 3e-4]},
        lambda m, lr, seed: Spec(m, lr, seed),
        "val/tune/pass@1",
        1,
    )
    assert out["grpo"]["chosen"] == pytest.approx(3e-5) and not out["grpo"]["interior"]
    # The score is the tuning key's: the report key (the negation here) would pick the other end.
    out = tune(
        _Synthetic(1, lambda s: s.lr),
        {"ppo": [1e-4, 3e-4, 1e-3]},
        lambda m, lr, seed: Spec(m, lr, seed),
        "val/report/pass@1",
        0,
    )
    assert out["ppo"]["chosen"] == pytest.approx(1e-4)


def test_each_method_tunes_on_its_own_grid(tmp_path, monkeypatch):
    """--method-lrs gives a method its own grid (LoRA's lrs are ~10x full fine-tuning's, issue 43): the full
    arm tunes on --lrs, the LoRA arm on its grid, each reported at its own choice; a grid for a method that
    is not compared is refused in one line (it would do nothing)."""
    import argparse

    from pacs_megatron.config import ConfigError
    from pacs_megatron.tools.compare import protocol as compare_mod

    peaks = {"pacs": 1e-5, "pacs_lora": 1e-4}
    runner = _Synthetic(1, lambda s: -abs(math.log10(s.lr / peaks[s.method])))
    monkeypatch.setattr(compare_mod, "Runner", lambda args: runner)
    monkeypatch.setattr(compare_mod, "plot", lambda summary, path: None)
    args = argparse.Namespace(
        config="c.yaml", out=str(tmp_path), overrides=[], steps=0, seeds=1, tune_seeds=1, max_extend=0,
        methods=["pacs", "pacs_lora"], lrs=[3e-6, 1e-5, 3e-5], method_lrs={"pacs_lora": [3e-5, 1e-4, 3e-4]},
        critic_lrs=[], reset_every=[], val_key="val/report/pass@1", tune_key="val/tune/pass@1",
        score_validations=3, pairs=[], results="",
    )  # fmt: skip
    summary = compare_mod.compare(args)
    assert summary["tuning"]["pacs"]["lr"]["grid"] == pytest.approx([3e-6, 1e-5, 3e-5])
    assert summary["tuning"]["pacs_lora"]["lr"]["grid"] == pytest.approx([3e-5, 1e-4, 3e-4])
    assert summary["methods"]["pacs"]["lr"] == pytest.approx(1e-5)
    assert summary["methods"]["pacs_lora"]["lr"] == pytest.approx(1e-4)
    assert {(s.method, s.lr) for s in runner.ran if s.seed == 0} == {("pacs", 1e-5), ("pacs_lora", 1e-4)}
    assert summary["method_lrs"] == {"pacs_lora": [3e-5, 1e-4, 3e-4]}
    with pytest.raises(ConfigError, match=r"--method-lrs 'grpo=1e-4': give METHOD=GRID for a method of --methods"):
        compare_mod._method_grids(["grpo=1e-4"], ["pacs", "pacs_lora"])
    with pytest.raises(ConfigError, match=r"--method-lrs pacs_lora= 'x'"):
        compare_mod._method_grids(["pacs_lora=x"], ["pacs_lora"])


def test_pacs_v2_tunes_its_reset_period_at_its_chosen_lr(tmp_path, monkeypatch):
    """--reset-every tunes PACS v2's K on the validation split after its lr (issue 39: "choose K by
    measurement"): a second pass at the chosen lr on the tuning seeds, the config's own K (10, pacs_v2's)
    reused from the lr pass, not run twice; other methods are untouched; the K a run trains with is its last
    override, so a user's override of it cannot silently cancel the pass."""
    import argparse

    from pacs_megatron.config import ConfigError
    from pacs_megatron.tools.compare import protocol as compare_mod

    class Tuned(_Synthetic):
        def __init__(self, score):
            super().__init__(1, score)
            self.args = argparse.Namespace(
                config=str(GENERALIZE), out=str(tmp_path), steps=4, overrides=SMALL, tune_seeds=1
            )

    def score(s):  # lr peak 1e-3 for both; pacs_v2 best at K 5
        k = 10 if s.reset_every is None else s.reset_every
        return -abs(math.log10(s.lr / 1e-3)) - (abs(k - 5) / 100 if s.method == "pacs_v2" else 0)

    runner = Tuned(score)
    monkeypatch.setattr(compare_mod, "Runner", lambda args: runner)
    monkeypatch.setattr(compare_mod, "plot", lambda summary, path: None)
    args = argparse.Namespace(
        config=str(GENERALIZE), out=str(tmp_path), overrides=SMALL, steps=4, seeds=1, tune_seeds=1, max_extend=0,
        methods=["pacs", "pacs_v2"], lrs=[3e-4, 1e-3, 3e-3], method_lrs={}, critic_lrs=[], reset_every=[5, 10, 20],
        val_key="val/report/pass@1", tune_key="val/tune/pass@1", score_validations=3, pairs=[], results="",
    )  # fmt: skip
    summary = compare_mod.compare(args)
    assert (
        list(summary["tuning"]["pacs_v2"]) == ["lr", "reset_every"] and "reset_every" not in summary["tuning"]["pacs"]
    )
    assert summary["tuning"]["pacs_v2"]["reset_every"]["chosen"] == 5
    assert (
        summary["methods"]["pacs_v2"]["lr"] == pytest.approx(1e-3) and summary["methods"]["pacs_v2"]["reset_every"] == 5
    )
    k_runs = [s for s in runner.ran if s.method == "pacs_v2" and s.lr == pytest.approx(1e-3) and s.seed == 1000]
    assert sorted(s.reset_every or 10 for s in k_runs) == [5, 10, 10, 20]  # K 10: the lr pass's run, asked again
    assert len({s for s in k_runs}) == 3
    assert Spec("pacs_v2", 1e-3, 0, None, 5) in runner.ran  # reported at the chosen K
    assert runner.settings("pacs_v2", 1e-3, 0, None, 5)[-1] == "algorithm.reference_reset_every=5"
    assert run_name("pacs_v2", 1e-3, 0, None, 5) == "pacs_v2_lr0.001_k5_s0"
    assert "| pacs_v2 | reset_every | 5 |" in compare_mod.table(summary)
    for flags, match in (
        (["--reset-every", "5,10"], "no method of --methods pacs anchors on the reference"),
        (["--methods", "pacs_v2", "--reset-every", "2.5"], "K is a number of steps"),
    ):
        bad = argparse.ArgumentParser()
        compare_mod.add_arguments(bad)
        ns = bad.parse_args(["--config", str(GENERALIZE), "--out", str(tmp_path), "--methods", "pacs", *flags])
        with pytest.raises(ConfigError, match=match):
            compare_mod.check_args(ns)
