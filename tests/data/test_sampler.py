"""PromptDataset: per-epoch deterministic shuffling, epoch crossing, exact resume."""

import pytest

from pacs_megatron.data import PromptDataset, PromptRecord


def _records(n):
    return [
        PromptRecord(id=str(i), problem="", prompt_text="", prompt_ids=(i,), answer="", source="t") for i in range(n)
    ]


def test_every_epoch_is_a_permutation_and_epochs_differ():
    ds = PromptDataset(_records(25), seed=3)
    epochs = [[r.id for r in ds.next_batch(25)] for _ in range(3)]
    for e in epochs:
        assert sorted(e, key=int) == [str(i) for i in range(25)]
    assert epochs[0] != epochs[1] != epochs[2]
    again = PromptDataset(_records(25), seed=3)
    assert [r.id for r in again.next_batch(75)] == sum(epochs, [])
    assert [r.id for r in PromptDataset(_records(25), seed=4).next_batch(25)] != epochs[0]


def test_batch_larger_than_dataset_takes_consecutive_epochs():
    ds = PromptDataset(_records(25), seed=0)
    batch = [r.id for r in ds.next_batch(50)]
    assert sorted(batch[:25], key=int) == sorted(batch[25:], key=int) == [str(i) for i in range(25)]
    assert ds.state_dict()["epoch"] == 2 and ds.state_dict()["position"] == 0


def test_resume_reproduces_the_stream():
    full = PromptDataset(_records(7), seed=11)
    expected = [[r.id for r in full.next_batch(k)] for k in (3, 5, 4, 9, 2)]
    ds = PromptDataset(_records(7), seed=11)
    got = [[r.id for r in ds.next_batch(k)] for k in (3, 5)]
    state = ds.state_dict()
    resumed = PromptDataset(_records(7), seed=11)
    resumed.load_state_dict(state)
    got += [[r.id for r in resumed.next_batch(k)] for k in (4, 9, 2)]
    assert got == expected


def test_unshuffled_order_and_state_mismatch():
    ds = PromptDataset(_records(4), seed=0, shuffle=False)
    assert [r.id for r in ds.next_batch(6)] == ["0", "1", "2", "3", "0", "1"]
    other = PromptDataset(_records(5), seed=0, shuffle=False)
    with pytest.raises(ValueError, match="num_records=4 but this run has 5"):
        other.load_state_dict(ds.state_dict())
    with pytest.raises(ValueError, match="empty"):
        PromptDataset([])
