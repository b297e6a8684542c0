"""Qwen3-MoE through megatron-core's MoE layers vs ``transformers`` on tiny random weights.

Per layout: HF -> megaflow load, full-vocabulary logits vs ``transformers`` (fp32, 1e-5),
megaflow -> HF export bit-exact (router, every expert, q/k norms). EP=1 runs in one
process; EP=2 (experts split over two gloo ranks) and PP=2 in a 2-rank world (slow).
A distributed checkpoint saved at EP=2 loads at EP=1 and at PP=2 (megatron-core reshards the
experts) with the same logits. Both router normalisations are covered (``norm_topk_prob`` true / false: megatron-core's
``moe_router_pre_softmax`` false / true).
"""
from __future__ import annotations

import pytest
import torch

import moe_testlib
from hf_tiny import VOCAB, hf_logits
from megatron_forward import megatron_logits
from megaflow.utils.launch import run_distributed
from moe_testlib import NUM_EXPERTS



def tiny_moe_config(norm_topk_prob: bool):
    return moe_testlib.tiny_moe_config(VOCAB, norm_topk_prob)


def tiny_moe_model(norm_topk_prob: bool):
    return moe_testlib.tiny_moe_model(VOCAB, norm_topk_prob)


def _load_forward_export(rank, world_size, hf_dir, input_ids, ep, pp):
    from transformers import AutoConfig

    from megaflow.megatron.model import build_gpt_model
    from megaflow.megatron.parallel import initialize_parallel
    from megaflow.models.hf_io import HFWeights
    from megaflow.models.weights import gather_hf_state_dict, load_hf_weights

    info = initialize_parallel(tp=1, pp=pp, ep=ep)
    config = AutoConfig.from_pretrained(hf_dir)
    model = build_gpt_model(config)
    local_experts = {n for n, _ in model.named_parameters() if ".local_experts." in n and "layers.0." in n}
    load_hf_weights(model, hf_dir, config, info)
    logits = megatron_logits(model, input_ids, info, VOCAB)
    exported = gather_hf_state_dict(model, config, info)
    mismatches = None
    if exported is not None:
        original = HFWeights(hf_dir)
        keys = set(original.keys())
        mismatches = sorted(keys ^ set(exported))
        mismatches += [k for k in sorted(keys & set(exported)) if not torch.equal(exported[k], original.get(k))]
    return logits, mismatches, len(local_experts) // 2


