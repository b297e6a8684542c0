"""Benchmark: rollout tokens/s of the vLLM engine vs ``transformers`` ``generate``.

Both run the same model (a random Llama built from ``--hidden/--layers/...``, or an HF
directory given with ``--model-dir``), the same left-padded prompts (``--batch`` prompts
of ``--prompt-len`` random tokens) and the same number of new tokens: greedy decoding
with no EOS, so every row generates exactly ``--response-len`` tokens in both engines,
through megaflow's two rollout classes (:class:`megaflow.rollout.VLLMRollout`,
:class:`megaflow.rollout.HFRollout`) and the same ``DataProto`` in/out. Each engine gets
one untimed warm-up call (a few rows) before the timed call; vLLM's start-up is
reported separately. Both use ``--threads`` torch/OpenMP threads (default 1; vLLM's CPU
build would otherwise force torch to one thread). Prints tokens/s of each, their ratio
and how many greedy rows agree between the two.

Measured on a shared 2-core machine, fp32, 1 thread, batch 64, prompt 32, response 128
(repeated runs; the machine's other load moves single runs by up to 2x):
8.1M-parameter default Llama: transformers 970-1,190 tokens/s, vLLM 1,210-1,340 tokens/s
(1.0-1.4x), 64/64 greedy rows identical, engine start 11-13 s, about 45 s in all;
24M (``--hidden 512 --heads 16 --kv-heads 8``): 510 vs 630 tokens/s (1.2x).

Usage::

    python tools/bench_rollout.py [--batch 64] [--prompt-len 32] [--response-len 128] [--threads 1]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megaflow.protocol import DataProto


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=64, help="prompts per rollout call")
    parser.add_argument("--prompt-len", type=int, default=32, help="tokens per prompt")
    parser.add_argument("--response-len", type=int, default=128, help="new tokens per prompt")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch/OpenMP threads for both engines (on a busy machine more than 1 thread "
                             "makes OpenMP spin-wait and the figures unreliable)")
    parser.add_argument("--model-dir", default=None, help="HF model directory (default: a random Llama)")
    parser.add_argument("--hidden", type=int, default=256, help="hidden size of the random Llama")
    parser.add_argument("--layers", type=int, default=4, help="layers of the random Llama")
    parser.add_argument("--heads", type=int, default=8, help="attention heads (head_dim = hidden / heads >= 32)")
    parser.add_argument("--kv-heads", type=int, default=4, help="KV heads")
    parser.add_argument("--vocab", type=int, default=8192, help="vocabulary size of the random Llama")
    args = parser.parse_args(argv)
    for name in ("batch", "prompt_len", "response_len", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def build_random_llama(path: str, args: argparse.Namespace) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, max_position_embeddings=1024,
                         eos_token_id=2, pad_token_id=2, tie_word_embeddings=False)
    LlamaForCausalLM(config).float().save_pretrained(path)
    return path


def make_prompts(args: argparse.Namespace, vocab_size: int):
    import torch

    from megaflow.protocol import DataProto

    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab_size, (args.batch, args.prompt_len), generator=gen)
    mask = torch.ones_like(ids)
    return DataProto.from_dict({"input_ids": ids, "attention_mask": mask},
                               meta_info={"do_sample": False, "response_length": args.response_len})


def timed_rollout(engine, prompts) -> tuple[float, DataProto]:
    engine.generate_sequences(prompts[: min(4, len(prompts))])  # warm-up (allocations, kernel caches)
    start = time.perf_counter()
    out = engine.generate_sequences(prompts)
    return time.perf_counter() - start, out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # before torch/vLLM read it
    import torch

    torch.set_num_threads(args.threads)
    from megaflow.rollout import HFRollout, SamplingConfig
    from megaflow.rollout.vllm_rollout import VLLMRollout, VLLMRolloutConfig

    with tempfile.TemporaryDirectory(prefix="bench_rollout_") as tmp:
        model_dir = args.model_dir or build_random_llama(tmp, args)
        sampling = SamplingConfig(eos_token_ids=(), pad_token_id=0, response_length=args.response_len)
        hf = HFRollout.from_pretrained(model_dir, sampling=sampling)
        num_params = sum(p.numel() for p in hf.model.parameters())
        prompts = make_prompts(args, hf.model.config.vocab_size)
        hf_time, hf_out = timed_rollout(hf, prompts)

        start = time.perf_counter()
        vllm = VLLMRollout(VLLMRolloutConfig(model_dir, max_model_len=args.prompt_len + args.response_len,
                                             max_num_seqs=args.batch, kv_cache_bytes=512 << 20), sampling)
        startup = time.perf_counter() - start
        vllm_time, vllm_out = timed_rollout(vllm, prompts)

    tokens = args.batch * args.response_len
    assert hf_out.batch is not None and vllm_out.batch is not None
    generated = (int(hf_out.batch["response_mask"].sum()), int(vllm_out.batch["response_mask"].sum()))
    if generated != (tokens, tokens):
        raise RuntimeError(f"expected {tokens} generated tokens from each engine, got {generated}")
    same_rows = int((hf_out.batch["responses"] == vllm_out.batch["responses"]).all(dim=-1).sum())
    hf_rate, vllm_rate = tokens / hf_time, tokens / vllm_time
    print(f"model: {num_params / 1e6:.1f}M params, fp32, {args.threads} thread(s); batch {args.batch}, "
          f"prompt {args.prompt_len}, response {args.response_len} tokens (greedy, no EOS)")
    print(f"transformers generate: {hf_time:7.2f} s  {hf_rate:9.1f} tokens/s")
    print(f"vLLM rollout:          {vllm_time:7.2f} s  {vllm_rate:9.1f} tokens/s  (engine start {startup:.1f} s)")
    print(f"vLLM / transformers tokens/s ratio: {vllm_rate / hf_rate:.2f}x; "
          f"greedy rows identical: {same_rows}/{args.batch}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
