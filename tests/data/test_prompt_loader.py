"""PromptDataLoader: fixed order per (seed, epoch) and exact resume from state_dict()."""
import pytest

from megaflow.data import PromptDataLoader, epoch_order


class IndexDataset:
    """Items are their own index, collated into a DataProto by the loader's collate_fn."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"index": i}


def indices(batch):
    return [int(i) for i in batch.non_tensor_batch["index"]]


def run(loader, num_batches):
    """The next ``num_batches`` batches, moving to new epochs as the trainer does."""
    out, it = [], iter(loader)
    while len(out) < num_batches:
        try:
            out.append(indices(next(it)))
        except StopIteration:
            it = iter(loader)
    return out


def test_epoch_is_a_seeded_permutation():
    a = epoch_order(50, epoch=0, seed=3)
    assert sorted(a.tolist()) == list(range(50))
    assert a.tolist() == epoch_order(50, epoch=0, seed=3).tolist()
    assert a.tolist() != epoch_order(50, epoch=1, seed=3).tolist()
    assert a.tolist() != epoch_order(50, epoch=0, seed=4).tolist()
    assert epoch_order(5, epoch=7, seed=1, shuffle=False).tolist() == [0, 1, 2, 3, 4]


def test_batches_follow_the_epoch_order_and_drop_last():
    loader = PromptDataLoader(IndexDataset(10), 3, seed=5)
    assert len(loader) == 3
    batches = run(loader, 6)  # two epochs of 3 batches; 1 sample dropped per epoch
    for epoch, start in ((0, 0), (1, 3)):
        order = epoch_order(10, epoch=epoch, seed=5).tolist()
        assert sum(batches[start:start + 3], []) == order[:9]
    assert loader.epoch == 1


def test_same_seed_same_batches_in_a_new_loader():
    assert run(PromptDataLoader(IndexDataset(17), 4, seed=9), 9) == \
        run(PromptDataLoader(IndexDataset(17), 4, seed=9), 9)


@pytest.mark.parametrize("stop_after", [1, 2, 4, 5, 7])
def test_resume_continues_exactly(stop_after):
    """Stop after k batches (mid-epoch, at an epoch boundary, in epoch 2) and resume."""
    reference = run(PromptDataLoader(IndexDataset(11), 3, seed=2), 10)
    first = PromptDataLoader(IndexDataset(11), 3, seed=2)
    head = run(first, stop_after)
    state = first.state_dict()
    resumed = PromptDataLoader(IndexDataset(11), 3, seed=2)
    resumed.load_state_dict(state)
    assert head + run(resumed, 10 - stop_after) == reference


def test_state_after_a_completed_epoch_starts_the_next():
    loader = PromptDataLoader(IndexDataset(6), 3, seed=0)
    list(iter(loader))  # one full epoch, generator exhausted
    assert loader.state_dict()["epoch"] == 1 and loader.state_dict()["position"] == 0
    nxt = indices(next(iter(loader)))
    assert nxt == epoch_order(6, epoch=1, seed=0).tolist()[:3]


def test_keep_last_for_validation():
    loader = PromptDataLoader(IndexDataset(7), 3, shuffle=False, drop_last=False)
    assert len(loader) == 3
    assert [indices(b) for b in loader] == [[0, 1, 2], [3, 4, 5], [6]]
    assert [indices(b) for b in loader] == [[0, 1, 2], [3, 4, 5], [6]]  # next epoch, same order


def test_load_state_rejects_a_changed_setup():
    state = PromptDataLoader(IndexDataset(10), 2, seed=1).state_dict()
    with pytest.raises(ValueError, match=r"num_samples: saved 10 vs now 12"):
        PromptDataLoader(IndexDataset(12), 2, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match=r"seed: saved 1 vs now 2.*batch_size: saved 2 vs now 5"):
        PromptDataLoader(IndexDataset(10), 5, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match=r"missing keys \['position'"):
        PromptDataLoader(IndexDataset(10), 2, seed=1).load_state_dict({"epoch": 0})


def test_bad_construction():
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        PromptDataLoader(IndexDataset(4), 0)
    with pytest.raises(ValueError, match="the dataset has 3 prompts, fewer than one batch of 4"):
        PromptDataLoader(IndexDataset(3), 4)