def _check(tmp_path, norm_topk_prob: bool, world_size: int, ep: int, pp: int) -> None:
    model = tiny_moe_model(norm_topk_prob)
    model.save_pretrained(tmp_path)
    input_ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(7))
    reference = hf_logits(model, input_ids)
    results = run_distributed(_load_forward_export, world_size, str(tmp_path), input_ids, ep, pp, timeout_s=600)
    logits = [r[0] for r in results if r[0] is not None]
    assert logits and all((x - reference).abs().max().item() < 1e-5 for x in logits)
    assert [r[1] for r in results if r[1] is not None] == [[]]  # one writer, nothing differs
    if pp == 1:  # every rank holds all layers; experts split over EP
        assert {r[2] for r in results} == {NUM_EXPERTS // ep}


def test_qwen3_moe_ep1_logits_and_round_trip(tmp_path):
    _check(tmp_path, norm_topk_prob=True, world_size=1, ep=1, pp=1)


@pytest.mark.slow
@pytest.mark.parametrize("ep, pp, norm", [(2, 1, True), (2, 1, False), (1, 2, False)],
                         ids=["ep2-norm", "ep2-nonorm", "pp2-nonorm"])
def test_qwen3_moe_two_ranks_logits_and_round_trip(tmp_path, ep, pp, norm):
    _check(tmp_path, norm_topk_prob=norm, world_size=2, ep=ep, pp=pp)


def test_mapping_keys_shapes_and_parameter_count_equal_the_saved_checkpoint(tmp_path):
    from megaflow.models.hf_io import HFWeights
    from megaflow.models.hf_mapping import ModelSpec, expected_hf_keys, hf_shape
    from megaflow.topology.model_spec import count_parameters

    model = tiny_moe_model(norm_topk_prob=False)
    model.save_pretrained(tmp_path)  # per-expert tensors on disk, like the published checkpoints
    spec = ModelSpec.from_hf_config(model.config)
    saved = HFWeights(tmp_path)
    assert sorted(expected_hf_keys(spec)) == sorted(saved.keys())
    assert all(hf_shape(k, spec) == tuple(saved.get(k).shape) for k in saved.keys())
    assert count_parameters(spec) == sum(p.numel() for p in model.parameters())
    assert (spec.num_experts, spec.moe_topk, spec.moe_ffn_hidden_size, spec.qk_norm) == (NUM_EXPERTS, 2, 32, True)


@pytest.mark.parametrize("field, value, message", [
    ("decoder_sparse_step", 2, "decoder_sparse_step"),
    ("mlp_only_layers", [0], "mlp_only_layers"),
    ("num_experts_per_tok", 5, "num_experts_per_tok"),
])
def test_unbuildable_moe_fields_are_refused_naming_the_field(field, value, message):
    from megaflow.config import ConfigError
    from megaflow.topology.model_spec import model_spec

    cfg = tiny_moe_config(True).to_dict()
    cfg[field] = value
    with pytest.raises(ConfigError) as err:
        model_spec(cfg)
    assert err.value.key == f"hf_config.{message}"


def test_tp2_and_grouped_gemm_with_experts_are_refused_on_cpu():
    from megaflow.megatron.model import transformer_config_from_hf

    cfg = tiny_moe_config(True).to_dict()
    assert transformer_config_from_hf(cfg).num_moe_experts == NUM_EXPERTS
    with pytest.raises(ValueError, match=r"tp=2 with a mixture-of-experts model .*sequence parallelism"):
        transformer_config_from_hf(cfg, tensor_model_parallel_size=2)
    with pytest.raises(ValueError, match="moe_grouped_gemm needs CUDA"):
        transformer_config_from_hf(cfg, moe_grouped_gemm=True)


def _save_at_ep2_load_elsewhere(rank, world_size, hf_dir, input_ids, ckpt_dir):
    import torch.distributed as dist
    from transformers import AutoConfig

    from megaflow.megatron.model import build_gpt_model
    from megaflow.megatron.parallel import destroy_parallel, initialize_parallel
    from megaflow.models.checkpoint import load_checkpoint, save_checkpoint
    from megaflow.models.weights import load_hf_weights

    config = AutoConfig.from_pretrained(hf_dir)
    info = initialize_parallel(tp=1, pp=1, ep=2)
    model = build_gpt_model(config)
    load_hf_weights(model, hf_dir, config, info)
    save_checkpoint(model, ckpt_dir, config, info)
    destroy_parallel()
    dist.barrier()
    logits = {}
    for ep, pp in ((1, 1), (1, 2)):  # experts resharded by megatron-core's dist checkpointing
        info = initialize_parallel(tp=1, pp=pp, ep=ep)
        fresh = build_gpt_model(config)  # a random model, then the EP=2 checkpoint
        load_checkpoint(fresh, ckpt_dir)
        logits[(ep, pp)] = megatron_logits(fresh, input_ids, info, VOCAB)
        destroy_parallel()
    return logits


@pytest.mark.slow
def test_checkpoint_saved_at_ep2_loads_at_ep1_and_pp2(tmp_path):
    model = tiny_moe_model(norm_topk_prob=True)
    model.save_pretrained(tmp_path / "hf")
    input_ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(7))
    reference = hf_logits(model, input_ids)
    per_rank = run_distributed(_save_at_ep2_load_elsewhere, 2, str(tmp_path / "hf"), input_ids,
                               str(tmp_path / "ckpt"), timeout_s=600)
    for layout in ((1, 1), (1, 2)):
        logits = [r[layout] for r in per_rank if r[layout] is not None]
        assert logits and all((x - reference).abs().max().item() < 1e-5 for x in logits), layout
