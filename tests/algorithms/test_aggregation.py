"""Loss aggregation modes and split invariance with global denominators."""
from __future__ import annotations


import pytest
import torch

from megaflow.algorithms import (
    LOSS_AGG_MODES,
    aggregate_loss,
    clipped_value_loss,
    entropy_bonus,
    gspo_policy_loss,
    kl_loss,
    ppo_policy_loss,
)

NAN = float("nan")
LOSS = torch.tensor([[1.0, 2.0, 3.0, NAN], [NAN, NAN, NAN, NAN], [4.0, NAN, 6.0, NAN], [5.0, NAN, NAN, NAN]])
MASK = torch.tensor([[1, 1, 1, 0], [0, 0, 0, 0], [1, 0, 1, 0], [1, 0, 0, 0]])
# valid tokens: row0 {1,2,3}, row2 {4,6} (observation gap), row3 {5}; row1 fully masked
BY_HAND = {
    "token-mean": (1 + 2 + 3 + 4 + 6 + 5) / 6,
    "seq-mean-token-sum": (6 + 10 + 5) / 3,
    "seq-mean-token-mean": (6 / 3 + 10 / 2 + 5 / 1) / 3,
    "seq-mean-token-sum-norm": (6 + 10 + 5) / (3 * 4),
}


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_modes_by_hand(mode):
    assert aggregate_loss(LOSS, MASK, mode).item() == pytest.approx(BY_HAND[mode])


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_fully_masked_rows_and_padding_columns_change_nothing(mode):
    base = aggregate_loss(LOSS, MASK, mode, norm_length=4)
    more_rows = aggregate_loss(torch.cat([LOSS, torch.full((3, 4), NAN)]), torch.cat([MASK, torch.zeros(3, 4)]),
                               mode, norm_length=4)
    wider = aggregate_loss(torch.cat([LOSS, torch.full((4, 5), 7.0)], 1), torch.cat([MASK, torch.zeros(4, 5)], 1),
                           mode, norm_length=4)
    assert more_rows.item() == pytest.approx(base.item()) and wider.item() == pytest.approx(base.item())


def _counts(mask):
    """(valid tokens, sequences with >= 1 valid token): what the engine all-reduces over DP."""
    valid = mask != 0
    return torch.stack([valid.sum(), valid.any(-1).sum()])


def test_global_denominators():
    assert aggregate_loss(LOSS, MASK, "token-mean", global_num_tokens=12).item() == pytest.approx(21 / 12)
    assert aggregate_loss(LOSS, MASK, "seq-mean-token-sum", global_num_seqs=torch.tensor(7)).item() == \
        pytest.approx(21 / 7)
    assert aggregate_loss(LOSS, MASK, "seq-mean-token-sum-norm", global_num_seqs=7, norm_length=10).item() == \
        pytest.approx(21 / 70)
    assert aggregate_loss(LOSS, torch.zeros(4, 4), "seq-mean-token-mean").item() == 0.0
    assert aggregate_loss(LOSS, torch.zeros(4, 4), "token-mean", global_num_tokens=0).item() == 0.0


def test_local_denominators_without_globals():
    """Without global denominators each micro-batch is normalised by its own counts."""
    top = aggregate_loss(LOSS[:2], MASK[:2], "token-mean")
    bottom = aggregate_loss(LOSS[2:], MASK[2:], "token-mean")
    assert top.item() == pytest.approx(2.0) and bottom.item() == pytest.approx(5.0)
    assert (top + bottom).item() != pytest.approx(BY_HAND["token-mean"])


def test_aggregation_bad_input():
    with pytest.raises(ValueError) as err:
        aggregate_loss(LOSS, MASK, "mean")
    assert all(mode in str(err.value) for mode in LOSS_AGG_MODES)
    with pytest.raises(ValueError, match="mask"):
        aggregate_loss(LOSS, MASK[:, :3], "token-mean")
    with pytest.raises(ValueError, match="global_num_tokens"):
        aggregate_loss(LOSS, MASK, "token-mean", global_num_tokens=-1)
    with pytest.raises(ValueError, match="global_num_seqs"):
        aggregate_loss(LOSS, MASK, "seq-mean-token-sum", global_num_seqs=torch.ones(2))
    with pytest.raises(ValueError, match="norm_length"):
        aggregate_loss(LOSS, MASK, "seq-mean-token-sum-norm", norm_length=0)


# ----------------------------------------------------------------- split invariance

def _pg(fn, **extra):
    def loss(b, lp, mode, **agg):
        return fn(lp, b["old_log_probs"], b["advantages"], b["response_mask"], loss_agg_mode=mode, **extra, **agg)[0]
    return loss


LOSSES = {
    "aggregate_loss": lambda b, lp, mode, **g: aggregate_loss(
        lp * torch.nan_to_num(b["advantages"]), b["response_mask"], mode, **g),
    "ppo": _pg(ppo_policy_loss, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0),
    "gspo": _pg(gspo_policy_loss, clip_ratio_low=0.1, clip_ratio_high=0.1),
    "value": lambda b, v, mode, **g: clipped_value_loss(
        v, b["old_values"], b["returns"], b["response_mask"], cliprange_value=0.2, loss_agg_mode=mode, **g)[0],
    "kl": lambda b, lp, mode, **g: kl_loss(lp, b["ref_log_probs"], b["response_mask"], kind="k3+",
                                           loss_agg_mode=mode, **g)[0],
    "entropy": lambda b, e, mode, **g: entropy_bonus(e, b["response_mask"], loss_agg_mode=mode, **g)[0],
}
LEAF = {"value": "values", "entropy": "entropy"}


def _loss_and_grad(name, batch, mode, splits):
    """Sum of per-chunk losses with global denominators; chunks = DP ranks x micro-batches."""
    leaf = batch[LEAF.get(name, "log_probs")].clone().requires_grad_()
    fn = LOSSES[name]
    chunks = torch.arange(leaf.shape[0]).tensor_split(splits)
    counts = sum(_counts(batch["response_mask"][idx]) for idx in chunks)  # = all-reduce
    total = 0.0
    for idx in chunks:
        part = {k: v[idx] for k, v in batch.items()}
        total = total + fn(part, leaf[idx], mode, global_num_tokens=counts[0], global_num_seqs=counts[1],
                           norm_length=9)
    total.backward()
    return total.detach(), leaf.grad


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("name", sorted(LOSSES))
def test_split_1_2_4_ways_same_loss_and_gradient(make_batch, name, mode):
    batch = make_batch(seed=11, batch=8, length=9)
    leaf_name = LEAF.get(name, "log_probs")
    # unsplit reference without any global denominator (local counts = full batch)
    leaf = batch[leaf_name].clone().requires_grad_()
    full = LOSSES[name](batch, leaf, mode, norm_length=9)
    full.backward()
    assert torch.isfinite(full) and torch.isfinite(leaf.grad).all()
    assert torch.count_nonzero(leaf.grad[batch["response_mask"] == 0]) == 0
    for splits in (1, 2, 4, 3):
        loss, grad = _loss_and_grad(name, batch, mode, splits)
        assert loss.item() == pytest.approx(full.item(), rel=1e-12, abs=1e-14), splits
        assert torch.allclose(grad, leaf.grad, rtol=1e-10, atol=1e-14), splits
