"""Qwen3-MoE through MegatronEngine at EP=1 and EP=2 (one 2-rank gloo world, DP=2) against a
single-process ``transformers`` reference on the whole batch:

* log-probs (temperature 0.8) equal ``transformers`` within 1e-5 at both EP sizes;
* one optimizer step's loss (token-mean policy gradient with global denominators) and grad
  norm (before clipping; experts, router and dense parameters together) equal the HF
  loss and ``clip_grad_norm_`` of its gradients, so EP=2 equals EP=1 within fp32 noise;
* at EP=2 each rank holds half of the experts, and the parameters each rank holds equal the
  planner's formula (``stage_parameters`` with ``ep``).
"""
from __future__ import annotations

import pytest
import torch

from megaflow.utils.launch import run_distributed
from moe_testlib import NUM_EXPERTS
import moe_testlib
from megatron_testlib import VOCAB, batch_with_advantages, hf_reference, token_mean_policy_loss

pytestmark = pytest.mark.slow

TEMPERATURE, LR = 0.8, 1e-3


def tiny_moe_config():
    return moe_testlib.tiny_moe_config(VOCAB)


def _engine_spec(ep):
    """The actor's engine settings on a 2-rank world with the tiny Qwen3-MoE and ``actor.ep``."""
    from role_testlib import role_spec, seq_len_overrides

    return role_spec("actor", ["resources.procs_per_node=2", "actor.tp=1", f"actor.ep={ep}", *seq_len_overrides(32),
                               "actor.ppo_micro_batch_size_per_gpu=1", f"actor.optim.lr={LR}",
                               "actor.optim.lr_warmup_steps=0", "actor.optim.clip_grad=1e9"],
                     hf_config=tiny_moe_config())


def _one_ep(hf_dir, ep):
    from transformers import AutoConfig

    from megaflow.megatron import parallel
    from megaflow.megatron.engine import MegatronEngine
    from megaflow.megatron.model import build_gpt_model
    from megaflow.models.weights import load_hf_weights

    spec = _engine_spec(ep)
    info = parallel.initialize_parallel(tp=1, pp=1, ep=spec.parallel.ep, seed=1)
    config = AutoConfig.from_pretrained(hf_dir)
    batch = {k: v.chunk(info.dp_size)[info.dp_rank] for k, v in batch_with_advantages().items()}
    model = build_gpt_model(config)
    experts = sum(1 for n, _ in model.named_parameters() if "layers.0.mlp.experts" in n and "fc1" in n)
    params = sum(p.numel() for p in model.parameters())
    load_hf_weights(model, hf_dir, config, info)
    engine = MegatronEngine(model, info, spec, vocab_size=VOCAB)
    out = {"dp_rank": info.dp_rank, "ep_rank": info.ep_rank, "local_experts": experts, "params": params}
    out["log_probs"] = engine.forward(batch, micro_batch_size=2, temperature=TEMPERATURE)["log_probs"]
    out["metrics"] = engine.train_step(batch, token_mean_policy_loss, temperature=TEMPERATURE)
    parallel.destroy_parallel()
    return out


def _both_ep_sizes(rank, world, hf_dir):
    return {ep: _one_ep(hf_dir, ep) for ep in (1, 2)}


@pytest.fixture(scope="module")
def results_and_reference(tmp_path_factory):
    hf = moe_testlib.tiny_moe_model(VOCAB)
    hf_dir = tmp_path_factory.mktemp("qwen3_moe")
    hf.save_pretrained(hf_dir)
    batch = batch_with_advantages()
    hf.train()  # no dropout in this model: the same function as in eval mode
    out = hf_reference(hf, batch, TEMPERATURE)
    mask = batch["response_mask"].float()
    loss = -(out["log_probs"] * batch["advantages"] * mask).sum() / mask.sum()
    loss.backward()
    grad_norm = float(torch.nn.utils.clip_grad_norm_(hf.parameters(), 1e9))
    reference = dict(log_probs=out["log_probs"].detach() * mask, loss=float(loss.detach()), grad_norm=grad_norm)
    per_rank = run_distributed(_both_ep_sizes, 2, str(hf_dir), timeout_s=900)
    return per_rank, reference


@pytest.mark.parametrize("ep", [1, 2])
def test_log_probs_loss_and_grad_norm_equal_transformers(results_and_reference, ep):
    per_rank, ref = results_and_reference
    ranks = sorted((r[ep] for r in per_rank), key=lambda r: r["dp_rank"])
    log_probs = torch.cat([r["log_probs"] for r in ranks]) * batch_with_advantages()["response_mask"]
    torch.testing.assert_close(log_probs, ref["log_probs"], atol=1e-5, rtol=0)
    for r in ranks:
        assert r["metrics"]["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
        assert r["metrics"]["loss"] == pytest.approx(ref["loss"], abs=1e-6)
    assert [r["local_experts"] for r in ranks] == [NUM_EXPERTS // ep] * 2
    assert [r["ep_rank"] for r in ranks] == ([0, 0] if ep == 1 else [0, 1])


@pytest.mark.parametrize("ep", [1, 2])
def test_parameters_per_rank_equal_the_planner_formula(results_and_reference, ep):
    from megaflow.topology.model_spec import model_spec, stage_parameters

    per_rank, _ = results_and_reference
    expected = stage_parameters(model_spec(tiny_moe_config()), tp=1, pp=1, ep=ep)
    assert {(r[ep]["params"],) for r in per_rank} == {expected}
