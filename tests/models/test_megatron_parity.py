"""megaflow's Megatron model vs ``transformers`` on the same tiny random weights.

One 2-rank gloo world runs every layout in turn (TP=2; PP=2 with uneven stages; TP=1),
so the expensive process start-up is paid once. Per layout and model: HF -> megaflow load,
logits vs ``transformers`` (fp32, 1e-4), megaflow -> HF export bit-exact, and a
distributed checkpoint saved at TP=2 loaded back at PP=2 and TP=1 (another padded
vocabulary size) reproducing the logits; a critic / reward model's scalar head through
HF ``*ForSequenceClassification`` and back.
"""
from __future__ import annotations

import traceback

import pytest
import torch

from hf_tiny import VARIANTS, VOCAB, hf_logits, replicated_kv_config, tiny_model
from megatron_forward import megatron_logits
from megaflow.utils.launch import run_distributed

LAYOUTS = [(2, 1), (1, 2), (1, 1)]  # (tp, pp); (1, 1) runs as two data-parallel replicas
CKPT_VARIANTS = ("llama_gqa_untied", "qwen2_bias_untied")
CRITIC_VARIANT = "qwen2_bias_untied"
UNEVEN = {"num_layers_in_first_pipeline_stage": 1}  # PP=2: stages of 1 and 3 layers


def _build(hf_config, tp: int, pp: int, variant: str):
    from megaflow.megatron.model import build_gpt_model
    from megaflow.models.transforms import kv_replication_factor

    rep = kv_replication_factor(hf_config.num_key_value_heads, hf_config.num_attention_heads, tp)
    build_config = replicated_kv_config(hf_config, hf_config.num_key_value_heads * rep)
    overrides = UNEVEN if pp == 2 and variant == "llama_gqa_untied" else {}
    return build_gpt_model(build_config, **overrides)


def _exported_mismatches(model, hf_config, info, hf_dir) -> list[str] | None:
    from megaflow.models.hf_io import HFWeights
    from megaflow.models.weights import gather_hf_state_dict

    exported = gather_hf_state_dict(model, hf_config, info)
    if exported is None:
        return None
    original = HFWeights(hf_dir)
    keys = set(original.keys())
    bad = sorted(keys ^ set(exported))
    return bad + [k for k in sorted(keys & set(exported)) if not torch.equal(exported[k], original.get(k))]


def _critic_round_trip(hf_dir, cfg, info, out_dir) -> list[str] | None:
    """Critic from a causal LM (scalar head keeps its init) -> HF sequence-classification
    dir -> a reward model with another head init: everything, head included, survives."""
    import torch.distributed as dist
    from transformers import AutoConfig

    from megaflow.megatron.model import build_gpt_model
    from megaflow.models.export import export_hf_dir
    from megaflow.models.hf_io import HFWeights
    from megaflow.models.weights import gather_hf_state_dict, load_hf_weights

    critic = build_gpt_model(cfg, head="value", head_seed=0)
    load_hf_weights(critic, hf_dir, cfg, info)
    first = gather_hf_state_dict(critic, cfg, info)
    export_hf_dir(critic, cfg, info, out_dir)
    dist.barrier()
    seq_cls_cfg = AutoConfig.from_pretrained(out_dir)
    reward = build_gpt_model(seq_cls_cfg, head="reward", head_seed=5)
    load_hf_weights(reward, out_dir, seq_cls_cfg, info)
    second = gather_hf_state_dict(reward, seq_cls_cfg, info)
    if first is None:
        return None
    original = HFWeights(hf_dir)
    body = sorted(k for k in original.keys() if k != "lm_head.weight")
    bad = sorted(set(first) ^ set(body + ["score.weight"]))
    bad += [k for k in body if not torch.equal(first[k], original.get(k))]
    bad += [k for k in first if not torch.equal(first[k], second[k])]
    return bad + list(seq_cls_cfg.architectures if seq_cls_cfg.architectures != [
        "Qwen2ForSequenceClassification"] else [])


