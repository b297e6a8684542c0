"""Megatron-core engine: parallel state, model builder, log-probs, training engine.

Submodules: :mod:`~megaflow.megatron.cpu_compat` (CPU accommodations),
:mod:`~megaflow.megatron.parallel` (the only megaflow module that touches Megatron's global
parallel state; megatron-core's own code reads it too),
:mod:`~megaflow.megatron.model` (HF config -> GPTModel), :mod:`~megaflow.megatron.logprobs`
(vocab-parallel log-probs and entropy), :mod:`~megaflow.megatron.engine` (forward/backward
through Megatron's pipeline schedules, optimizer, LR schedule).
"""
