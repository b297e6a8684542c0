"""Routing replay scoped per model (megaflow.megatron.routing_replay) on a tiny Qwen3-MoE:

* recording yields, per MoE layer, the top-k experts ``transformers``' router picks;
* two models in one process (actor and reference) keep their own replay targets: replaying
  drifted targets on one leaves the other's forward unchanged, and megatron-core's global
  replay list holds neither;
* while replaying, ``record_own`` yields the top-k each router would choose itself;
* a replayed expert outside the router's own top-k gets a router gradient, and the experts
  neither replayed nor chosen get none (``norm_topk_prob``: softmax over the k gathered logits).
"""
from __future__ import annotations

import torch

from megaflow.utils.launch import run_distributed
from megatron_testlib import VOCAB
from moe_testlib import NUM_EXPERTS, tiny_moe_model

SEQ = 7


def _forward(model, input_ids):
    s = input_ids.shape[1]
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[None, None]
    return model(input_ids, torch.arange(s)[None], mask)[..., :VOCAB]


def _router_grad(model, replay, input_ids, targets=None):
    """Row norms ``[experts]`` of layer 0's router-weight gradient for loss = sum of squared logits."""
    model.zero_grad()
    with replay.replay(targets) if targets is not None else torch.enable_grad():
        _forward(model, input_ids).pow(2).sum().backward()
    return model.decoder.layers[0].mlp.router.weight.grad.norm(dim=1)


def _rank(rank, world, hf_dir, input_ids):
    from megatron.core.transformer.moe.router_replay import RouterReplay
    from transformers import AutoConfig

    from megaflow.megatron.model import build_gpt_model
    from megaflow.megatron.parallel import initialize_parallel
    from megaflow.megatron.routing_replay import RoutingReplay
    from megaflow.models.weights import load_hf_weights

    info = initialize_parallel(tp=1, pp=1)
    config = AutoConfig.from_pretrained(hf_dir)
    actor, ref = (build_gpt_model(config, moe_enable_routing_replay=True) for _ in range(2))
    for model in (actor, ref):
        load_hf_weights(model, hf_dir, config, info)
    actor_replay, ref_replay = RoutingReplay(actor), RoutingReplay(ref)
    out = {"layers": (actor_replay.num_layers, ref_replay.num_layers),
           "global": len(RouterReplay.global_router_replay_instances)}
    with torch.no_grad():
        with actor_replay.record() as recorded:
            _forward(actor, input_ids)
        out["recorded"] = [t.clone() for t in recorded]
        plain_ref = _forward(ref, input_ids)
        drifted = [(t + 1) % NUM_EXPERTS for t in recorded]
        with actor_replay.replay(drifted, record_own=True) as own:
            out["actor_drifted"] = _forward(actor, input_ids)
            out["ref_meanwhile"] = _forward(ref, input_ids)
        out["own_while_drifted"] = [t.clone() for t in own]
        with actor_replay.replay(drifted) as none:
            out["actor_drifted_again"] = _forward(actor, input_ids)
        out["own_not_asked"] = list(none)
        out["ref_plain"], out["actor_plain"] = plain_ref, _forward(actor, input_ids)
    one = input_ids[:, :1]  # one token: layer 0's router gradient is this token's alone
    chosen = recorded[0][0].tolist()
    outside = next(e for e in range(NUM_EXPERTS) if e not in chosen)
    targets = [t[:1].clone() for t in recorded]
    targets[0][0, 1] = outside
    out["grad_plain"] = _router_grad(actor, actor_replay, one)
    out["grad_replayed"] = _router_grad(actor, actor_replay, one, targets)
    out["chosen"], out["outside"] = chosen, outside
    return out


def test_routing_replay_is_scoped_per_model_and_reaches_the_router_gradient(tmp_path):
    hf = tiny_moe_model(VOCAB, norm_topk_prob=True)
    hf.save_pretrained(tmp_path)
    input_ids = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        router_logits = hf(input_ids=input_ids, output_router_logits=True).router_logits
    hf_topk = [torch.topk(torch.softmax(r.float(), -1), 2, dim=-1).indices for r in router_logits]
    (out,) = run_distributed(_rank, 1, str(tmp_path), input_ids, timeout_s=600)

    assert out["layers"] == (2, 2) and out["global"] == 0
    for mine, theirs in zip(out["recorded"], hf_topk):  # [seq * batch, k]; batch 1
        assert mine.shape == (SEQ, 2)
        assert torch.equal(mine.sort(-1).values, theirs.reshape(SEQ, 2).sort(-1).values)
    assert torch.equal(out["ref_meanwhile"], out["ref_plain"])  # actor's targets never reach ref
    # record_own: the router's own top-k at the replayed inputs; layer 0's input does not depend
    # on the replay, so its own choice is the plain recording; recording it leaves the forward as is.
    assert torch.equal(out["own_while_drifted"][0], out["recorded"][0])
    assert not torch.equal(out["own_while_drifted"][0], out["recorded"][0].add(1) % NUM_EXPERTS)
    assert torch.equal(out["actor_drifted_again"], out["actor_drifted"]) and out["own_not_asked"] == []
    assert (out["actor_drifted"] - out["actor_plain"]).abs().max() > 1e-3  # replay changed routing
    plain, replayed = out["grad_plain"], out["grad_replayed"]
    first, second = out["chosen"]
    others = [e for e in range(NUM_EXPERTS) if e not in (first, second)]
    assert plain[first] > 0 and plain[second] > 0 and all(plain[e] == 0 for e in others)
    assert replayed[first] > 0 and replayed[out["outside"]] > 0
    assert all(replayed[e] == 0 for e in range(NUM_EXPERTS) if e not in (first, out["outside"]))


def test_entries_without_routing_become_distinct_valid_expert_ids_for_the_replay():
    # The rollout marks the last token of each sequence -1 (never fed through the engine); the
    # replay needs valid, distinct ids per slot there, and keeps every routed entry.
    from megaflow.megatron.engine import replayable_routing

    routed = torch.tensor([[[[3, 1], [2, 0]], [[-1, -1], [-1, -1]]]], dtype=torch.int8)  # [1, 2, 2, 2]
    out = replayable_routing(routed)
    assert out.dtype == torch.int8
    assert out[0, 0].tolist() == [[3, 1], [2, 0]]
    assert out[0, 1].tolist() == [[0, 1], [0, 1]]