def _parity_world(rank, world_size, hf_dirs, input_ids, ckpt_root):
    from megaflow.megatron.parallel import destroy_parallel, initialize_parallel

    results = {}
    for tp, pp in LAYOUTS:
        info = initialize_parallel(tp=tp, pp=pp)
        for variant, hf_dir in hf_dirs.items():
            try:  # a build/load error hits every rank at the same point: record it, go on
                results.update(_one_case(info, tp, pp, variant, hf_dir, input_ids, ckpt_root))
            except Exception:  # noqa: BLE001 - reported by this case's tests
                results[(tp, pp, variant, "error")] = traceback.format_exc()
        destroy_parallel()
    return results


def _one_case(info, tp, pp, variant, hf_dir, input_ids, ckpt_root) -> dict:
    from transformers import AutoConfig

    from megaflow.models.checkpoint import load_checkpoint, save_checkpoint
    from megaflow.models.weights import load_hf_weights

    out = {}
    cfg = AutoConfig.from_pretrained(hf_dir)
    model = _build(cfg, tp, pp, variant)
    load_hf_weights(model, hf_dir, cfg, info)
    out[(tp, pp, variant, "hf")] = megatron_logits(model, input_ids, info, VOCAB)
    out[(tp, pp, variant, "export")] = _exported_mismatches(model, cfg, info, hf_dir)
    if variant in CKPT_VARIANTS and (tp, pp) == LAYOUTS[0]:
        save_checkpoint(model, f"{ckpt_root}/{variant}", cfg, info)
    elif variant in CKPT_VARIANTS:  # a fresh random model, then the TP=2 checkpoint
        fresh = _build(cfg, tp, pp, variant)
        load_checkpoint(fresh, f"{ckpt_root}/{variant}")
        out[(tp, pp, variant, "ckpt")] = megatron_logits(fresh, input_ids, info, VOCAB)
    if variant == CRITIC_VARIANT and pp == 2:
        out[(tp, pp, variant, "critic")] = _critic_round_trip(hf_dir, cfg, info,
                                                              f"{ckpt_root}/critic_{tp}_{pp}")
    return out


def _result(results: dict, tp: int, pp: int, variant: str, kind: str):
    error = results.get((tp, pp, variant, "error"))
    assert error is None, f"tp={tp} pp={pp} {variant} failed on a rank:\n{error}"
    return results[(tp, pp, variant, kind)]


@pytest.fixture(scope="module")
def parity_results(tiny_hf_dirs, tmp_path_factory):
    input_ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(7))
    references = {v: hf_logits(tiny_model(v, seed=i), input_ids) for i, v in enumerate(VARIANTS)}
    per_rank = run_distributed(_parity_world, 2, {k: str(v) for k, v in tiny_hf_dirs.items()},
                               input_ids, str(tmp_path_factory.mktemp("ckpt")), timeout_s=600)
    merged: dict = {}
    for result in per_rank:
        for key, value in result.items():
            if value is not None:
                merged.setdefault(key, value)
    return references, merged


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp", LAYOUTS)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_equal_transformers(parity_results, variant, tp, pp):
    references, results = parity_results
    logits = _result(results, tp, pp, variant, "hf")
    assert logits.shape == references[variant].shape
    assert (logits - references[variant]).abs().max().item() < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp", LAYOUTS)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_hf_to_megatron_to_hf_is_bit_exact(parity_results, variant, tp, pp):
    _, results = parity_results
    assert _result(results, tp, pp, variant, "export") == []


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp", LAYOUTS[1:])
@pytest.mark.parametrize("variant", CKPT_VARIANTS)
def test_checkpoint_saved_at_tp2_loads_at_other_layouts(parity_results, variant, tp, pp):
    references, results = parity_results
    logits = _result(results, tp, pp, variant, "ckpt")
    assert (logits - references[variant]).abs().max().item() < 1e-4


@pytest.mark.slow
def test_critic_and_reward_heads_round_trip_at_pp2(parity_results):
    _, results = parity_results
    assert _result(results, 1, 2, CRITIC_VARIANT, "critic") == []
