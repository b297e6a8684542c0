"""LoRA adapters on megatron-core (megaflow.megatron.lora) through the MegatronEngine, on TP=1,
TP=2 and PP=2 worlds of a tiny Llama, against references computed independently:

* zero-initialised B: the model's logits and the engine's log-probs are bit-identical to
  the same weights without adapters;
* after three optimizer steps the base parameters are bit-unchanged, only the adapters
  (and nothing else) require gradients, hold a gradient buffer and have optimizer state;
* with adapters disabled the trained actor's log-probs are bit-identical to a separate
  reference engine on the base weights (the reference policy for free);
* with a random non-zero B: the adapted model's log-probs equal a plain model whose weights
  are ``W + (alpha / r) B A`` computed in the test (fp32 noise), the merged weights the
  weight sync sends equal that product, and TP=2 and PP=2 equal TP=1 in the forward and in
  one update's adapter gradients (relative 1e-4 of each tensor's norm: reduction order).
"""
from __future__ import annotations

import zlib

import pytest
import torch
from megatron_testlib import VOCAB, hf_causal_lm, hf_to_megatron_shard, load_shard, make_batch, tiny_llama_config

from megaflow.utils.launch import run_distributed

pytestmark = pytest.mark.slow

RANK, ALPHA, LR = 4, 8.0, 1e-2
SCALE = ALPHA / RANK
HF_SEED = 7


def _batch():
    batch = make_batch(0)
    batch["advantages"] = torch.randn(batch["responses"].shape, generator=torch.Generator().manual_seed(5))
    return batch


def _policy_loss(outputs, mb, den):
    mask = mb["response_mask"].float()
    loss = -(outputs["log_probs"] * mb["advantages"] * mask).sum() / den.num_tokens
    return loss, {"pg_loss": loss.detach()}


def _spec(role, cfg, tp, pp, world, *extra):
    from role_testlib import role_spec, seq_len_overrides

    return role_spec(role, [f"actor.tp={tp}", f"actor.pp={pp}", f"resources.procs_per_node={world}",
                            *seq_len_overrides(32), "actor.ppo_micro_batch_size_per_gpu=2",
                            f"actor.optim.lr={LR}", "actor.optim.weight_decay=0.0", "trainer.save_freq=-1", *extra],
                     hf_config=cfg)


def _random_b(layer, global_path: str, tp: int, tp_rank: int) -> torch.Tensor:
    """A full B ``[out, r]`` drawn from the layer's global name, this rank's slice of it."""
    out_local = layer.lora_b.weight.shape[0]
    out_full = out_local * tp if layer.lora_kind == "column" else out_local
    g = torch.Generator().manual_seed(zlib.crc32(global_path.encode()))
    full = torch.randn(out_full, RANK, generator=g) * 0.2  # in the TP = 1 row order
    if layer.lora_kind == "row":
        return full
    if global_path.endswith("linear_fc1"):  # [gate; up] per TP shard (Megatron's SwiGLU layout)
        return torch.cat([part.chunk(tp)[tp_rank] for part in full.chunk(2)])
    return full.chunk(tp)[tp_rank]


def _logits(model, batch):
    ids = batch["input_ids"]
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    from megaflow.megatron import cpu_compat

    with torch.no_grad():
        return model(ids, positions, cpu_compat.attention_mask_argument(ids.shape[1], ids.device))


def _full_adapter_grads(engine, info):
    """``{global name: (main_grad, partition_dim or None)}`` of this rank's adapters."""
    from megaflow.megatron.lora import adapter_parameters, global_module_path

    out = {}
    for name, p in adapter_parameters(engine.module).items():
        path, part = name.rsplit(".", 2)[0], ".".join(name.rsplit(".", 2)[1:])
        dim = p.partition_dim if p.tensor_model_parallel else None
        out[f"{global_module_path(engine.module, path)}.{part}"] = (p.main_grad.detach().clone(), dim)
    return out


