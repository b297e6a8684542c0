"""MegatronEngine at TP=2, PP=2, DP=2 (one 2-rank world) and TP=2 x PP=2 (one 4-rank world)
against single-process Hugging Face references computed in the test process:

* log-probs and entropy (temperature 0.8) equal ``transformers`` within 1e-5, with
  micro-batch 1 vs 4 and with extra left/right padding;
* critic values equal the HF final hidden state @ score weight;
* one optimizer step (grad clipping and LR warm-up active) against HF + torch AdamW with
  ``clip_grad_norm_`` on the whole batch: the same grad norm; the same gradients before
  the step (each tensor within a norm-relative 1e-4: reduction order differs between
  layouts and CPUs' kernels, about 1e-6 of a norm); the same update wherever the gradient
  is well above that noise, and Adam's bound ``|update| <= lr`` everywhere. (Comparing
  every updated weight is not meaningful: Adam's first step is ``lr * g / (|g| + eps)``,
  which turns the reduction-order noise of a near-zero gradient into an update of about
  ``lr`` in either direction.) The gradients are read where they are complete on a rank
  (``main_grad`` after Megatron's gradient reduction, before the step, at DP = 1; the
  distributed optimizer keeps only its shard reduced);
* the ND-dispatch registration follows Megatron's rank order; bad input raises on all ranks.
"""
from __future__ import annotations

import copy

import pytest
import torch

from megaflow.utils.launch import run_distributed
from megatron_testlib import (VOCAB, hf_causal_lm, hf_reference, hf_to_megatron_shard,
                              hf_values_reference, load_shard, make_batch, tiny_llama_config)

pytestmark = pytest.mark.slow

TEMPERATURE, LR, WARMUP, CLIP, ENTROPY_COEF = 0.8, 1e-2, 4, 0.05, 0.01
HF_SEED, BATCH_SEED = 7, 0


def score_weight():
    return torch.randn(1, 64, generator=torch.Generator().manual_seed(11)) * 0.1


def batch_with_advantages():
    batch = make_batch(BATCH_SEED)
    batch["advantages"] = torch.randn(batch["responses"].shape, generator=torch.Generator().manual_seed(5))
    return batch


def policy_loss(outputs, mb, den):
    """Token-mean policy gradient + seq-mean entropy bonus with global denominators."""
    mask = mb["response_mask"].float()
    pg = -(outputs["log_probs"] * mb["advantages"] * mask).sum() / den.num_tokens
    bonus = -ENTROPY_COEF * (outputs["entropy"] * mask).sum() / den.num_seqs
    return pg + bonus, {"pg_loss": pg.detach()}


def extra_padding(batch, left=2, right=3):
    """The same sequences with ``left`` more prompt padding and ``right`` more response padding."""
    out = {}
    for key in ("input_ids", "attention_mask", "position_ids"):
        t = batch[key]
        out[key] = torch.cat([t.new_zeros(len(t), left), t, t.new_zeros(len(t), right)], dim=1)
    resp_len = batch["responses"].shape[1] + right
    out["responses"] = out["input_ids"][:, -resp_len:]
    for key in ("response_mask", "advantages"):
        out[key] = torch.cat([batch[key], batch[key].new_zeros(len(batch[key]), right)], dim=1)
    return out


def _rows(batch, dp_rank, dp_size):
    return {k: v.chunk(dp_size)[dp_rank] for k, v in batch.items()}


def _spec(role, cfg, tp, pp, world, max_seq_len=32, *extra):
    """The engine's settings: the default recipe on this world and layout, with the test's model."""
    from role_testlib import role_spec, seq_len_overrides

    return role_spec(role, [f"actor.tp={tp}", f"actor.pp={pp}", f"resources.procs_per_node={world}",
                            *seq_len_overrides(max_seq_len), *extra], hf_config=cfg)


