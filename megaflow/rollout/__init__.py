"""Rollout engines: vLLM colocated with the actor (production) and a ``transformers``
``generate`` reference (tests, baselines). Both take left-padded prompts in a
``DataProto`` and return the same verl-style fields (see :mod:`megaflow.rollout.batch`).

``VLLMRollout`` is imported lazily (importing vLLM takes seconds and sets process state).
"""
from megaflow.rollout.batch import assemble_rollout_batch, position_ids_for_rollout, prompt_token_lists
from megaflow.rollout.sampling import SamplingConfig, request_seeds

__all__ = ["SamplingConfig", "request_seeds", "assemble_rollout_batch", "position_ids_for_rollout",
           "prompt_token_lists", "HFRollout", "VLLMRollout", "VLLMRolloutConfig"]


def __getattr__(name: str):
    if name in ("VLLMRollout", "VLLMRolloutConfig"):
        from megaflow.rollout import vllm_rollout

        return getattr(vllm_rollout, name)
    if name == "HFRollout":
        from megaflow.rollout.hf_rollout import HFRollout

        return HFRollout
    raise AttributeError(f"module 'megaflow.rollout' has no attribute {name!r}")
