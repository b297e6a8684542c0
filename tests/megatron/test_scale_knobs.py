"""Scale knobs of the Megatron engine, run for real in one 2-rank (TP=2) gloo world:

* activation recomputation (``selective``, ``full`` with the ``uniform`` and ``block``
  methods) gives the same log-probs, loss, grad norm and gradients as no recomputation
  (within 1e-6, fp32), and it is consumed: the tensors that autograd keeps for backward
  during the forward pass shrink (none > selective > full);
* the LR schedule built from a recipe (warm-up, then cosine/linear decay over the run's
  optimizer steps, several per training step) follows megatron-core's closed form at every
  update, also across a scheduler-state round trip (resume) in the decay phase.
"""
from __future__ import annotations

import math

import pytest
import torch

from megaflow.utils.launch import run_distributed
from megatron_testlib import VOCAB, hf_causal_lm, hf_to_megatron_shard, load_shard, make_batch, tiny_llama_config
from role_testlib import role_spec, seq_len_overrides, test_config

pytestmark = pytest.mark.slow

RECOMPUTE = {
    "none": {},
    "selective": dict(recompute_granularity="selective"),
    "full_uniform": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    "full_block": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=2),
}


def _loss(outputs, mb, den):
    """Token-mean policy-gradient-like loss with a fixed per-token weight."""
    mask = mb["response_mask"].float()
    loss = -(outputs["log_probs"] * mb["weights"] * mask).sum() / den.num_tokens
    return loss, {"pg": loss.detach()}


def _batch():
    batch = make_batch(0)
    batch["weights"] = torch.randn(batch["responses"].shape, generator=torch.Generator().manual_seed(3))
    return batch


def _saved_bytes_in_forward(module, batch) -> int:
    """Bytes of the tensors autograd saves for backward during one training-mode forward."""
    from megaflow.megatron.batch import left_align_batch
    from megaflow.megatron.cpu_compat import causal_attention_mask

    aligned = left_align_batch(batch, max_seq_len=32)
    ids = aligned.input_ids
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    module.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = module(ids, positions, causal_attention_mask(ids.shape[1], "cpu"))
    del out
    return total


def _lr_run(info, cfg, hf_state, spec, updates: int, resume_after: int):
    """LRs of ``updates`` updates straight, and with a scheduler-state round trip."""
    from megaflow.megatron import model as M
    from megaflow.megatron.engine import MegatronEngine

    def engine():
        model = M.build_gpt_model(cfg)
        load_shard(model, hf_to_megatron_shard(hf_state, cfg, tp_rank=info.tp_rank, tp=2, pp_rank=0, pp=1))
        return MegatronEngine(model, info, spec, vocab_size=VOCAB)

    batch = _batch()
    first = engine()
    straight = [first.train_step(batch, _loss, temperature=1.0)["lr"] for _ in range(updates)]
    before = engine()
    resumed = [before.train_step(batch, _loss, temperature=1.0)["lr"] for _ in range(resume_after)]
    state = before.scheduler.state_dict()
    after = engine()
    after.scheduler.load_state_dict(state)
    resumed += [after.train_step(batch, _loss, temperature=1.0)["lr"] for _ in range(updates - resume_after)]
    return straight, resumed


def _rank(rank, world, lr_specs, updates, resume_after):
    from megaflow.megatron import model as M, parallel
    from megaflow.megatron.engine import MegatronEngine

    torch.manual_seed(0)
    cfg = tiny_llama_config()
    hf_state = hf_causal_lm(cfg, seed=7).state_dict()
    info = parallel.initialize_parallel(tp=2, pp=1, seed=1)
    batch = _batch()
    out = {}
    for name, overrides in RECOMPUTE.items():
        model = M.build_gpt_model(cfg, **overrides)
        load_shard(model, hf_to_megatron_shard(hf_state, cfg, tp_rank=info.tp_rank, tp=2, pp_rank=0, pp=1))
        spec = role_spec("actor", [*seq_len_overrides(32), "actor.ppo_micro_batch_size_per_gpu=2",
                                   "actor.optim.lr=0.001", "actor.optim.clip_grad=0.0",
                                   "actor.optim.lr_warmup_steps=0"], hf_config=cfg)
        engine = MegatronEngine(model, info, spec, vocab_size=VOCAB)
        log_probs = engine.forward(batch, micro_batch_size=3, temperature=0.9)["log_probs"]
        metrics = engine.train_step(batch, _loss, temperature=0.9)
        grads = {k: p.main_grad.detach().clone() for k, p in engine.module.named_parameters()}
        out[name] = dict(log_probs=log_probs, metrics=metrics, grads=grads,
                         saved=_saved_bytes_in_forward(M.build_gpt_model(cfg, **overrides), batch))
    out["lr"] = {style: _lr_run(info, cfg, hf_state, spec, updates, resume_after)
                 for style, spec in lr_specs.items()}
    engine.offload()
    engine.reload(("params",))  # what a forward pass or a weight sync reloads
    out["partial_reload"] = sorted(engine.offloaded)
    out["forward_after_partial_reload"] = engine.forward(batch, micro_batch_size=3, temperature=0.9)["log_probs"]
    try:
        engine.train_step(batch, _loss, temperature=0.9)
    except RuntimeError as exc:
        out["train_while_offloaded"] = str(exc)
    engine.reload()
    out["full_reload"] = sorted(engine.offloaded)
    parallel.destroy_parallel()
    return out


