"""The auxiliary router losses of an MoE update (``actor.moe_aux_loss_coeff``,
``actor.moe_z_loss_coeff``; megaflow.megatron.router_aux_loss) on a tiny Qwen3-MoE, one
2-rank gloo world, against a single-process ``transformers`` reference on the whole batch:

* the reference: the policy loss (token mean, global denominators) plus the coefficients
  times the sequence-wise load-balancing loss (DeepSeek-V3 eq. 17-20) and the z-loss (ST-MoE
  eq. 5), both computed by hand from ``transformers``' router logits over each sequence's
  real tokens and averaged over the batch's sequences;
* the engine's step at DP=2/EP=1 with 3 micro-batches per rank, at DP=2/EP=2 with one, and
  at PP=2 (DP=1) reports the same losses and grad norm as the reference, so the losses do
  not depend on the DP, EP, PP or micro-batch split; and the reference grad norm differs
  from the one without router losses, so the test sees them.
"""
from __future__ import annotations

import pytest
import torch

import moe_testlib
from megaflow.utils.launch import run_distributed
from megatron_testlib import VOCAB, batch_with_advantages, hf_reference, token_mean_policy_loss

pytestmark = pytest.mark.slow

TEMPERATURE, AUX, Z = 0.8, 0.3, 0.05
#: (name, overrides, micro-batch rows) of the engine runs; world of 2 ranks
LAYOUTS = [("dp2_ep1_mb1", ["actor.ep=1"], 1), ("dp2_ep2_mb3", ["actor.ep=2"], 3), ("pp2", ["actor.pp=2"], 2)]


def _spec(overrides):
    from role_testlib import role_spec, seq_len_overrides

    return role_spec("actor", ["resources.procs_per_node=2", "actor.tp=1", *seq_len_overrides(32), *overrides,
                               f"actor.moe_aux_loss_coeff={AUX}", f"actor.moe_z_loss_coeff={Z}",
                               "actor.optim.lr_warmup_steps=0", "actor.optim.clip_grad=1e9"],
                     hf_config=moe_testlib.tiny_moe_config(VOCAB))


def _layouts(rank, world, hf_dir):
    from transformers import AutoConfig

    from megaflow.megatron import parallel
    from megaflow.megatron.engine import MegatronEngine
    from megaflow.megatron.model import build_gpt_model
    from megaflow.models.weights import load_hf_weights

    out = {}
    for name, overrides, rows in LAYOUTS:
        spec = _spec(overrides)
        par = spec.parallel
        info = parallel.initialize_parallel(tp=par.tp, pp=par.pp, ep=par.ep, seed=1)
        config = AutoConfig.from_pretrained(hf_dir)
        model = build_gpt_model(config)
        load_hf_weights(model, hf_dir, config, info)
        batch = {k: v.chunk(info.dp_size)[info.dp_rank] for k, v in batch_with_advantages().items()}
        engine = MegatronEngine(model, info, spec, vocab_size=VOCAB)
        out[name] = engine.train_step(batch, token_mean_policy_loss, temperature=TEMPERATURE, micro_batch_size=rows)
        parallel.destroy_parallel()
    return out


def _reference(hf, batch, with_router_losses: bool = True) -> dict[str, float]:
    """Policy loss + router losses of the whole batch through ``transformers``; grad norm."""
    hf.zero_grad()
    logits = hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                position_ids=batch["position_ids"], output_router_logits=True).router_logits
    mask = batch["attention_mask"].float()  # [b, s] real tokens
    tokens = mask.sum(-1)
    experts, topk = moe_testlib.NUM_EXPERTS, 2
    balance = z = torch.zeros(())
    for layer in logits:  # [b * s, E], batch-major
        layer = layer.float().view(*mask.shape, experts)
        probs = torch.softmax(layer, -1)
        chosen = torch.zeros_like(probs).scatter(-1, probs.topk(topk, -1).indices, 1.0)
        f = experts / (topk * tokens[:, None]) * (chosen * mask[..., None]).sum(1)
        p = (probs * mask[..., None]).sum(1) / tokens[:, None]
        balance = balance + (f * p).sum(-1).mean()
        z = z + ((torch.logsumexp(layer, -1).square() * mask).sum(-1) / tokens).mean()
    out = hf_reference(hf, batch, TEMPERATURE)
    response = batch["response_mask"].float()
    loss = -(out["log_probs"] * batch["advantages"] * response).sum() / response.sum()
    total = loss + (AUX * balance + Z * z if with_router_losses else 0.0)
    total.backward()
    grad_norm = float(torch.nn.utils.clip_grad_norm_(hf.parameters(), 1e9))
    return dict(loss=float(loss.detach()), moe_aux_loss=float(balance.detach()), moe_z_loss=float(z.detach()),
                grad_norm=grad_norm)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    hf = moe_testlib.tiny_moe_model(VOCAB)
    hf_dir = tmp_path_factory.mktemp("qwen3_moe")
    hf.save_pretrained(hf_dir)
    hf.train()  # no dropout: the same function as in eval mode
    reference = _reference(hf, batch_with_advantages())
    without = _reference(hf, batch_with_advantages(), with_router_losses=False)
    return run_distributed(_layouts, 2, str(hf_dir), timeout_s=900), reference, without


@pytest.mark.parametrize("layout", [name for name, _, _ in LAYOUTS])
def test_router_losses_and_grad_norm_are_independent_of_the_split(runs, layout):
    """actor.moe_aux_loss_coeff and actor.moe_z_loss_coeff add the router losses; actor.ep=2
    splits the experts over the two ranks, actor.pp=2 the layers: the step is the reference's."""
    per_rank, ref, without = runs
    assert ref["grad_norm"] != pytest.approx(without["grad_norm"], rel=1e-3)  # the router losses move it
    for metrics in (r[layout] for r in per_rank):
        assert metrics["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
        assert metrics["moe_aux_loss"] == pytest.approx(ref["moe_aux_loss"], rel=1e-5)
        assert metrics["moe_z_loss"] == pytest.approx(ref["moe_z_loss"], rel=1e-5)
    last = [r[layout] for r in per_rank if "loss" in r[layout]]
    assert last and all(m["loss"] == pytest.approx(ref["loss"], abs=1e-6) for m in last)