def _lora_rank(rank, world, tp, pp):
    from megaflow.megatron import model as M
    from megaflow.megatron import parallel
    from megaflow.megatron.engine import MegatronEngine
    from megaflow.megatron.lora import adapters_disabled, global_module_path, lora_layers

    cfg = tiny_llama_config()
    hf_state = hf_causal_lm(cfg, seed=HF_SEED).state_dict()
    info = parallel.initialize_parallel(tp=tp, pp=pp, seed=1)
    shard = hf_to_megatron_shard(hf_state, cfg, tp_rank=info.tp_rank, tp=tp, pp_rank=info.pp_rank, pp=pp)
    batch = _batch()
    lora = (f"actor.lora.rank={RANK}", f"actor.lora.alpha={ALPHA}")
    res = {"tp_rank": info.tp_rank, "pp_rank": info.pp_rank, "last": info.is_last_pp_stage}

    base = M.build_gpt_model(cfg)
    load_shard(base, shard)
    base_engine = MegatronEngine(base, info, _spec("ref", cfg, tp, pp, world), vocab_size=VOCAB)
    res["base"] = base_engine.forward(batch, micro_batch_size=3)
    base_logits = _logits(base, batch) if info.pp_size == 1 else None

    # zero B: bit-identical; three updates: base unchanged, adapters only trained
    actor = M.build_gpt_model(cfg)
    load_shard(actor, shard)
    engine = MegatronEngine(actor, info, _spec("actor", cfg, tp, pp, world, *lora), vocab_size=VOCAB)
    res["zero_b"] = engine.forward(batch, micro_batch_size=3)
    if base_logits is not None:
        res["zero_b_logits_equal"] = torch.equal(_logits(engine.module, batch), base_logits)
    named = dict(engine.module.named_parameters())
    res["trainable"] = sorted(n for n, p in named.items() if p.requires_grad)
    res["all_names"] = sorted(named)
    res["grad_buffer_params"] = sorted(n for n, p in named.items() if hasattr(p, "main_grad"))
    res["adapted"] = sorted(path for path, _ in lora_layers(engine.module))
    for _ in range(3):
        res.setdefault("metrics", []).append(engine.train_step(batch, _policy_loss))
    res["base_unchanged"] = all(torch.equal(named[n].detach(), v) for n, v in shard.items())
    ids = {id(p): n for n, p in named.items()}
    opt_params = [ids[id(p)] for opt in engine.optimizer.chained_optimizers
                  for group in opt.optimizer.param_groups for p in group["params"]] \
        if hasattr(engine.optimizer, "chained_optimizers") else \
        [ids[id(p)] for group in engine.optimizer.optimizer.param_groups for p in group["params"]]
    res["optimizer_params"] = sorted(opt_params)
    inner = engine.optimizer.chained_optimizers[0] if hasattr(engine.optimizer, "chained_optimizers") \
        else engine.optimizer
    res["optimizer_state_params"] = sorted(ids[id(p)] for p in inner.optimizer.state)
    res["lora_b_nonzero"] = all(bool(layer.lora_b.weight.abs().sum() > 0) for _, layer in lora_layers(engine.module))
    with adapters_disabled(engine.module):
        res["disabled"] = engine.forward(batch, micro_batch_size=3)
    res["after"] = engine.forward(batch, micro_batch_size=3)

    # random B: forward against explicitly merged weights, merged_weight(), one update's gradients
    actor2 = M.build_gpt_model(cfg)
    load_shard(actor2, shard)
    engine2 = MegatronEngine(actor2, info, _spec("actor", cfg, tp, pp, world, *lora), vocab_size=VOCAB)
    merged_shard, merged_ok = dict(shard), True
    for path, layer in lora_layers(engine2.module):
        with torch.no_grad():
            layer.lora_b.weight.copy_(_random_b(layer, global_module_path(engine2.module, path), tp, info.tp_rank))
        by_hand = shard[f"{path}.weight"] + SCALE * layer.lora_b.weight.detach() @ layer.lora_a.weight.detach()
        merged_shard[f"{path}.weight"] = by_hand
        merged_ok &= torch.allclose(layer.merged_weight(), by_hand, rtol=0, atol=1e-6)
    res["merged_weight_ok"] = merged_ok
    res["rand_b"] = engine2.forward(batch, micro_batch_size=3)
    merged = M.build_gpt_model(cfg)
    load_shard(merged, merged_shard)
    res["merged"] = MegatronEngine(merged, info, _spec("ref", cfg, tp, pp, world), vocab_size=VOCAB).forward(
        batch, micro_batch_size=3)
    step = engine2.optimizer.step

    def record_then_step():
        res["grads"] = _full_adapter_grads(engine2, info)
        return step()

    engine2.optimizer.step = record_then_step
    res["rand_b_metrics"] = engine2.train_step(batch, _policy_loss)
    engine2.optimizer.step = step
    if tp == 2:
        res["checkpoint"] = _checkpoint_round_trip(cfg, shard, info, batch, engine2, lora)
    if world == 1:
        res.update(_knob_effects(cfg, shard, info, batch, lora))
    parallel.destroy_parallel()
    return res


