"""Checkpoints portable between megatron-core's local layer spec and Transformer Engine's naming.

A checkpoint is written with one spec and loaded into a freshly initialised model of the
other (tests/models/te_named_spec.py builds TE's names and TE's attention _extra_state from
local modules, without TE); every tensor must arrive under the other spec's name
(``input_layernorm.weight`` <-> ``linear_qkv.layer_norm_weight``, ``pre_mlp_layernorm.weight``
<-> ``linear_fc1.layer_norm_weight``), bit for bit. The recorded ``layer_spec`` is checked:
an unknown one, or a model holding a tensor the checkpoint cannot provide, is refused
naming both specs. Before this change a local checkpoint did not load into the TE-named
model (megatron-core: the attention's _extra_state is missing from the checkpoint).
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from megaflow.utils.launch import run_distributed

LOCAL_TO_TE = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
               "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}


def _hf_config():
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=100, max_position_embeddings=32, tie_word_embeddings=False)
    cfg.architectures = ["LlamaForCausalLM"]
    return cfg


def _as_te_names(state: dict) -> dict:
    out = {}
    for name, tensor in state.items():
        for local, te in LOCAL_TO_TE.items():
            name = name.replace(local, te)
        out[name] = tensor
    return out


def _params(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _world(rank: int, world_size: int, root: str) -> dict:
    from te_named_spec import EXTRA_STATE, build_te_named_gpt

    from megaflow.megatron.model import build_gpt_model
    from megaflow.megatron.parallel import initialize_parallel
    from megaflow.models.checkpoint import CheckpointError, load_checkpoint, read_checkpoint_metadata, save_checkpoint

    info = initialize_parallel(tp=world_size, pp=1, seed=1)
    cfg = _hf_config()
    out = {}
    torch.manual_seed(1)
    local = build_gpt_model(cfg)
    save_checkpoint(local, f"{root}/local", cfg, info)
    torch.manual_seed(2)
    te = build_te_named_gpt(cfg)
    save_checkpoint(te, f"{root}/te", cfg, info)
    out["specs"] = (read_checkpoint_metadata(f"{root}/local")["layer_spec"],
                    read_checkpoint_metadata(f"{root}/te")["layer_spec"])
    # local -> TE naming
    torch.manual_seed(3)
    te_loaded = build_te_named_gpt(cfg)
    try:
        load_checkpoint(te_loaded, f"{root}/local")
        out["local_to_te"] = (_params(te_loaded), _as_te_names(_params(local)))
        attention = te_loaded.decoder.layers[0].self_attention.core_attention
        out["extra_state_kept"] = torch.equal(attention.get_extra_state(), EXTRA_STATE)
    except Exception as err:  # noqa: BLE001 - reported by the test
        out["local_to_te"] = repr(err)
    # TE naming -> local
    torch.manual_seed(4)
    local_loaded = build_gpt_model(cfg)
    load_checkpoint(local_loaded, f"{root}/te")
    out["te_to_local"] = (_as_te_names(_params(local_loaded)), _params(te))
    # a tensor no local checkpoint holds (a LayerNorm bias on the fused norms): refused, both specs named
    try:
        load_checkpoint(build_te_named_gpt(cfg, norm_bias=True), f"{root}/local")
        out["unmappable"] = None
    except CheckpointError as err:
        out["unmappable"] = str(err)
    except BaseException as err:  # noqa: BLE001 - not refused cleanly (torch's CheckpointException is a BaseException)
        out["unmappable"] = f"not refused: {type(err).__name__}"
    return out


def _unknown_spec(rank: int, world_size: int, root: str) -> str | None:
    from megaflow.megatron.model import build_gpt_model
    from megaflow.megatron.parallel import initialize_parallel
    from megaflow.models.checkpoint import CheckpointError, load_checkpoint

    initialize_parallel(tp=world_size, pp=1, seed=1)
    try:
        load_checkpoint(build_gpt_model(_hf_config()), f"{root}/odd")
    except CheckpointError as err:
        return str(err)
    return None


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt_specs")
    return root, run_distributed(_world, 2, str(root), timeout_s=600)


@pytest.mark.slow
def test_specs_are_recorded(results):
    for res in results[1]:
        assert res["specs"] == ("local", "transformer_engine")


@pytest.mark.slow
def test_local_checkpoint_loads_into_the_te_named_model(results):
    for rank, res in enumerate(results[1]):
        assert not isinstance(res["local_to_te"], str), res["local_to_te"]
        got, want = res["local_to_te"]
        assert sorted(got) == sorted(want) and any("layer_norm_weight" in n for n in got)
        for name in want:
            assert torch.equal(got[name], want[name]), (rank, name)
        assert res["extra_state_kept"], rank  # TE's own _extra_state: the one it was built with


@pytest.mark.slow
def test_te_named_checkpoint_loads_into_the_local_model(results):
    for rank, res in enumerate(results[1]):
        got, want = res["te_to_local"]
        assert sorted(got) == sorted(want)
        for name in want:
            assert torch.equal(got[name], want[name]), (rank, name)


@pytest.mark.slow
def test_an_unmappable_checkpoint_is_refused_naming_both_specs(results):
    for res in results[1]:
        assert res["unmappable"] is not None
        assert "layer_spec='local'" in res["unmappable"] and "layer_spec='transformer_engine'" in res["unmappable"]


@pytest.mark.slow
def test_an_unknown_recorded_spec_is_refused_naming_both(results):
    from megaflow.utils.atomic_dir import COMPLETE_MARKER, seal_directory

    root = results[0]
    shutil.copytree(root / "local", root / "odd")
    meta_path = root / "odd" / "megaflow_checkpoint.json"
    meta = json.loads(meta_path.read_text())
    meta["layer_spec"] = "fused_experimental"
    meta_path.write_text(json.dumps(meta))
    (root / "odd" / COMPLETE_MARKER).unlink()
    (root / "odd" / "MANIFEST.json").unlink()
    seal_directory(root / "odd", {"format": "megaflow-megatron"})
    for err in run_distributed(_unknown_spec, 2, str(root), timeout_s=300):
        assert err is not None and "layer_spec='fused_experimental'" in err and "layer_spec='local'" in err
