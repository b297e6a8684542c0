"""The trainer's side of the adapter-only sync: a TP = 2 x PP = 2 actor's adapter pieces, named with local layer
numbers on each stage, gathered into what peft_io exports exactly like the full adapter (4 gloo ranks)."""
from __future__ import annotations

import pytest
import torch
from lora_testlib import random_adapter, spec_of

from megaflow.models.hf_mapping import ShardLayout
from megaflow.utils.launch import run_distributed

pytestmark = pytest.mark.slow

TP, PP, RANK, ALPHA, LAYERS = 2, 2, 4, 8.0, 4


class _Stage(torch.nn.Module):
    """A pipeline stage shaped like megatron-core's GPTModel where the names matter: ``decoder.layers.<local i>``
    with ``layer_number`` = global index + 1, adapters at the contract's module paths."""

    def __init__(self, piece: dict[str, torch.Tensor], global_layers: list[int]) -> None:
        super().__init__()
        self.decoder = torch.nn.Module()
        self.decoder.layers = torch.nn.ModuleList()
        for layer in global_layers:
            block = torch.nn.Module()
            block.layer_number = layer + 1
            self.decoder.layers.append(block)
            prefix = f"decoder.layers.{layer}."
            for name, tensor in piece.items():
                if name.startswith(prefix):
                    module = block
                    *path, leaf = name[len(prefix):].split(".")
                    for part in path:
                        if not hasattr(module, part):
                            module.add_module(part, torch.nn.Module())
                        module = getattr(module, part)
                    module.register_parameter(leaf, torch.nn.Parameter(tensor.clone()))


def _rank(rank, world_size, pieces, spec):
    import torch.distributed as dist

    from megaflow.rollout.lora_sync import gather_adapter_pieces, local_adapter_tensors

    # rank = pp_rank * TP + tp_rank
    tp_groups = [dist.new_group([p * TP + t for t in range(TP)]) for p in range(PP)]
    pp_groups = [dist.new_group([p * TP + t for p in range(PP)]) for t in range(TP)]
    pp_rank, tp_rank = divmod(rank, TP)
    per_stage = LAYERS // PP
    stage = _Stage(pieces[tp_rank], list(range(pp_rank * per_stage, (pp_rank + 1) * per_stage)))
    local = local_adapter_tensors([stage])
    return sorted(local), gather_adapter_pieces(local, tp_group=tp_groups[pp_rank], pp_group=pp_groups[tp_rank])


def test_tp_pp_pieces_gather_into_the_full_adapter(tmp_path):
    from rollout_testlib import build_tiny_llama, load_hf

    from megaflow.models.peft_io import megatron_to_peft, peft_to_megatron

    model = load_hf(build_tiny_llama(str(tmp_path), num_hidden_layers=LAYERS))
    spec = spec_of(model)
    full = megatron_to_peft(random_adapter(model, RANK, seed=2), spec, alpha=ALPHA)
    pieces = [peft_to_megatron(full, spec, ShardLayout(tp_size=TP, tp_rank=t)) for t in range(TP)]
    results = run_distributed(_rank, TP * PP, pieces, spec, timeout_s=300)
    local_names = results[TP][0]  # pp rank 1, tp rank 0: the second stage's layers, named globally
    assert {n.split(".")[2] for n in local_names} == {"2", "3"}
    for _, gathered in results:
        assert len(gathered) == TP
        again = megatron_to_peft(gathered, spec, alpha=ALPHA)
        assert again.tensors.keys() == full.tensors.keys()
        assert all(torch.equal(again.tensors[k], v) for k, v in full.tensors.items())
