"""HF <-> megatron-core model weights: the mapping table, weight loading/export and checkpoints.

* :mod:`~megaflow.models.hf_mapping`: the declarative name/transform table (Llama, Qwen2).
* :mod:`~megaflow.models.transforms`: pure tensor transforms (fused QKV per KV group,
  gate/up, TP shard/gather, vocab padding, KV-head replication, Megatron -> vLLM QKV).
* :mod:`~megaflow.models.weights`: fill a built GPTModel from HF weights; gather it back.
* :mod:`~megaflow.models.checkpoint`: megatron-core distributed checkpoints + metadata.
* :mod:`~megaflow.models.export`: write an HF directory from a built model.
* :mod:`~megaflow.models.convert`: the conversion tools' logic.
* :mod:`~megaflow.models.smollm2`: the real-model fixture (GGUF -> HF cache).
"""
from megaflow.models.checkpoint import load_checkpoint, read_checkpoint_metadata, save_checkpoint
from megaflow.models.export import export_hf_dir
from megaflow.models.hf_io import CheckpointError, HFWeights
from megaflow.models.hf_mapping import ModelSpec, UnsupportedModelError
from megaflow.models.smollm2 import ensure_smollm2
from megaflow.models.weights import gather_hf_state_dict, iter_hf_tensors, load_hf_weights

__all__ = ["load_hf_weights", "gather_hf_state_dict", "iter_hf_tensors", "save_checkpoint",
           "load_checkpoint", "read_checkpoint_metadata", "export_hf_dir", "ensure_smollm2",
           "ModelSpec", "UnsupportedModelError", "CheckpointError", "HFWeights"]
