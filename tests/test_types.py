"""mypy passes over the package with pyproject.toml's [tool.mypy] (issue 30 item 7): lenient everywhere, strict
(every def typed) on pacs/, config/ and cli.py, minus a baseline list of modules whose errors are not yet fixed."""

from __future__ import annotations

from pathlib import Path

from mypy import api

REPO = Path(__file__).resolve().parents[1]


def _mypy(*extra: str) -> tuple[str, int]:
    # the cache makes the second run incremental: only the shadowed module and its importers are checked again
    args = ["--config-file", str(REPO / "pyproject.toml"), "--cache-dir", str(REPO / ".mypy_cache"), *extra]
    out, err, status = api.run([*args, str(REPO / "pacs_megatron")])
    return out + err, status


def test_mypy_passes_and_is_strict_on_pacs(tmp_path):
    out, status = _mypy()
    assert status == 0 and "Success: no issues found" in out, out
    # an untyped def in pacs/ (strict) fails; mypy reads the shadow copy in place of the real file
    loss = REPO / "pacs_megatron" / "pacs" / "loss.py"
    shadow = tmp_path / "loss.py"
    shadow.write_text(loss.read_text() + "\n\ndef _untyped(x):\n    return x\n")
    out, status = _mypy("--shadow-file", str(loss), str(shadow))
    assert status == 1 and "loss.py:" in out and "Function is missing a type annotation" in out, out


# The baseline of 2026-11-27 (issue 41): modules whose mypy errors are silenced. It may only shrink; a module
# that leaves it (typed) is deleted here too. The run wing (run/*) left it when it moved under the strict list.
BASELINE_2026_11_27 = frozenset(
    {
        *(f"pacs_megatron.actor.{m}" for m in ("convert", "forward", "hf_io", "train_step")),
        *(f"pacs_megatron.bench.{m}" for m in ("batching", "logprob", "memory", "rl_step", "rollout")),
        *(f"pacs_megatron.data.{m}" for m in ("batching", "factory", "prompts", "routing", "sources")),
        *(f"pacs_megatron.launch.{m}" for m in ("engine_rank", "local", "ray_rank")),
        *(
            f"pacs_megatron.rollout.{m}"
            for m in ("collect", "hf_engine", "remote", "server", "vllm_engine", "vllm_reload")
        ),
        *(f"pacs_megatron.tools.{m}" for m in ("doctor", "selftest", "selftest_checks")),
        *(f"pacs_megatron.weight_sync.{m}" for m in ("quantize", "remote", "sync")),
        *(
            f"pacs_megatron.{m}"
            for m in ("critic_stages", "diagnostics", "rollout", "sampling_stages", "stages", "train")
        ),
        "pacs_megatron.parallel.cpu_patches",
        "pacs_megatron.utils.logging",
    }
)


def test_the_baseline_only_shrinks_and_the_run_wing_is_strict():
    import tomllib

    overrides = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["mypy"]["overrides"]
    baseline = {m for o in overrides if o.get("ignore_errors") for m in o["module"]}
    strict = {m for o in overrides if o.get("disallow_untyped_defs") for m in o["module"]}
    assert baseline <= BASELINE_2026_11_27, f"new modules silenced: {sorted(baseline - BASELINE_2026_11_27)}"
    assert {"pacs_megatron.pacs.*", "pacs_megatron.config.*", "pacs_megatron.run.*"} <= strict