def _closed_form_lr(k: int, *, lr: float, min_lr: float, warmup: int, decay_steps: int, style: str) -> float:
    """megatron-core's OptimizerParamScheduler.get_lr at step k (the k-th update, 1-based)."""
    if warmup > 0 and k <= warmup:
        return lr * k / warmup
    if k > decay_steps:
        return min_lr
    ratio = (k - warmup) / (decay_steps - warmup)
    coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0) if style == "cosine" else 1.0 - ratio
    return min_lr + coeff * (lr - min_lr)


TRAINING_STEPS = 3  # x 4 optimizer steps per training step (2 mini-batches x 2 PPO epochs)


def _recipe(style: str):
    return test_config([
        f"trainer.total_steps={TRAINING_STEPS}", "data.train_batch_size=4", "actor.ppo_mini_batch_size=2",
        "actor.ppo_epochs=2", "actor.ppo_micro_batch_size_per_gpu=2", "actor.optim.lr=0.01",
        "actor.optim.min_lr=0.001", "actor.optim.lr_warmup_steps=3", f"actor.optim.lr_decay_style={style}",
        *seq_len_overrides(32)], hf_config=tiny_llama_config())


@pytest.fixture(scope="module")
def lr_configs():
    """The actor's RoleSpec as the trainer builds it from a recipe, per decay style."""
    from megaflow.topology.role_spec import RoleSpec

    return {style: RoleSpec(_recipe(style), "actor", TRAINING_STEPS) for style in ("cosine", "linear")}


@pytest.fixture(scope="module")
def results(lr_configs):
    return run_distributed(_rank, 2, lr_configs, 4 * TRAINING_STEPS + 2, 7, timeout_s=900)


@pytest.mark.parametrize("variant", [v for v in RECOMPUTE if v != "none"])
def test_recompute_matches_no_recompute(results, variant):
    for rank in results:
        base, other = rank["none"], rank[variant]
        torch.testing.assert_close(other["log_probs"], base["log_probs"], atol=1e-6, rtol=0)
        assert other["metrics"]["loss"] == pytest.approx(base["metrics"]["loss"], abs=1e-6)
        assert other["metrics"]["grad_norm"] == pytest.approx(base["metrics"]["grad_norm"], rel=1e-6)
        for name, grad in base["grads"].items():
            scale = float(grad.abs().max()) or 1.0
            torch.testing.assert_close(other["grads"][name] / scale, grad / scale, atol=1e-6, rtol=0, msg=name)


def test_recompute_keeps_fewer_activations(results):
    saved = {name: results[0][name]["saved"] for name in RECOMPUTE}
    assert saved["none"] > saved["selective"] > saved["full_uniform"] > 0, saved
    # block recomputes 2 of the 4 layers: between selective-free full recompute and none
    assert saved["full_uniform"] < saved["full_block"] < saved["none"], saved


def test_a_params_only_reload_keeps_grads_and_optimizer_offloaded(results):
    for rank in results:
        assert rank["partial_reload"] == ["grads", "optimizer"] and rank["full_reload"] == []
        assert "offloaded" in rank["train_while_offloaded"]
        assert torch.isfinite(rank["forward_after_partial_reload"]).all()


def test_lr_decay_steps_span_the_whole_run(lr_configs):
    for spec in lr_configs.values():
        assert spec.lr_decay_steps == TRAINING_STEPS * 2 * 2  # training steps x mini-batches x epochs
        assert spec.section.optim.lr_warmup_steps == 3


