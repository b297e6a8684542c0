"""Checkpoints of an MoE actor with expert parallelism and the distributed optimizer
(megaflow.workers.checkpointing): written at EP=2 x DP=2 (each rank holds half of the
experts; the experts' optimizer state lives on its EP rank, the dense parameters' is sharded
over DP), resumed exactly at EP=2, and refused at EP=1 naming ``actor.ep``.

Two updates, save, two more: once continuing, once after loading into fresh engines. Losses
and grad norms agree within fp32 noise; the second update after the checkpoint needs the
restored Adam moments, and a control resume with the weights only (fresh Adam) visibly
differs, so the check can fail.
"""
from __future__ import annotations

import pytest

import moe_testlib
from megaflow.utils.launch import run_distributed
from megatron_testlib import VOCAB, batch_with_advantages, token_mean_policy_loss

pytestmark = pytest.mark.slow


def _engine(hf_dir, ep):
    from transformers import AutoConfig

    from megaflow.megatron import parallel
    from megaflow.megatron.engine import MegatronEngine
    from megaflow.megatron.model import build_gpt_model
    from megaflow.models.weights import load_hf_weights
    from role_testlib import role_spec, seq_len_overrides

    spec = role_spec("actor", ["actor.tp=1", f"actor.ep={ep}", "resources.procs_per_node=2", *seq_len_overrides(32),
                               "actor.ppo_micro_batch_size_per_gpu=2", "actor.optim.lr=0.01",
                               "actor.optim.lr_warmup_steps=0", "actor.use_distributed_optimizer=true"],
                     hf_config=moe_testlib.tiny_moe_config(VOCAB))
    info = parallel.initialize_parallel(tp=1, pp=1, ep=spec.parallel.ep, seed=1)
    config = AutoConfig.from_pretrained(hf_dir)
    model = build_gpt_model(config)
    load_hf_weights(model, hf_dir, config, info)
    batch = {k: v.chunk(info.dp_size)[info.dp_rank] for k, v in batch_with_advantages().items()}
    return config, MegatronEngine(model, info, spec, vocab_size=VOCAB), batch


def _save_and_continue(rank, world, hf_dir, path):
    from megaflow.workers.checkpointing import save_engine_checkpoint

    config, engine, batch = _engine(hf_dir, 2)
    for _ in range(2):
        engine.train_step(batch, token_mean_policy_loss)
    save_engine_checkpoint(engine, path, config.to_dict())
    return [engine.train_step(batch, token_mean_policy_loss) for _ in range(2)]


def _resume(rank, world, hf_dir, path, ep, with_optimizer):
    from megaflow.models.checkpoint import load_checkpoint
    from megaflow.workers.checkpointing import MODEL_DIR, load_engine_checkpoint

    _, engine, batch = _engine(hf_dir, ep)
    if not with_optimizer:
        load_checkpoint(engine.module, f"{path}/{MODEL_DIR}")
        engine.scheduler.num_steps = 2
    else:
        try:
            load_engine_checkpoint(engine, path)
        except ValueError as err:
            return str(err)
    return [engine.train_step(batch, token_mean_policy_loss) for _ in range(2)]


def test_ep2_checkpoint_resumes_exactly_and_is_refused_at_ep1(tmp_path):
    hf_dir, path = tmp_path / "hf", str(tmp_path / "ckpt")
    moe_testlib.tiny_moe_model(VOCAB).save_pretrained(hf_dir)
    straight = run_distributed(_save_and_continue, 2, str(hf_dir), path, timeout_s=900)[0]
    resumed = run_distributed(_resume, 2, str(hf_dir), path, 2, True, timeout_s=900)[0]
    fresh_adam = run_distributed(_resume, 2, str(hf_dir), path, 2, False, timeout_s=900)[0]
    refused = run_distributed(_resume, 2, str(hf_dir), path, 1, True, timeout_s=900)
    for a, b in zip(straight, resumed, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
    assert abs(fresh_adam[1]["loss"] - straight[1]["loss"]) > 100 * abs(resumed[1]["loss"] - straight[1]["loss"])
    assert all(isinstance(r, str) and r.startswith("actor.ep:") and "saved at ep=2" in r for r in refused), refused
