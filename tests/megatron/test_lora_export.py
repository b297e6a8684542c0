"""``trainer.export_hf`` of a LoRA-trained actor (megaflow.models.export with an adapter): a
TP=2 Megatron actor with non-zero adapters on every target module is exported as the frozen
base (HF safetensors) plus the adapters in Hugging Face PEFT layout (``adapter/``); ``peft``
loads the adapter on top of the exported base with ``transformers`` and its response
log-probs equal megaflow's (fp32, 1e-5); the base alone equals the actor with adapters
disabled, so the adapters were not merged into the exported base weights."""
from __future__ import annotations

import zlib

import pytest
import torch
from megatron_testlib import (
    VOCAB,
    hf_causal_lm,
    hf_reference,
    hf_to_megatron_shard,
    load_shard,
    make_batch,
    tiny_llama_config,
)

from megaflow.utils.launch import run_distributed

pytestmark = pytest.mark.slow

RANK, ALPHA, DROPOUT = 4, 8.0, 0.05


def _export_rank(rank: int, world: int, out_dir: str) -> dict:
    from role_testlib import role_spec, seq_len_overrides

    from megaflow.megatron import model as M
    from megaflow.megatron import parallel
    from megaflow.megatron.engine import MegatronEngine
    from megaflow.megatron.lora import adapters_disabled, global_module_path, lora_layers
    from megaflow.models.export import export_hf_dir
    from megaflow.workers.megatron_role import MegatronRole

    cfg = tiny_llama_config()
    info = parallel.initialize_parallel(tp=world, pp=1, seed=1)
    shard = hf_to_megatron_shard(hf_causal_lm(cfg, seed=7).state_dict(), cfg, tp_rank=info.tp_rank, tp=world,
                                 pp_rank=0, pp=1)
    model = M.build_gpt_model(cfg, transformer_engine=False)
    load_shard(model, shard)
    spec = role_spec("actor", [f"actor.tp={world}", f"resources.procs_per_node={world}", *seq_len_overrides(32),
                               "actor.ppo_micro_batch_size_per_gpu=2", f"actor.lora.rank={RANK}",
                               f"actor.lora.alpha={ALPHA}", f"actor.lora.dropout={DROPOUT}"], hf_config=cfg)
    engine = MegatronEngine(model, info, spec, vocab_size=VOCAB)
    for path, layer in lora_layers(engine.module):  # a non-zero B (replicated ones equal on every TP rank)
        name = global_module_path(engine.module, path)
        g = torch.Generator().manual_seed(zlib.crc32(name.encode()) + (info.tp_rank if layer.lora_kind == "column"
                                                                      else 0))
        with torch.no_grad():
            layer.lora_b.weight.copy_(torch.randn(layer.lora_b.weight.shape, generator=g) * 0.2)
    batch = make_batch(3)
    adapted = engine.forward(batch, micro_batch_size=3)["log_probs"]
    with adapters_disabled(engine.module):
        base = engine.forward(batch, micro_batch_size=3)["log_probs"]
    role = MegatronRole(spec)  # the workers' gather + conversion, without Ray
    role.engine, role.info = engine, info
    export_hf_dir(engine.module, cfg, info, out_dir, adapter=role.peft_adapter(), adapter_dropout=DROPOUT)
    parallel.destroy_parallel()
    return {"adapted": adapted, "base": base, "batch": batch}


def test_exported_peft_adapter_matches_megaflow_log_probs(tmp_path):
    """What trainer.export_hf writes for a LoRA actor (MegatronRole.export_hf: export_hf_dir with the
    gathered PEFT adapter) is the frozen base plus an adapter peft loads to megaflow's log-probs."""
    import json

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = tmp_path / "hf"
    res = run_distributed(_export_rank, 2, str(out), timeout_s=600)[0]
    config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["lora_dropout"]) == (RANK, ALPHA, DROPOUT)
    assert sorted(config["target_modules"]) == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj",
                                                "up_proj", "v_proj"]
    base = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        plain = hf_reference(base, res["batch"])["log_probs"]
        tuned = hf_reference(PeftModel.from_pretrained(base, out / "adapter").eval(), res["batch"])["log_probs"]
    mask = res["batch"]["response_mask"].bool()
    assert (res["adapted"] - res["base"])[mask].abs().max() > 1e-2  # the adapters change the policy
    torch.testing.assert_close(tuned[mask], res["adapted"][mask], rtol=0, atol=1e-5)
    torch.testing.assert_close(plain[mask], res["base"][mask], rtol=0, atol=1e-5)