@pytest.mark.parametrize("style", ["cosine", "linear"])
def test_lr_schedule_follows_closed_form_and_survives_resume(results, style):
    expected = [_closed_form_lr(k, lr=0.01, min_lr=0.001, warmup=3, decay_steps=4 * TRAINING_STEPS, style=style)
                for k in range(1, 4 * TRAINING_STEPS + 3)]
    for rank in results:
        straight, resumed = rank["lr"][style]
        assert straight == pytest.approx(expected, rel=1e-12, abs=1e-15)
        assert resumed == straight
    # it decays over the run: still above min_lr until the last update, min_lr at and after it
    assert expected[4 * TRAINING_STEPS - 2] > 0.001 and expected[4 * TRAINING_STEPS - 1] == pytest.approx(0.001)


# ---------------------------------------------------------------- token-budget micro-batches
BUDGET = 26  # padded tokens per micro-batch: 2 rows of the longest (13-token) sequences


def _dynamic_rank(rank, world, layouts):
    from megaflow.megatron import model as M, parallel
    from megaflow.megatron.engine import MegatronEngine

    torch.manual_seed(0)
    cfg = tiny_llama_config()
    hf_state = hf_causal_lm(cfg, seed=7).state_dict()
    out = []
    for tp, pp in layouts:
        info = parallel.initialize_parallel(tp=tp, pp=pp, seed=1)
        common = [f"actor.tp={tp}", f"actor.pp={pp}", *seq_len_overrides(16),
                  "actor.ppo_micro_batch_size_per_gpu=2", "actor.log_prob_micro_batch_size_per_gpu=4",
                  "actor.optim.lr=0.001", "actor.optim.clip_grad=0.0", "actor.optim.lr_warmup_steps=0"]
        fixed = role_spec("actor", common, hf_config=cfg)
        dynamic = role_spec("actor", [*common, "actor.use_dynamic_bsz=true",
                                      f"actor.ppo_max_token_len_per_gpu={BUDGET}",
                                      f"actor.log_prob_max_token_len_per_gpu={BUDGET}"], hf_config=cfg)
        res = {"last_stage": info.is_last_pp_stage}
        for name, ec in (("fixed", fixed), ("dynamic", dynamic)):
            model = M.build_gpt_model(cfg)
            load_shard(model, hf_to_megatron_shard(hf_state, cfg, tp_rank=info.tp_rank, tp=tp, pp_rank=info.pp_rank,
                                                   pp=pp))
            engine = MegatronEngine(model, info, ec, vocab_size=VOCAB)
            batch = _batch()
            fwd = engine.forward(batch, temperature=0.9)
            metrics = engine.train_step(batch, _loss, temperature=0.9)
            res[name] = dict(fwd=fwd, metrics=metrics,
                             grads={k: p.main_grad.detach().clone() for k, p in engine.module.named_parameters()})
        out.append(res)
        parallel.destroy_parallel()
    return out


@pytest.fixture(scope="module")
def dynamic_results():
    return run_distributed(_dynamic_rank, 2, [(2, 1), (1, 2)], timeout_s=900)


def test_token_budget_groups_cover_every_row_within_the_budget():
    from megaflow.megatron.batch import token_budget_groups

    lengths = torch.tensor([5, 13, 2, 13, 7, 9, 1])
    groups = token_budget_groups(lengths, 26)
    assert sorted(torch.cat([i for i, _ in groups]).tolist()) == list(range(7))
    for index, width in groups:
        assert width == int(lengths[index].max()) and len(index) * width <= 26
    assert [(i.tolist(), w) for i, w in groups] == [([1, 3], 13), ([5, 4], 9), ([0, 2, 6], 5)]
    # widths rounded up to 4: 16 fits once in 26, 12 twice, 8 three times
    assert [(len(i), w) for i, w in token_budget_groups(lengths, 26, width_multiple=4)] == [(1, 16), (1, 16), (2, 12), (3, 8)]
    with pytest.raises(ValueError, match="13-token sequence does not fit a micro-batch budget of 12"):
        token_budget_groups(lengths, 12)


@pytest.mark.parametrize("layout", [0, 1], ids=["tp2", "pp2"])
def test_token_budget_micro_batches_equal_fixed_micro_batches(dynamic_results, layout):
    for rank in dynamic_results:
        res = rank[layout]
        fixed, dynamic = res["fixed"], res["dynamic"]
        if res["last_stage"]:
            torch.testing.assert_close(dynamic["fwd"]["log_probs"], fixed["fwd"]["log_probs"], atol=1e-6, rtol=1e-6)
            assert dynamic["metrics"]["loss"] == pytest.approx(fixed["metrics"]["loss"], abs=1e-6)
        assert dynamic["metrics"]["grad_norm"] == pytest.approx(fixed["metrics"]["grad_norm"], rel=1e-6)
        # other micro-batch groupings sum the same terms in another order: fp32 noise only
        for name, grad in fixed["grads"].items():
            error = float((dynamic["grads"][name] - grad).norm()) / max(float(grad.norm()), 1e-12)
            assert error < 5e-6, (name, error)


