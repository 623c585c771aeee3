"""The batch-assembly stage with its switches, on a fake engine and scorer (no model, no ranks):

- switches off: exactly the batch of the switch-free path (prompts -> generate -> score -> pack);
- ``filter_groups=mixed``: every trained group is mixed; counters; prompts past the last trained one go
  back to the stream, so a run resumed from the dataset's saved state trains exactly the same prompts;
- a short batch trains whole mini-batches or fails, as configured, with one line naming the fix;
- overlong: DAPO's penalty on the rewards, truncated rows weighted 0 (and multiplied into IS weights).
"""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest
import torch

from pacs_megatron.batch.rows import as_train_batch
from pacs_megatron.config import load_config
from pacs_megatron.data.records import PromptRecord
from pacs_megatron.data.sampler import PromptDataset
from pacs_megatron.loop import sampling_stages, stages, update_stages
from pacs_megatron.pacs.overlong import overlong_penalty
from pacs_megatron.reward.accounting import FailureGuard
from pacs_megatron.rollout.base import EngineTraits
from pacs_megatron.rollout.collect import ShardedSteps
from pacs_megatron.rollout.types import Response

N, MAX_LEN = 4, 4
BASE = [
    f"rollout.n={N}",
    f"rollout.max_response_length={MAX_LEN}",
    "trainer.train_batch_size=6",
    "algorithm.mini_batch_size=3",
    "algorithm.micro_batch_size=4",
    "data.max_prompt_length=8",
]


class FakeEngine(ShardedSteps):
    """Answers digit strings: response j to a prompt is drawn from (prompt, seed, j), so a prompt gives other
    answers in another step or round; ``p_right`` sets how often it is right. Some responses hit max_tokens."""

    def __init__(self, p_right: float = 0.5) -> None:
        self.p_right = p_right

    def traits(self) -> EngineTraits:
        return EngineTraits()  # one replica: no ranks here

    def generate(self, prompts, sampling):
        out = []
        for p in prompts:
            group = []
            for j in range(sampling.n):
                rng = random.Random(f"{tuple(p)}-{sampling.seed}-{j}")
                text = "1" if rng.random() < self.p_right else "2"
                length = rng.randint(1, sampling.max_tokens)
                reason = "length" if length == sampling.max_tokens and rng.random() < 0.7 else "stop"
                group.append(Response(tuple([5] * length), text, reason, logprobs=tuple([-0.5] * length)))
            out.append(group)
        return out


class FakeScorer:
    cfg = SimpleNamespace(fn="fake")
    last_error = ""

    def __init__(self) -> None:
        self.guard = FailureGuard("fake", 0)

    def score(self, prompts, responses, answers, extras):
        return [float(r == a) for r, a in zip(responses, answers)], {"reward/errors": 0.0, "reward/timeouts": 0.0}


def _records(k: int = 40) -> list[PromptRecord]:
    return [PromptRecord(f"p{i}", f"{i}", f"{i}", (10 + i, 3), "1", "t") for i in range(k)]


def _components(p_right: float = 0.5, seed: int = 3):
    return SimpleNamespace(
        engine=FakeEngine(p_right), scorer=FakeScorer(), dataset=PromptDataset(_records(), seed=seed), pad_id=0
    )


def _equal_batches(a, b) -> bool:
    fields = ("input_ids", "response_mask", "seq_lens", "scores", "group_ids", "rollout_logp", "is_weights")
    return all(
        (getattr(a, f) is None and getattr(b, f) is None) or torch.equal(getattr(a, f), getattr(b, f)) for f in fields
    )


def _ids(batch, c_records) -> list[str]:
    """Prompt ids of a batch's groups, from their token ids."""
    by_ids = {r.prompt_ids: r.id for r in c_records}
    return [by_ids[tuple(row[:2].tolist())] for row in batch.input_ids[:: batch.group_size]]


def test_switches_off_is_the_switch_free_path():
    cfg = load_config(None, BASE)
    a, b = _components(), _components()
    for step in (1, 2):
        got, got_m, got_s = sampling_stages.collect_step(cfg, a, step)
        want, want_m, want_s = stages.collect_batch(cfg, b, b.dataset.next_batch(6), step)
        assert _equal_batches(got, want) and got.is_weights is None
        assert {k: float(v) for k, v in got_m.items()} == {k: float(v) for k, v in want_m.items()} and got_s == want_s
    assert a.dataset.state_dict() == b.dataset.state_dict()


