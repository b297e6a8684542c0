"""Bounded, visible validation: trainer.val_max_samples, the validation bar, an ETA that counts validation."""
from types import SimpleNamespace

import pytest
import torch

from megaflow.protocol import DataProto
from megaflow.trainer.main import build_loaders, validation_subset
from megaflow.trainer.ppo_trainer import EtaClock, RayPPOTrainer


class Items:
    """A map-style dataset of 50 one-token prompts whose token is the item's index."""

    def __len__(self):
        return 50

    def __getitem__(self, i):
        return i


def collate(items):
    ids = torch.tensor(items)[:, None]
    return DataProto.from_dict({"input_ids": ids, "attention_mask": torch.ones_like(ids)},
                               non_tensors={"data_source": ["arith"] * len(items)})


def test_val_max_samples_is_a_fixed_seeded_subset_reaching_the_val_loader(monkeypatch):
    import megaflow.data as data

    monkeypatch.setattr(data, "collate_fn", collate)

    def val_prompts(val_max_samples, seed=0):
        cfg = SimpleNamespace(data=SimpleNamespace(train_batch_size=4, shuffle=False, seed=seed, val_batch_size=8),
                              trainer=SimpleNamespace(val_max_samples=val_max_samples))
        _, val, _ = build_loaders(cfg, SimpleNamespace(train_dataset=Items(), val_dataset=Items()))
        return [int(t) for batch in val for t in batch.batch["input_ids"][:, 0]]

    every = val_prompts(None)
    assert every == list(range(50))
    picked = val_prompts(12)
    assert len(picked) == len(set(picked)) == 12 and picked == sorted(picked) and set(picked) < set(every)
    assert val_prompts(12) == picked  # the same prompts at every validation and in every run
    assert val_prompts(12, seed=1) != picked  # another data.seed, another subset
    assert set(val_prompts(6)) != set(picked[:6])  # a draw, not the first N
    assert val_prompts(50) == every and validation_subset(Items(), 80, seed=0).__class__ is Items


def test_validation_advances_a_bar_by_prompts():
    updates = []

    class Bar:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def update(self, n):
            updates.append(n)

    prompts = [DataProto.from_dict({"input_ids": torch.zeros(k, 3, dtype=torch.long)}) for k in (4, 4, 2)]
    tracker = SimpleNamespace(progress=lambda total, desc: updates.append((total, desc)) or Bar())
    trainer = SimpleNamespace(
        cfg=SimpleNamespace(rollout=SimpleNamespace(val_do_sample=False)), tracker=tracker,
        val_loader=type("Loader", (), {"dataset": [0] * 10, "__iter__": lambda self: iter(prompts)})(),
        rollouts=SimpleNamespace(sync=lambda: None), rollout=lambda batch, n, greedy: batch,
        score=lambda batch, keep_reward_fields: DataProto.from_dict(
            {"token_level_scores": torch.ones(len(batch), 2)}))
    metrics = RayPPOTrainer.validate(trainer)
    assert updates == [(10, "validation"), 4, 4, 2]
    assert metrics["val/score/mean"] == 2.0 and metrics["timing_s/validation"] >= 0.0


def test_eta_counts_the_validations_left_at_their_measured_time():
    eta = EtaClock(test_freq=2, total=5)
    eta.validated(30.0)  # before training (val_before_train)
    eta.stepped(10.0)
    # 4 steps of 10 s, and validations after steps 2, 4 and 5 (the last) of 30 s each
    assert eta.remaining(1) == pytest.approx(4 * 10 + 3 * 30)
    eta.stepped(20.0)
    eta.validated(50.0)
    assert eta.remaining(2) == pytest.approx(3 * 15 + 2 * 40)
    assert eta.remaining(5) == 0.0
    assert EtaClock(test_freq=-1, total=5).remaining(0) == 0.0  # nothing measured yet
    no_val = EtaClock(test_freq=0, total=3)
    no_val.stepped(4.0)
    assert no_val.remaining(1) == pytest.approx(8.0)  # test_freq 0: never validates
