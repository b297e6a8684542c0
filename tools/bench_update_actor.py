#!/usr/bin/env python
"""Tokens/s of a megaflow actor update at TP=1 next to plain torch + AdamW, in one run.

Both sides train the same random Llama-architecture model (same weights, same batch of
left-padded prompts + right-padded responses, fp32, one process) with the same PPO loss
(``megaflow.algorithms.ppo_policy_loss``, token-mean):

* **megaflow**: ``MegatronEngine.train_step`` (megatron-core GPTModel, DDP, Megatron's
  optimizer with grad clipping, ``get_forward_backward_func`` over micro-batches,
  vocab-parallel log-probs) with the worker's loss adapter;
* **baseline**: ``transformers`` ``LlamaForCausalLM`` forward on the whole batch,
  ``log_softmax`` + gather, ``clip_grad_norm_``, ``torch.optim.AdamW``.

Tokens/s counts real (non-padding) tokens per optimizer step. Prints both and the ratio.

    python tools/bench_update_actor.py --hidden 256 --layers 4 --batch 8 --steps 5
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--batch", type=int, default=8, help="rows per optimizer step")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--response-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=5, help="timed steps (after one warm-up step)")
    p.add_argument("--threads", type=int, default=1)
    return p.parse_args(argv)


def hf_config(args):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=args.hidden, intermediate_size=int(args.hidden * 8 / 3) // 8 * 8,
                       num_hidden_layers=args.layers, num_attention_heads=args.heads,
                       num_key_value_heads=args.kv_heads, vocab_size=args.vocab,
                       max_position_embeddings=args.prompt_len + args.response_len,
                       tie_word_embeddings=False)


def make_batch(args) -> dict:
    g = torch.Generator().manual_seed(0)
    seq = args.prompt_len + args.response_len
    mask = torch.zeros(args.batch, seq, dtype=torch.int64)
    for row in range(args.batch):
        p = int(torch.randint(args.prompt_len // 2, args.prompt_len + 1, (1,), generator=g))
        r = int(torch.randint(args.response_len // 2, args.response_len + 1, (1,), generator=g))
        mask[row, args.prompt_len - p: args.prompt_len + r] = 1
    ids = torch.randint(0, args.vocab, (args.batch, seq), generator=g) * mask
    resp = ids[:, args.prompt_len:]
    return dict(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp_min(0),
                responses=resp, response_mask=mask[:, args.prompt_len:].clone(),
                old_log_probs=torch.randn(resp.shape, generator=g) * 0.1 - 3.0,
                advantages=torch.randn(resp.shape, generator=g))


def _timed(step, num_steps: int) -> float:
    step()  # warm-up
    start = time.perf_counter()
    for _ in range(num_steps):
        step()
    return (time.perf_counter() - start) / num_steps


def baseline_step_time(model, batch, args) -> float:
    from megaflow.algorithms import ppo_policy_loss

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0)
    resp_len = args.response_len

    def step():
        optimizer.zero_grad()
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       position_ids=batch["position_ids"]).logits[:, -resp_len - 1:-1]
        log_probs = torch.log_softmax(logits.float(), -1).gather(
            -1, batch["responses"].unsqueeze(-1)).squeeze(-1)
        loss, _ = ppo_policy_loss(log_probs, batch["old_log_probs"], batch["advantages"],
                                  batch["response_mask"])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()

    return _timed(step, args.steps)


def megaflow_spec(args, hf):
    """The actor's settings: the tiny recipe on one rank with this model, one mini-batch of
    ``--batch`` samples (REINFORCE++: one sample per prompt), lr 1e-5 without warm-up or decay."""
    from megaflow.config import config_to_dict
    from megaflow.topology import load_run, run_from_dict
    from megaflow.topology.role_spec import RoleSpec

    cfg = load_run("tiny_arith_grpo", [
        "resources.procs_per_node=1", "actor.tp=1", "rollout.n=1", "algorithm.adv_estimator=reinforce_plus_plus",
        f"data.train_batch_size={args.batch}", f"actor.ppo_mini_batch_size={args.batch}",
        f"actor.ppo_micro_batch_size_per_gpu={args.micro_batch}", f"data.max_prompt_length={args.prompt_len}",
        f"rollout.response_length={args.response_len}", "actor.optim.lr=1e-5", "actor.optim.weight_decay=0.0",
        "actor.optim.clip_grad=1.0", "actor.optim.lr_warmup_steps=0"])
    tree = config_to_dict(cfg)
    tree["model"]["hf_config"] = {k: v for k, v in hf.to_dict().items() if v is not None}
    if cfg.trainer.total_steps is None:  # the recipe's steps are the lr schedule's length
        raise ValueError("tiny_arith_grpo must set trainer.total_steps for this benchmark")
    return RoleSpec(run_from_dict(tree), "actor", cfg.trainer.total_steps)


def megaflow_step_time(hf_model, batch, args) -> float:
    from megaflow.megatron import model as M
    from megaflow.megatron.engine import MegatronEngine
    from megaflow.megatron.parallel import destroy_parallel, initialize_parallel
    from megaflow.models.weights import load_hf_weights
    from megaflow.workers.losses import actor_loss_fn

    info = initialize_parallel(tp=1, seed=0)
    cfg = hf_config(args)
    spec = megaflow_spec(args, cfg)
    model = M.build_gpt_model(cfg)
    load_hf_weights(model, hf_model.state_dict(), cfg, info)
    engine = MegatronEngine(model, info, spec, vocab_size=args.vocab)
    loss_fn = actor_loss_fn(spec.config)
    seconds = _timed(lambda: engine.train_step(batch, loss_fn), args.steps)
    destroy_parallel()
    return seconds


def run(rank: int, world_size: int, args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    cfg = hf_config(args)
    hf_model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").float()
    batch = make_batch(args)
    megaflow_s = megaflow_step_time(hf_model, batch, args)
    baseline_s = baseline_step_time(hf_model.train(), batch, args)
    tokens = int(batch["attention_mask"].sum())
    params = sum(p.numel() for p in hf_model.parameters())
    return dict(tokens=tokens, params=params, megaflow_s=megaflow_s, baseline_s=baseline_s)


def main(argv=None) -> None:
    from megaflow.utils.launch import run_distributed

    args = parse_args(argv)
    r = run_distributed(run, 1, args, timeout_s=3600, num_threads=args.threads)[0]
    mf, base = r["tokens"] / r["megaflow_s"], r["tokens"] / r["baseline_s"]
    print(f"model: {r['params'] / 1e6:.1f}M params, batch {args.batch} x "
          f"{args.prompt_len + args.response_len} ({r['tokens']} real tokens/step), "
          f"{args.threads} thread(s), fp32, CPU={not torch.cuda.is_available()}")
    print(f"megaflow update_actor (TP=1, micro-batch {args.micro_batch}): {mf:,.0f} tokens/s "
          f"({r['megaflow_s'] * 1e3:.0f} ms/step)")
    print(f"plain torch + AdamW (whole batch):          {base:,.0f} tokens/s "
          f"({r['baseline_s'] * 1e3:.0f} ms/step)")
    print(f"ratio megaflow / plain torch: {mf / base:.2f}")


if __name__ == "__main__":
    main()