def test_filtering_trains_only_mixed_groups_and_resumes_exactly():
    cfg = load_config(None, BASE + ["algorithm.filter_groups=mixed", "algorithm.gen_batch_size=4"])
    full = _components()
    stream = [r.id for r in PromptDataset(_records(), seed=3).next_batch(400)]
    trained, pos = [], 0
    for step in range(1, 5):
        batch, m, _ = sampling_stages.collect_step(cfg, full, step)
        s = batch.scores.reshape(-1, N)
        assert len(batch) == 6 * N and bool((s.amax(1) != s.amin(1)).all()), "a trained group is not mixed"
        assert m["data/mixed_group_frac"] == 1.0 and m["sampling/trained_groups"] == 6
        assert m["sampling/kept_groups"] >= 6 and m["sampling/generated_groups"] == 4 * m["sampling/gen_rounds"]
        assert m["sampling/filtered_groups"] == m["sampling/generated_groups"] - m["sampling/kept_groups"]
        ids = _ids(batch, full.dataset.records)
        new_pos = full.dataset.epoch * 40 + full.dataset.position
        consumed = stream[pos:new_pos]
        assert m["sampling/returned_prompts"] == m["sampling/generated_groups"] - len(consumed)
        # the step used the stream up to its last trained prompt, in order: nothing skipped, nothing twice
        assert ids[-1] == consumed[-1] and [i for i in consumed if i in ids] == ids
        trained.append(ids)
        pos = new_pos

    # resume after step 2 from the dataset's saved state (as the checkpoint's extra_state holds it)
    first = _components()
    for step in (1, 2):
        sampling_stages.collect_step(cfg, first, step)
    resumed = _components()
    resumed.dataset.load_state_dict(json.loads(json.dumps(first.dataset.state_dict())))
    again = [_ids(sampling_stages.collect_step(cfg, resumed, step)[0], resumed.dataset.records) for step in (3, 4)]
    assert again == trained[2:]


def test_short_batch_trains_whole_mini_batches_or_fails(caplog):
    hard = ["algorithm.filter_groups=mixed", "algorithm.max_gen_batches=1"]
    cfg = load_config(None, BASE + hard)
    c = _components(p_right=0.3)  # one round of 6 prompts keeps 4 mixed groups
    batch, m, _ = sampling_stages.collect_step(cfg, c, 1)
    assert m["sampling/kept_groups"] < 6 and len(batch) == m["sampling/trained_groups"] * N == 3 * N
    assert "training on 3 groups (1 mini-batches of 3)" in caplog.text
    with pytest.raises(sampling_stages.ShortBatchError, match="algorithm.max_gen_batches=1.*short_batch=train"):
        sampling_stages.collect_step(
            load_config(None, BASE + hard + ["algorithm.short_batch=fail"]), _components(0.3), 1
        )
    none_mixed = _components(p_right=0.0)
    with pytest.raises(sampling_stages.ShortBatchError, match="0 of the 6 groups.*lower algorithm.mini_batch_size"):
        sampling_stages.collect_step(cfg, none_mixed, 1)
    assert none_mixed.dataset.position == 0  # nothing trained, nothing consumed


def test_overlong_penalty_and_truncation_mask():
    cfg = load_config(None, BASE + ["algorithm.loss=grpo", "algorithm.overlong.buffer_len=2"])
    cfg.algorithm.overlong.mask_truncated = True
    c, plain = _components(), _components()
    batch, m, _ = sampling_stages.collect_step(cfg, c, 1)
    base, _, _ = stages.collect_batch(cfg, plain, plain.dataset.next_batch(6), 1)
    lengths = base.response_mask.sum(1)
    penalty = overlong_penalty(lengths, MAX_LEN, 2, 1.0)
    assert torch.equal(batch.scores, base.scores + penalty) and (penalty < 0).any()
    truncated = torch.tensor([float(x) for x in (batch.is_weights.flatten() == 0)])
    assert 0 < truncated.sum() < len(batch) and (lengths[truncated.bool()] == MAX_LEN).all()
    assert m["overlong/masked_frac"] == pytest.approx(float(truncated.mean()))
    assert m["overlong/penalty_mean"] == pytest.approx(float(penalty.mean()))
    assert m["reward/mean"] == pytest.approx(float(base.scores.mean()))  # the verifier's, unshaped
    # rollout correction multiplies its weights into the truncation mask instead of replacing it
    cfg.algorithm.rollout_correction = "tis"
    local = as_train_batch(batch, batch.rollout_logp + 0.01)
    local, _ = update_stages.rollout_mismatch(cfg, local)
    assert torch.equal(
        local.is_weights == 0, (batch.is_weights == 0).expand_as(local.is_weights) | ~batch.response_mask
    )