def _layout(cfg, hf_state, tp, pp, errors_case):
    from megaflow.megatron import model as M
    from megaflow.megatron import parallel
    from megaflow.megatron.engine import MegatronEngine

    info = parallel.initialize_parallel(tp=tp, pp=pp, seed=1)
    world = info.world_size
    shard = dict(tp_rank=info.tp_rank, tp=tp, pp_rank=info.pp_rank, pp=pp)
    res = {"info": (info.tp_rank, info.pp_rank, info.dp_rank, info.dp_size,
                    parallel.nd_dispatch_info(info))}
    batch = _rows(batch_with_advantages(), info.dp_rank, info.dp_size)

    ref_model = M.build_gpt_model(cfg)  # forward-only engine (reference-policy style)
    load_shard(ref_model, hf_to_megatron_shard(hf_state, cfg, **shard))
    ref_engine = MegatronEngine(ref_model, info, _spec("ref", cfg, tp, pp, world), vocab_size=VOCAB)
    kwargs = dict(temperature=TEMPERATURE, with_entropy=True)
    res["mbs4"] = ref_engine.forward(batch, micro_batch_size=4, **kwargs)
    res["mbs1"] = ref_engine.forward(batch, micro_batch_size=1, **kwargs)
    res["padded"] = ref_engine.forward(extra_padding(batch), micro_batch_size=2, **kwargs)
    ref_engine.offload()
    try:
        ref_engine.forward(batch)
    except RuntimeError as exc:
        res["offloaded_error"] = str(exc)
    ref_engine.reload()
    res["after_reload"] = ref_engine.forward(batch, micro_batch_size=4, **kwargs)

    critic = M.build_gpt_model(cfg, head="value")
    load_shard(critic, hf_to_megatron_shard(hf_state, cfg, head="value", score_weight=score_weight(), **shard))
    res["values"] = MegatronEngine(critic, info, _spec("critic", cfg, tp, pp, world),
                                   vocab_size=VOCAB).forward(batch, micro_batch_size=4)

    actor = M.build_gpt_model(cfg)
    load_shard(actor, hf_to_megatron_shard(hf_state, cfg, **shard))
    engine = MegatronEngine(actor, info, _spec(
        "actor", cfg, tp, pp, world, 32, "actor.ppo_micro_batch_size_per_gpu=2", f"actor.optim.lr={LR}",
        f"actor.optim.lr_warmup_steps={WARMUP}", "actor.optim.weight_decay=0.0", f"actor.optim.clip_grad={CLIP}"),
        vocab_size=VOCAB)
    engine.offload()
    engine.reload()  # the offload path runs between phases; training must be unaffected
    if info.dp_size == 1:
        res["grads"] = {}
        step = engine.optimizer.step

        def record_grads_then_step():  # after the gradient reduction, before clipping and Adam
            for name, param in engine.module.named_parameters():
                res["grads"][name] = param.main_grad.detach().clone()
            return step()

        engine.optimizer.step = record_grads_then_step
    res["metrics"] = engine.train_step(batch, policy_loss, temperature=TEMPERATURE, with_entropy=True)
    res["params"] = {k: v.detach().clone() for k, v in engine.module.state_dict().items()
                     if torch.is_tensor(v) and not k.endswith("_extra_state")}
    if errors_case:
        res["errors"] = _bad_input(info, engine, batch, _spec("ref", cfg, tp, pp, world, 12))
    parallel.destroy_parallel()
    return res


def _bad_input(info, engine, batch, spec):
    """Too-long sequence on DP rank 0 only: every rank must raise, none may hang."""
    from megaflow.megatron.engine import MegatronEngine

    strict = MegatronEngine(engine.module, info, spec, vocab_size=VOCAB)  # spec: max_seq_len 12
    mine = batch if info.dp_rank == 0 else make_batch(1, batch=len(batch["input_ids"]),
                                                      prompt_len=5, response_len=6)
    try:
        strict.forward(mine)
        return None
    except ValueError as exc:
        return str(exc)


def _run_layouts(rank, world, layouts):
    torch.manual_seed(0)
    cfg = tiny_llama_config()
    hf_state = hf_causal_lm(cfg, seed=HF_SEED).state_dict()
    return [_layout(cfg, hf_state, tp, pp, errors_case) for tp, pp, errors_case in layouts]


@pytest.fixture(scope="module")
def reference():
    """HF forward outputs and the state after one clipped, warmed-up AdamW step."""
    cfg = tiny_llama_config()
    hf = hf_causal_lm(cfg, seed=HF_SEED)
    batch = batch_with_advantages()
    with torch.no_grad():
        fwd = hf_reference(hf, batch, TEMPERATURE)
        values = hf_values_reference(hf, batch, score_weight())
    valid = batch["attention_mask"][:, -batch["responses"].shape[1]:].float()
    model = copy.deepcopy(hf).train()
    out = hf_reference(model, batch, TEMPERATURE)
    mask = batch["response_mask"].float()
    num_tokens, num_seqs = mask.sum(), (mask.sum(-1) > 0).sum()
    pg = -(out["log_probs"] * batch["advantages"] * mask).sum() / num_tokens
    loss = pg - ENTROPY_COEF * (out["entropy"] * mask).sum() / num_seqs
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP))
    torch.optim.AdamW(model.parameters(), lr=LR / WARMUP, weight_decay=0.0).step()
    return dict(cfg=cfg, log_probs=fwd["log_probs"] * valid, entropy=fwd["entropy"] * valid,
                values=values * valid, loss=float(loss.detach()), pg=float(pg.detach()), grad_norm=grad_norm,
                grads=_with_tied_head(grads, cfg), initial=hf.state_dict(),
                state={k: v.detach() for k, v in model.state_dict().items()})


def _with_tied_head(grads, cfg):
    """Named-parameter gradients as a state dict (a tied head listed under both names)."""
    if cfg.tie_word_embeddings and "lm_head.weight" not in grads:
        grads = {**grads, "lm_head.weight": grads["model.embed_tokens.weight"]}
    return grads


