"""RewardScorer: in-process and worker-pool scoring, timeouts, exceptions, hung and dying workers."""

import time

import pytest

from pacs_megatron.config import RewardConfig
from pacs_megatron.reward import RewardFunctionError, RewardScorer


def _score(scorer, responses, answers=None, extras=None):
    answers = answers or ["a"] * len(responses)
    return scorer.score(["p"] * len(responses), responses, answers, extras)


@pytest.mark.subprocess
def test_inline_scores_and_counts_errors():
    with RewardScorer(RewardConfig(fn="reward_user_fns:raising", num_workers=0)) as s:
        scores, m = _score(s, ["ok", "raise", "ok"])
    assert scores == [1.0, 0.0, 1.0]
    assert m["reward/errors"] == 1.0 and m["reward/timeouts"] == 0.0


@pytest.mark.subprocess
def test_inline_wrong_return_type_raises():
    with RewardScorer(RewardConfig(fn="reward_user_fns:returns_str", num_workers=0)) as s:
        with pytest.raises(RewardFunctionError, match="returned str"):
            _score(s, ["x"])


def test_bad_spec_fails_at_construction():
    with pytest.raises(RewardFunctionError, match="no attribute"):
        RewardScorer(RewardConfig(fn="reward_user_fns:nope", num_workers=2))


@pytest.mark.subprocess
def test_length_mismatch_is_named():
    with RewardScorer(RewardConfig(fn="arith", num_workers=0)) as s:
        with pytest.raises(ValueError, match="ground_truths has 1 entries for 2 responses"):
            s.score(["p", "p"], ["1", "2"], ["1"])


@pytest.mark.subprocess
def test_pool_math_and_user_extras():
    """The math reward and a user function run in spawned workers; results keep input order."""
    with RewardScorer(RewardConfig(fn="math", num_workers=2, timeout_s=30)) as s:
        scores, m = s.score(
            ["q"] * 4, ["\\boxed{\\frac12}", "\\boxed{3}", "x = 1,080", "\\boxed{2}"], ["0.5", "4", "1080", "2"]
        )
    assert scores == [1.0, 0.0, 1.0, 1.0]
    assert m == {"reward/timeouts": 0.0, "reward/errors": 0.0, "reward/worker_restarts": 0.0}
    with RewardScorer(RewardConfig(fn="reward_user_fns:exact", num_workers=1)) as s:
        scores, _ = _score(s, ["a", "b"], extras=[None, {"bonus": 0.25}])
    assert scores == [1.0, 0.25]


@pytest.mark.subprocess
def test_pool_timeout_error_hang_and_crash_never_stop_the_batch():
    """A sleeping sample times out, a raising one errors, and the scorer still finishes quickly and
    keeps working afterwards with replaced workers."""
    cfg = RewardConfig(fn="reward_user_fns:sleepy", num_workers=2, timeout_s=1.0)
    with RewardScorer(cfg) as s:
        _score(s, ["warm"])  # start the workers outside the timed part
        t0 = time.monotonic()
        scores, m = _score(s, ["ok", "sleep", "ok", "ok", "ok", "ok"])
        took = time.monotonic() - t0
        assert scores == [1.0, 0.0, 1.0, 1.0, 1.0, 1.0]
        assert m["reward/timeouts"] == 1.0 and m["reward/errors"] == 0.0
        # Two hangs at once and nothing else moving for timeout_s after them: the reward hangs, and the
        # rest of the batch is given up at once (one timeout per batch, see accounting.py). Both hangs
        # start the batch (one per worker; a batch starts when every worker is ready, so the worker replaced in
        # the call above cannot join 75 ms late), so they time out together whatever the load; with a
        # hang behind answers the outcome depended on how fast those answers came (flaky under load).
        scores, m = _score(s, ["sleep", "sleep", "ok", "ok", "ok", "ok"])
        assert scores == [0.0] * 6 and m["reward/timeouts"] == 6.0
        assert took < 15.0, f"timed-out samples held the batch for {took:.1f}s"
        scores, m = _score(s, ["ok"] * 3)  # replaced workers serve the next batch
        assert scores == [1.0] * 3 and m["reward/timeouts"] == 0.0

    with RewardScorer(RewardConfig(fn="reward_user_fns:hang", num_workers=1, timeout_s=1.0)) as s:
        t0 = time.monotonic()
        scores, m = _score(s, ["hang", "ok"])
        assert scores == [0.0, 1.0] and m["reward/timeouts"] == 1.0
        assert time.monotonic() - t0 < 20.0

    with RewardScorer(RewardConfig(fn="reward_user_fns:crash", num_workers=1, timeout_s=5.0)) as s:
        scores, m = _score(s, ["ok", "crash", "ok"])
        assert scores == [1.0, 0.0, 1.0]
        assert m["reward/errors"] == 1.0 and m["reward/worker_restarts"] == 1.0

    with RewardScorer(RewardConfig(fn="reward_user_fns:raising", num_workers=1)) as s:
        scores, m = _score(s, ["raise", "ok", "raise"])
        assert scores == [0.0, 1.0, 0.0] and m["reward/errors"] == 2.0


@pytest.mark.subprocess
def test_nan_and_inf_scores_are_counted_reward_errors():
    with RewardScorer(RewardConfig(fn="reward_user_fns:nan_on", num_workers=1)) as s:
        scores, m = _score(s, ["nan", "ok", "inf"])
        assert scores == [0.0, 1.0, 0.0] and m["reward/errors"] == 2.0
        assert "returned inf: a reward must be finite" in s.last_error


@pytest.mark.subprocess
def test_a_hanging_reward_costs_one_timeout_per_batch_not_one_per_response():
    for workers, budget in ((2, 4.0), (1, 7.0)):  # one worker: the first timeout may be one bad answer
        with RewardScorer(RewardConfig(fn="reward_user_fns:sleepy", num_workers=workers, timeout_s=1.0)) as s:
            _score(s, ["warm"])
            t0 = time.monotonic()
            scores, m = _score(s, ["sleep"] * 16)
            took = time.monotonic() - t0
            assert scores == [0.0] * 16 and m["reward/timeouts"] == 16.0
            assert took < budget, f"{workers} worker(s): 16 hanging responses took {took:.1f}s"
            assert _score(s, ["ok"] * 2)[0] == [1.0, 1.0]  # replaced workers serve the next batch


@pytest.mark.subprocess
def test_pool_wrong_return_type_raises():
    with RewardScorer(RewardConfig(fn="reward_user_fns:returns_str", num_workers=1)) as s:
        with pytest.raises(RewardFunctionError, match="returned str"):
            _score(s, ["x"])


@pytest.mark.subprocess
def test_pool_works_whatever_the_parents_main_is():
    """Workers are fresh interpreters: a parent run as ``python -`` (no importable __main__, which
    multiprocessing's spawn would re-import) still scores, and user modules resolve via sys.path."""
    import subprocess
    import sys
    from pathlib import Path

    script = (
        "import sys\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "from pacs_megatron.config import RewardConfig\n"
        "from pacs_megatron.reward import RewardScorer\n"
        "with RewardScorer(RewardConfig(fn='reward_user_fns:exact', num_workers=1)) as s:\n"
        "    print(s.score(['p', 'p'], ['a', 'b'], ['a', 'a'])[0])\n"
    )
    out = subprocess.run([sys.executable, "-"], input=script, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[1.0, 0.0]"