# ---------------------------------------------------------------- chunked vocab-parallel log-probs
CHUNK = 5  # response tokens per chunk (the batch has 6 x 6)


def _entropy_loss(outputs, mb, den):
    """Policy-gradient-like loss plus an entropy bonus: both chunked outputs get gradients."""
    mask = mb["response_mask"].float()
    loss = -((outputs["log_probs"] * mb["weights"] + 0.1 * outputs["entropy"]) * mask).sum() / den.num_tokens
    return loss, {}


def _chunked_rank(rank, world):
    from megaflow.megatron import model as M, parallel
    from megaflow.megatron.engine import MegatronEngine

    out = {}
    for tied in (False, True):
        torch.manual_seed(0)
        cfg = tiny_llama_config(tie_word_embeddings=tied)
        hf_state = hf_causal_lm(cfg, seed=7).state_dict()
        info = parallel.initialize_parallel(tp=2, pp=1, seed=1)
        # 3 prompts x 8 samples on dp=1: 24 rows per mini-batch, whole micro-batches of 3
        common = [*seq_len_overrides(16), "data.train_batch_size=3", "actor.ppo_mini_batch_size=3",
                  "actor.ppo_micro_batch_size_per_gpu=3", "actor.log_prob_micro_batch_size_per_gpu=3",
                  "actor.optim.lr=0.001", "actor.optim.clip_grad=0.0", "actor.optim.lr_warmup_steps=0"]
        plain = role_spec("actor", common, hf_config=cfg)
        chunked = role_spec("actor", [*common, f"actor.logits_chunk_tokens={CHUNK}"], hf_config=cfg)
        res = {}
        for name, ec in (("plain", plain), ("chunked", chunked)):
            model = M.build_gpt_model(cfg)
            load_shard(model, hf_to_megatron_shard(hf_state, cfg, tp_rank=info.tp_rank, tp=2, pp_rank=0, pp=1))
            engine = MegatronEngine(model, info, ec, vocab_size=VOCAB)
            batch = _batch()
            fwd = engine.forward(batch, temperature=0.8, with_entropy=True)
            shard = M.padded_vocab_size(VOCAB, 2) // 2
            saved = 0  # most vocabulary-shard rows of one tensor kept for backward

            def pack(t):
                nonlocal saved
                if t.dim() >= 2 and t.shape[-1] == shard:
                    saved = max(saved, t.numel() // shard)
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                metrics = engine.train_step(batch, _entropy_loss, temperature=0.8, with_entropy=True)
            res[name] = dict(fwd=fwd, metrics=metrics, saved=saved,
                             grads={k: p.main_grad.detach().clone() for k, p in engine.module.named_parameters()})
        out["tied" if tied else "untied"] = res
        parallel.destroy_parallel()
    return out


@pytest.fixture(scope="module")
def chunked_results():
    return run_distributed(_chunked_rank, 2, timeout_s=900)


@pytest.mark.parametrize("embeddings", ["untied", "tied"])
def test_chunked_log_probs_equal_the_full_logits_path(chunked_results, embeddings):
    for rank in chunked_results:
        plain, chunked = rank[embeddings]["plain"], rank[embeddings]["chunked"]
        for key in ("log_probs", "entropy"):
            torch.testing.assert_close(chunked["fwd"][key], plain["fwd"][key], atol=1e-6, rtol=1e-6)
        assert chunked["metrics"]["loss"] == pytest.approx(plain["metrics"]["loss"], abs=1e-6)
        assert chunked["metrics"]["grad_norm"] == pytest.approx(plain["metrics"]["grad_norm"], rel=1e-5)
        for name, grad in plain["grads"].items():
            error = float((chunked["grads"][name] - grad).norm()) / max(float(grad.norm()), 1e-12)
            assert error < 5e-6, (name, error)
        # logits / probabilities kept for backward: at most one chunk of tokens at a time, while the
        # full path keeps [micro-batch rows x sequence, V/tp]
        assert chunked["saved"] <= CHUNK < plain["saved"], (chunked["saved"], plain["saved"])