def _checkpoint_round_trip(cfg, shard, info, batch, engine, lora):
    """The engine checkpoint of a trained LoRA actor (TP-sharded B of column layers, A of row
    layers) loaded into a fresh one: every parameter, the next update's loss and its log-probs equal."""
    import shutil
    import tempfile

    import torch.distributed as dist

    from megaflow.megatron import model as M
    from megaflow.megatron.engine import MegatronEngine
    from megaflow.workers.checkpointing import load_engine_checkpoint, save_engine_checkpoint

    directory = [tempfile.mkdtemp(prefix="lora_ckpt_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(directory, src=0)
    save_engine_checkpoint(engine, directory[0], cfg.to_dict())
    fresh = M.build_gpt_model(cfg)
    load_shard(fresh, shard)
    restored = MegatronEngine(fresh, info, _spec("actor", cfg, 2, 1, 2, *lora), vocab_size=VOCAB)
    load_engine_checkpoint(restored, directory[0])
    same = all(torch.equal(a, b) for a, b in zip(engine.module.state_dict(keep_vars=False).values(),
                                                  restored.module.state_dict(keep_vars=False).values(), strict=True)
               if torch.is_tensor(a))
    next_a, next_b = engine.train_step(batch, _policy_loss), restored.train_step(batch, _policy_loss)
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(directory[0])
    return {"params_equal": same, "loss": (next_a.get("loss"), next_b.get("loss")),
            "log_probs": (engine.forward(batch, micro_batch_size=3), restored.forward(batch, micro_batch_size=3))}


def _knob_effects(cfg, shard, info, batch, lora):
    """actor.lora.target_modules / dropout and critic.lora.* on one rank."""
    from megaflow.megatron import model as M
    from megaflow.megatron.engine import MegatronEngine
    from megaflow.megatron.lora import lora_layers

    out = {}
    actor = M.build_gpt_model(cfg)
    load_shard(actor, shard)
    engine = MegatronEngine(actor, info, _spec("actor", cfg, 1, 1, 1, *lora, "actor.lora.target_modules=[linear_fc2]",
                                               "actor.lora.dropout=0.5"), vocab_size=VOCAB)
    out["fc2_only"] = sorted(path for path, _ in lora_layers(engine.module))
    layer = dict(lora_layers(engine.module))["decoder.layers.0.mlp.linear_fc2"]
    with torch.no_grad():
        layer.lora_b.weight.normal_()
    x = torch.randn(5, 2, layer.lora_a.weight.shape[1], generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        layer.train()
        out["dropout_train"] = [layer.lora_delta(x) for _ in range(2)]
        layer.eval()
        out["dropout_eval"] = layer.lora_delta(x)
    out["dropout_by_hand"] = SCALE * x @ layer.lora_a.weight.detach().T @ layer.lora_b.weight.detach().T

    critic = M.build_gpt_model(cfg, head="value")
    critic_shard = hf_to_megatron_shard(hf_causal_lm(cfg, seed=HF_SEED).state_dict(), cfg, tp_rank=0, tp=1,
                                        pp_rank=0, pp=1, head="value", score_weight=torch.full((1, 64), 0.01))
    load_shard(critic, critic_shard)
    engine = MegatronEngine(critic, info, _spec("critic", cfg, 1, 1, 1, "algorithm.adv_estimator=gae", "critic.enabled=true", "critic.lora.rank=2", "critic.lora.alpha=4",
                                                "critic.lora.target_modules=[linear_qkv]", "critic.lora.dropout=0.1",
                                                "critic.ppo_micro_batch_size_per_gpu=2"), vocab_size=VOCAB)
    named = dict(engine.module.named_parameters())
    out["critic_trainable"] = sorted(n for n, p in named.items() if p.requires_grad)
    out["critic_scale"] = [layer.lora_scale for _, layer in lora_layers(engine.module)]
    out["critic_dropout"] = [layer.lora_dropout.p for _, layer in lora_layers(engine.module)]
    vbatch = dict(batch, returns=torch.ones(batch["responses"].shape), values=torch.zeros(batch["responses"].shape))

    def value_loss(outputs, mb, den):
        mask = mb["response_mask"].float()
        loss = ((outputs["values"] - mb["returns"]) ** 2 * mask).sum() / den.num_tokens
        return loss, {}

    engine.train_step(vbatch, value_loss)
    out["critic_changed"] = sorted(n for n, p in named.items() if n in critic_shard and
                                   not torch.equal(p.detach(), critic_shard[n]))
    out["critic_checkpoint"] = _critic_checkpoint_round_trip(cfg, critic_shard, info, engine, vbatch, value_loss)
    return out


def _critic_checkpoint_round_trip(cfg, shard, info, engine, batch, loss_fn):
    """The engine checkpoint of the trained LoRA critic (one rank) loaded into a fresh critic
    built from the same base: the checkpoint's tensor keys, whether every parameter equals, and
    the next update's metrics of both."""
    import shutil
    import tempfile
    from pathlib import Path

    from megatron.core import dist_checkpointing

    from megaflow.megatron import model as M
    from megaflow.megatron.engine import MegatronEngine
    from megaflow.workers.checkpointing import ADAPTER_DIR, load_engine_checkpoint, save_engine_checkpoint

    directory = Path(tempfile.mkdtemp(prefix="lora_critic_ckpt_"))
    save_engine_checkpoint(engine, directory, cfg.to_dict())
    keys = sorted(dist_checkpointing.load_tensors_metadata(str(directory / ADAPTER_DIR)))
    fresh = M.build_gpt_model(cfg, head="value")
    load_shard(fresh, shard)
    restored = MegatronEngine(fresh, info, engine.spec, vocab_size=VOCAB)
    load_engine_checkpoint(restored, directory)
    shutil.rmtree(directory)
    same = all(torch.equal(a, b) for a, b in zip(engine.module.parameters(), restored.module.parameters(), strict=True))
    nxt = []
    for e in (engine, restored):
        torch.manual_seed(11)  # the same dropout masks (critic.lora.dropout) in both updates
        nxt.append(e.train_step(batch, loss_fn))
    return {"keys": keys, "params_equal": same, "next": tuple(nxt)}


@pytest.fixture(scope="module")
def single():
    return run_distributed(_lora_rank, 1, 1, 1, timeout_s=600)[0]


@pytest.fixture(scope="module")
def tp2():
    return run_distributed(_lora_rank, 2, 2, 1, timeout_s=600)


@pytest.fixture(scope="module")
def pp2():
    return run_distributed(_lora_rank, 2, 1, 2, timeout_s=600)


def _assemble(results):
    """Per-rank adapter gradients -> full tensors by global name (split ones concatenated)."""
    parts: dict[str, dict[int, torch.Tensor]] = {}
    dims = {}
    for res in results:
        for name, (grad, dim) in res["grads"].items():
            parts.setdefault(name, {})[res["tp_rank"] if dim is not None else 0] = grad
            dims[name] = dim
    out = {}
    for name, p in parts.items():
        shards = [p[i] for i in sorted(p)]
        if dims[name] is None:
            out[name] = shards[0]
        elif ".linear_fc1." in name:  # per-shard [gate_i; up_i] -> [gate; up]
            halves = [s.chunk(2) for s in shards]
            out[name] = torch.cat([torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])])
        else:
            out[name] = torch.cat(shards, dim=dims[name])
    return out


def _close(a, b, rel=1e-4):
    return float((a - b).norm()) <= rel * max(float(b.norm()), 1e-12)


def test_zero_b_is_bit_identical_to_the_base_model(single):
    assert single["zero_b_logits_equal"]
    for key in ("log_probs",):
        assert torch.equal(single["zero_b"][key], single["base"][key])


def test_only_adapters_train_and_the_base_is_unchanged(single):
    """actor.lora.rank > 0: only the adapters require gradients, own a gradient buffer and optimizer
    state; three updates leave every base parameter bit-unchanged."""
    names = single["all_names"]
    adapters = sorted(n for n in names if n.endswith(("lora_a.weight", "lora_b.weight")))
    # 4 layers x 4 targets x (A, B)
    assert len(adapters) == 4 * 4 * 2 and len(single["adapted"]) == 16
    assert single["trainable"] == adapters
    assert single["grad_buffer_params"] == adapters
    assert single["optimizer_params"] == adapters
    assert single["optimizer_state_params"] == adapters
    assert single["base_unchanged"]
    assert single["lora_b_nonzero"]  # the updates did move the adapters
    assert all(m["update_successful"] == 1.0 for m in single["metrics"])


def test_disabled_adapters_give_the_reference_log_probs(single):
    assert torch.equal(single["disabled"]["log_probs"], single["base"]["log_probs"])
    assert not torch.equal(single["after"]["log_probs"], single["base"]["log_probs"])


def test_nonzero_b_forward_equals_merged_weights(single):
    """actor.lora.alpha / actor.lora.rank scale B A: the adapted model equals W + (alpha / rank) B A."""
    assert single["merged_weight_ok"]
    diff = (single["rand_b"]["log_probs"] - single["merged"]["log_probs"]).abs().max()
    assert diff < 1e-5, diff
    assert (single["rand_b"]["log_probs"] - single["base"]["log_probs"]).abs().max() > 1e-2


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_tp2_and_pp2_equal_tp1(layout, single, request):
    results = request.getfixturevalue(layout)
    last = [r for r in results if r["last"]][0]
    assert all(r["merged_weight_ok"] for r in results)
    for key in ("zero_b", "disabled"):
        assert torch.equal(last[key]["log_probs"], last["base"]["log_probs"]), key
    assert (last["rand_b"]["log_probs"] - single["rand_b"]["log_probs"]).abs().max() < 1e-5
    assert (last["rand_b"]["log_probs"] - last["merged"]["log_probs"]).abs().max() < 1e-5
    grads, expected = _assemble(results), _assemble([single])
    assert sorted(grads) == sorted(expected)
    for name, g in expected.items():
        assert g.abs().sum() > 0, name  # B non-zero: A gets a gradient too
        assert grads[name].shape == g.shape, name
        assert _close(grads[name], g), (name, float((grads[name] - g).norm()), float(g.norm()))
    assert abs(last["rand_b_metrics"]["grad_norm"] - single["rand_b_metrics"]["grad_norm"]) \
        <= 1e-4 * single["rand_b_metrics"]["grad_norm"]


def test_target_modules_and_dropout_knobs(single):
    """actor.lora.target_modules=[linear_fc2] adapts only fc2; actor.lora.dropout=0.5 masks the
    adapter's input in training passes (two passes differ) and not in eval (the exact product)."""
    assert single["fc2_only"] == [f"decoder.layers.{i}.mlp.linear_fc2" for i in range(4)]
    first, second = single["dropout_train"]
    assert not torch.equal(first, second)
    assert torch.allclose(single["dropout_eval"], single["dropout_by_hand"], atol=1e-5)
    assert not torch.allclose(first, single["dropout_by_hand"], atol=1e-3)


def test_critic_lora_keeps_the_value_head_trainable(single):
    """critic.lora.rank=2, critic.lora.alpha=4 (scale 2), critic.lora.target_modules=[linear_qkv],
    critic.lora.dropout=0.1: adapters on QKV plus the full value head train; nothing else moves."""
    qkv = [f"decoder.layers.{i}.self_attention.linear_qkv.lora_{p}.weight" for i in range(4) for p in "ab"]
    assert single["critic_trainable"] == sorted(qkv + ["output_layer.weight"])
    assert single["critic_scale"] == [2.0] * 4 and single["critic_dropout"] == [0.1] * 4
    assert single["critic_changed"] == ["output_layer.weight"]


def test_critic_lora_checkpoint_holds_the_trained_tensors_and_resumes_exactly(single):
    """The critic's adapter-only checkpoint holds its adapters and its fully trained value head
    (no frozen base tensor); loaded into a fresh critic on the same base every parameter is equal
    and the next update's metrics are identical."""
    ckpt = single["critic_checkpoint"]  # megatron-core stacks a tensor's layers under one key
    assert ckpt["keys"] == [f"decoder.layers.self_attention.linear_qkv.lora_{p}.weight" for p in "ab"] \
        + ["output_layer.weight"]
    assert ckpt["params_equal"]
    first, second = ckpt["next"]
    assert first and first == second


def test_engine_checkpoint_of_a_tp2_lora_actor_resumes_exactly(tp2):
    """actor.lora.rank with tp=2: the checkpoint shards the adapters like their TP attributes and
    the next update's loss and log-probs after a load equal the uninterrupted engine's."""
    for res in tp2:
        ckpt = res["checkpoint"]
        assert ckpt["params_equal"]
        assert ckpt["loss"][0] == ckpt["loss"][1]
        assert torch.equal(ckpt["log_probs"][0]["log_probs"], ckpt["log_probs"][1]["log_probs"])
