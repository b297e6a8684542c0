"""``actor.on_policy_old_log_probs``: the old log-probs are the detached log-probs of the update's
own forward, so the separate old-log-prob forward can be skipped.

On a tiny random ``transformers`` Llama in one process, the actor's loss adapter is run over two
micro-batches of one mini-batch (gradient accumulation with global denominators):

* with the knob the ratio is exactly 1 on every micro-batch (approx KL and clip fraction 0);
* the gradient equals the path with a separately computed old-log-prob forward (row by row, as
  another micro-batch size would) within a norm-relative 1e-5, and equals the closed form of
  the on-policy PPO gradient, ``-sum(A * grad log pi) / N`` (ratio 1, nothing clipped);
* ``training/rollout_probs_diff_mean`` summed over micro-batches is the batch's token mean of
  ``|pi_old - pi_rollout|``;
* the knob is refused with any stage that reads the old log-probs before the update, or an
  update that is not on-policy by construction.
"""
from __future__ import annotations

import copy

import pytest
import torch

from megaflow.config import ConfigError
from megaflow.topology import run_from_dict

HF = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
      "num_key_value_heads": 2, "vocab_size": 16}
ROWS, SEQ, RESP = 4, 12, 5


def _tree(**sections):
    tree = {"model": {"hf_config": {"model_type": "llama", **HF}, "tokenizer": "arith"},
            "data": {"task": "arith", "train_batch_size": 16}, "resources": {"use_gpu": False}}
    for name, values in copy.deepcopy(sections).items():
        tree.setdefault(name, {}).update(values)
    return tree


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    return LlamaForCausalLM(LlamaConfig(**HF, attn_implementation="eager")).float()


def _batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, HF["vocab_size"], (ROWS, SEQ), generator=g)
    mask = torch.ones(ROWS, RESP)
    mask[1, 3:] = 0
    mask[3, 1:] = 0
    return {"input_ids": ids, "response_mask": mask, "advantages": torch.randn(ROWS, RESP, generator=g),
            "rollout_log_probs": -torch.rand(ROWS, RESP, generator=g) * 3}


def _log_probs(model, ids):
    """Log-probs ``[rows, RESP]`` of the last RESP tokens of ``ids`` under ``model``."""
    logits = model(input_ids=ids).logits[:, -RESP - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, -RESP:, None]).squeeze(-1)


def _accumulate(model, cfg, batch):
    """Gradients (one flat vector), loss and summed metric shares of one mini-batch in two micro-batches."""
    from megaflow.megatron.denominators import GlobalDenominators
    from megaflow.workers.losses import actor_loss_fn

    loss_fn = actor_loss_fn(cfg)
    den = GlobalDenominators(int(batch["response_mask"].sum()), ROWS)
    model.zero_grad()
    total, shares, per_micro = 0.0, {}, []
    for rows in (slice(0, 2), slice(2, 4)):
        mb = {k: v[rows] for k, v in batch.items()}
        loss, metrics = loss_fn({"log_probs": _log_probs(model, mb["input_ids"])}, mb, den)
        loss.backward()
        total += float(loss.detach())
        per_micro.append(metrics)
        for k, v in metrics.items():
            shares[k] = shares.get(k, 0.0) + float(v)
    grad = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    return grad, total, shares, per_micro


def test_on_policy_ratio_is_one_and_gradient_matches_the_separate_forward():
    batch = _batch()
    model = _model()
    with torch.no_grad():  # the separate old-log-prob pass, one row at a time
        old = torch.cat([_log_probs(model, batch["input_ids"][i:i + 1]) for i in range(ROWS)])
    off = run_from_dict(_tree())
    on = run_from_dict(_tree(actor={"on_policy_old_log_probs": True}))
    grad_ref, loss_ref, _, _ = _accumulate(model, off, {**batch, "old_log_probs": old})
    grad_on, loss_on, shares, per_micro = _accumulate(model, on, batch)

    for metrics in per_micro:  # every micro-batch, the first included
        assert float(metrics["actor/approx_kl"]) == 0.0
        assert float(metrics["actor/clip_fraction"]) == 0.0
    assert torch.linalg.vector_norm(grad_on - grad_ref) <= 1e-5 * torch.linalg.vector_norm(grad_ref)
    assert loss_on == pytest.approx(loss_ref, rel=1e-5)

    # closed form at ratio 1: loss = -token mean of A; gradient = -sum(A * grad log pi) / N
    mask, adv = batch["response_mask"], batch["advantages"]
    assert loss_on == pytest.approx(float(-(adv * mask).sum() / mask.sum()), rel=1e-5)
    model.zero_grad()
    (-(adv * _log_probs(model, batch["input_ids"]) * mask).sum() / mask.sum()).backward()
    grad_pg = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    assert torch.linalg.vector_norm(grad_on - grad_pg) <= 1e-5 * torch.linalg.vector_norm(grad_pg)

    diff = (old.exp() - batch["rollout_log_probs"].exp()).abs()
    assert shares["training/rollout_probs_diff_mean"] == pytest.approx(float((diff * mask).sum() / mask.sum()),
                                                                       rel=1e-5)


@pytest.mark.parametrize("sections, key", [
    ({"actor": {"ppo_epochs": 2}}, "actor.ppo_epochs"),
    ({"actor": {"ppo_mini_batch_size": 8}}, "actor.ppo_mini_batch_size"),
    ({"algorithm": {"use_kl_in_reward": True}, "ref": {"enabled": True}}, "algorithm.use_kl_in_reward"),
    ({"algorithm": {"rollout_correction": {"is_level": "token"}}}, "algorithm.rollout_correction.is_level"),
    ({"algorithm": {"rollout_correction": {"max_mismatch": 0.1}}}, "algorithm.rollout_correction.max_mismatch"),
    ({"algorithm": {"rollout_correction": {"bypass": True}}}, "algorithm.rollout_correction.bypass"),
])
def test_on_policy_old_log_probs_refuses_what_needs_the_old_log_probs_first(sections, key):
    actor = {**sections.get("actor", {}), "on_policy_old_log_probs": True}
    with pytest.raises(ConfigError) as err:
        run_from_dict(_tree(**{**sections, "actor": actor}))
    assert err.value.key == key and "actor.on_policy_old_log_probs" in str(err.value)
    run_from_dict(_tree(**sections))  # the same config without the knob loads
