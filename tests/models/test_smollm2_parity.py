"""The real SmolLM2-135M-Instruct (9 query heads, 3 KV heads, tied embeddings): megaflow's
Megatron model reproduces ``transformers`` log-probs at TP=3 and TP=1, and the checkpoint
exported back to HF reproduces the original logits.

One 3-rank world: TP=3 (load from HF, log-probs, export back to HF), then TP=1 on rank 0.
"""
from __future__ import annotations

import pytest
import torch

from megatron_forward import megatron_logits
from megaflow.utils.launch import run_distributed

PROMPT = "The capital of France is Paris. The capital of Germany is Berlin."


def _token_log_probs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """``[batch, seq-1]``: log-prob of token t from the logits at t-1."""
    log_probs = torch.log_softmax(logits[:, :-1].double(), dim=-1)
    return log_probs.gather(-1, input_ids[:, 1:, None]).squeeze(-1)


def _smollm2_world(rank, world_size, hf_dir, input_ids, export_dir):
    from transformers import AutoConfig

    from megaflow.megatron.model import build_gpt_model
    from megaflow.megatron.parallel import destroy_parallel, initialize_parallel
    from megaflow.models.export import export_hf_dir
    from megaflow.models.weights import load_hf_weights

    config = AutoConfig.from_pretrained(hf_dir)
    out = {}
    info = initialize_parallel(tp=3)
    model = build_gpt_model(config)
    load_hf_weights(model, hf_dir, config, info)
    out["tp3"] = megatron_logits(model, input_ids, info, config.vocab_size)
    export_hf_dir(model, config, info, export_dir, hf_files_from=hf_dir)
    del model
    destroy_parallel()
    info = initialize_parallel(tp=1)  # three data-parallel replicas; rank 0 computes
    if rank == 0:
        model = build_gpt_model(config)
        load_hf_weights(model, hf_dir, config, info)
        out["tp1"] = megatron_logits(model, input_ids, info, config.vocab_size)
    destroy_parallel()
    return out if rank == 0 else {}


@pytest.fixture(scope="module")
def smollm2_run(smollm2_dir, tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    input_ids = AutoTokenizer.from_pretrained(smollm2_dir)(PROMPT, return_tensors="pt")["input_ids"]
    reference = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref_logits = reference(input_ids=input_ids).logits
    del reference
    export_dir = tmp_path_factory.mktemp("smollm2") / "hf_back"
    out = run_distributed(_smollm2_world, 3, str(smollm2_dir), input_ids, str(export_dir),
                          timeout_s=900)[0]
    return input_ids, ref_logits, out, export_dir


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp3", "tp1"])
def test_smollm2_log_probs_equal_transformers(smollm2_run, layout):
    input_ids, ref_logits, out, _ = smollm2_run
    assert input_ids.shape[1] >= 10
    ours, ref = _token_log_probs(out[layout], input_ids), _token_log_probs(ref_logits, input_ids)
    assert (ours - ref).abs().max().item() < 1e-4
    assert ref[0, -3:].exp().min() > 0.05  # a real model: the continuation is likely


@pytest.mark.slow
def test_smollm2_exported_checkpoint_reproduces_logits(smollm2_run):
    from transformers import AutoModelForCausalLM

    input_ids, ref_logits, _, export_dir = smollm2_run
    model = AutoModelForCausalLM.from_pretrained(export_dir).eval()
    assert model.config.tie_word_embeddings and (export_dir / "tokenizer.json").is_file()
    with torch.no_grad():
        logits = model(input_ids=input_ids).logits
    assert torch.equal(logits, ref_logits)


@pytest.mark.slow
def test_ensure_smollm2_is_idempotent(smollm2_dir):
    from transformers import AutoConfig

    from megaflow.models.smollm2 import ensure_smollm2

    weights = smollm2_dir / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert ensure_smollm2(smollm2_dir) == smollm2_dir and weights.stat().st_mtime_ns == before
    config = AutoConfig.from_pretrained(smollm2_dir)
    assert (config.num_attention_heads, config.num_key_value_heads, config.tie_word_embeddings) == (9, 3, True)
    assert not hasattr(config, "quantization_config")


def test_failed_smollm2_preparation_leaves_no_directory(tmp_path, monkeypatch):
    from megaflow.models import smollm2

    def fail(gguf, out):
        (out / "model.safetensors").write_bytes(b"partial")
        raise RuntimeError("interrupted on purpose")

    monkeypatch.setattr(smollm2, "_convert_gguf", fail)
    with pytest.raises(RuntimeError, match="interrupted on purpose"):
        smollm2.ensure_smollm2(tmp_path / "cache")
    assert list(tmp_path.iterdir()) == []