def _collect(results, key):
    """Outputs of the collect ranks (tp 0, last stage), ordered by dp rank, concatenated."""
    collected = sorted((r["info"][2], r[key]) for r in results if r["info"][4][1])
    assert [d for d, _ in collected] == list(range(results[0]["info"][3]))
    return {k: torch.cat([out[k] for _, out in collected]) for k in collected[0][1]}


def _check_layout(results, ref, tp, pp):
    tol = dict(atol=1e-5, rtol=0)
    for key in ("mbs4", "mbs1", "after_reload"):
        out = _collect(results, key)
        torch.testing.assert_close(out["log_probs"], ref["log_probs"], **tol)
        torch.testing.assert_close(out["entropy"], ref["entropy"], **tol)
    padded = _collect(results, "padded")
    resp_len = ref["log_probs"].shape[1]
    torch.testing.assert_close(padded["log_probs"][:, :resp_len], ref["log_probs"], **tol)
    assert torch.all(padded["log_probs"][:, resp_len:] == 0)
    torch.testing.assert_close(_collect(results, "values")["values"], ref["values"], **tol)
    for r in results:
        assert "offloaded" in r["offloaded_error"]
        m = r["metrics"]
        assert m["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5) and m["grad_norm"] > CLIP
        assert m["lr"] == pytest.approx(LR / WARMUP)
        if r["info"][4][1]:  # collect rank: loss summed over micro-batches and DP
            assert m["loss"] == pytest.approx(ref["loss"], abs=1e-5)
            assert m["pg_loss"] == pytest.approx(ref["pg"], abs=1e-5)
        shard = dict(tp_rank=r["info"][0], tp=tp, pp_rank=r["info"][1], pp=pp)
        if "grads" in r:
            _check_grads(r["grads"], hf_to_megatron_shard(ref["grads"], ref["cfg"], **shard))
        _check_update(r["params"], *(hf_to_megatron_shard(ref[k], ref["cfg"], **shard)
                                     for k in ("initial", "state", "grads")))


GRAD_RTOL = 1e-4          # norm-relative, per tensor
SIGNAL = 1e-3             # gradient elements above this share of their tensor's largest
UPDATE_ATOL = 2e-5


def _check_grads(grads, expected):
    """Every tensor's gradient within ``GRAD_RTOL * ||reference||`` (2-norm) of the reference."""
    assert set(grads) == set(expected)
    for name, ref in expected.items():
        assert ref.norm() > 0, name
        rel = float((grads[name] - ref).norm() / ref.norm())
        assert rel <= GRAD_RTOL, f"{name}: gradient differs from the reference by {rel:.2e} of its norm"


def _check_update(params, initial, expected, grads):
    """The update where the reference gradient is well above reduction noise equals the
    reference's; elsewhere it is within Adam's first-step bound ``lr``."""
    lr = LR / WARMUP
    checked = 0
    for name, ref in expected.items():
        update = params[name] - initial[name]
        assert update.abs().max() <= lr * (1 + 1e-3), f"{name}: an update beyond Adam's bound lr={lr}"
        g = grads[name].abs()
        signal = g > SIGNAL * g.max()
        checked += int(signal.sum())
        torch.testing.assert_close(params[name][signal], ref[signal], atol=UPDATE_ATOL, rtol=0, msg=name)
    assert checked > 0.5 * sum(v.numel() for v in expected.values())  # most elements carry signal


@pytest.fixture(scope="module")
def two_rank_results():
    """One 2-rank world running TP=2, then PP=2, then DP=2 (parallel state rebuilt)."""
    return run_distributed(_run_layouts, 2, [(2, 1, False), (1, 2, False), (1, 1, True)],
                           timeout_s=900)


@pytest.mark.parametrize("index, tp, pp", [(0, 2, 1), (1, 1, 2), (2, 1, 1)], ids=["tp2", "pp2", "dp2"])
def test_two_rank_layouts_match_single_process(two_rank_results, reference, index, tp, pp):
    _check_layout([r[index] for r in two_rank_results], reference, tp, pp)


def test_too_long_sequence_on_one_dp_rank_raises_everywhere(two_rank_results):
    errors = [r[2]["errors"] for r in two_rank_results]
    assert "longer than the configured maximum max_seq_len=12" in errors[0]
    assert "another rank rejected" in errors[1]


def test_tp2_pp2_matches_single_process(reference):
    results = [r[0] for r in run_distributed(_run_layouts, 4, [(2, 2, False)], timeout_s=900)]
    # Megatron rank order tp-cp-dp-pp: rank = pp_rank * 2 + tp_rank; collect on tp 0, last stage
    assert [r["info"][:3] for r in results] == [(0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0)]
    assert [r["info"][4] for r in results] == [(0, False), (0, False), (0, True), (0, False)]
    _check_layout(results, reference, 2, 2)
