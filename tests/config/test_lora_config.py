"""The LoRA knobs (``actor.lora.*``, ``critic.lora.*``) at load: bad values are refused naming
the key before any process starts; a valid LoRA run needs no reference group; the planner
counts optimizer and gradient memory for the adapters only and no reference copy."""
from __future__ import annotations

import pytest

from megaflow.config import ConfigError
from megaflow.topology import load_run

RECIPE = "tiny_arith_grpo"
BASE = ("resources.use_gpu=false", "trainer.save_freq=-1")
ON = ("actor.lora.rank=8",)
SPLIT = ("resources.procs_per_node=4", "resources.pools={actor: {procs_per_node: 2}, gen: {procs_per_node: 2}}",
         "resources.placement.actor=actor", "resources.placement.ref=actor", "resources.placement.critic=actor",
         "resources.placement.reward_model=actor", "resources.placement.rollout=gen", "rollout.tp=1")
PPO = ("algorithm.adv_estimator=gae", "critic.enabled=true", "critic.tp=2", "critic.lora.rank=4")


def _refused(*overrides: str) -> ConfigError:
    with pytest.raises(ConfigError) as err:
        load_run(RECIPE, [*BASE, *overrides])
    return err.value


@pytest.mark.parametrize("overrides, key, says", [
    (("actor.lora.rank=-1",), "actor.lora.rank", "must be >= 0"),
    (("actor.lora.rank=200",), "actor.lora.rank", "exceeds linear_qkv's smaller dimension 128"),
    (("actor.lora.rank=8", "actor.lora.target_modules=[linear_fc2]", "actor.lora.rank=129"), "actor.lora.rank",
     "exceeds linear_fc2's smaller dimension 128"),
    (("actor.lora.target_modules=[linear_qkv,q_proj]",), "actor.lora.target_modules[1]", "linear_qkv"),
    (("actor.lora.rank=8", "actor.lora.target_modules=[]"), "actor.lora.target_modules", "is empty"),
    (("actor.lora.target_modules=[linear_qkv,linear_qkv]",), "actor.lora.target_modules", "twice"),
    (("actor.lora.alpha=0",), "actor.lora.alpha", "> 0"),
    (("actor.lora.dropout=1.0",), "actor.lora.dropout", "[0, 1)"),
    (("actor.lora.dropout=-0.1",), "actor.lora.dropout", "[0, 1)"),
    ((*ON, "actor.lora.sync=adapter", *SPLIT), "actor.lora.sync", "resources.placement.rollout"),
    ((*ON, "actor.lora.sync=adapter", "trainer.async_rollout=true"), "actor.lora.sync", "trainer.async_rollout"),
    ((*ON, "actor.lora.sync=adapter", "trainer.async_rollout=true", *SPLIT), "actor.lora.sync",
     "trainer.async_rollout"),
    ((*ON, "algorithm.use_kl_loss=true", "ref.enabled=true"), "ref.enabled", "adapters disabled"),
    ((*PPO, "critic.lora.rank=129"), "critic.lora.rank", "exceeds"),
    (("critic.lora.alpha=-1",), "critic.lora.alpha", "> 0"),
    (("critic.lora.dropout=2",), "critic.lora.dropout", "[0, 1)"),
    (("critic.lora.target_modules=[fc1]",), "critic.lora.target_modules[0]", "linear_fc1"),
    (("critic.lora.rank=2", "critic.lora.target_modules=[]"), "critic.lora.target_modules", "is empty"),
])
def test_bad_lora_values_are_refused_naming_the_key(overrides, key, says):
    err = _refused(*overrides)
    assert err.key == key, str(err)
    assert says in str(err), str(err)


def test_adapter_sync_loads_colocated_and_sizes_the_engine():
    """actor.lora.sync=adapter loads colocated (the refusal is lifted) and builds the engine with
    LoRA up to the adapter rank and 2 adapter slots (staleness 0 + 2); merged builds no LoRA into
    the engine, and 'adapter' without LoRA (rank 0) is refused as a key nothing reads; under split
    placement the same setting is refused (above)."""
    from megaflow.workers.rollout_host import adapter_engine_settings

    cfg = load_run(RECIPE, [*BASE, *ON, "actor.lora.sync=adapter"])
    assert cfg.actor.lora.sync == "adapter"
    assert adapter_engine_settings(cfg) == (8, 2)
    assert adapter_engine_settings(load_run(RECIPE, [*BASE, *ON])) == (0, 1)
    with pytest.raises(ConfigError, match=r"^actor\.lora\.sync: set to 'adapter', but actor\.lora\.rank=0 turns"):
        load_run(RECIPE, [*BASE, "actor.lora.sync=adapter"])
    assert load_run(RECIPE, [*BASE, *ON, *SPLIT]).actor.lora.sync == "merged"  # merged runs split


def test_lora_runs_save_checkpoints_and_export():
    """The refusals of trainer.save_freq and trainer.export_hf with LoRA are lifted (the checkpoint
    and the PEFT export are tested in tests/trainer/test_e2e_lora.py and tests/megatron/test_lora_export.py)."""
    cfg = load_run(RECIPE, [*BASE, *ON, "trainer.save_freq=5", "trainer.export_hf=true"])
    assert (cfg.trainer.save_freq, cfg.trainer.export_hf, cfg.actor.lora.rank) == (5, True, 8)
    assert load_run(RECIPE, [*BASE, *PPO, "trainer.save_freq=5"]).critic.lora.rank == 4


def test_lora_on_a_mixture_of_experts_model_is_refused_naming_the_rank():
    moe = ("model.hf_config.model_type=qwen3_moe", "model.hf_config.architectures=[Qwen3MoeForCausalLM]",
           "model.hf_config.num_experts=4", "model.hf_config.num_experts_per_tok=2",
           "model.hf_config.moe_intermediate_size=64", "model.hf_config.head_dim=32")
    err = _refused(*ON, *moe)
    assert err.key == "actor.lora.rank" and "mixture-of-experts" in str(err), str(err)


def test_lora_with_sequence_parallelism_is_refused():
    err = _refused(*ON, "actor.sequence_parallel=true")
    assert err.key == "actor.sequence_parallel" and "LoRA" in str(err), str(err)


def test_kl_with_lora_needs_no_reference_group():
    """actor.lora.rank > 0: algorithm.use_kl_loss runs without ref.enabled (the actor's base
    is the reference); without LoRA the same config is refused."""
    cfg = load_run(RECIPE, [*BASE, *ON, "algorithm.use_kl_loss=true"])
    assert cfg.actor.lora.rank == 8 and not cfg.ref.enabled
    err = _refused("algorithm.use_kl_loss=true")
    assert err.key == "ref.enabled"


def test_planner_counts_adapter_gradients_and_optimizer_state_only_and_no_reference():
    """The dry run with actor.lora.rank=8 on the default recipe (t=2, a 2-layer model of hidden 128,
    4 heads of 32, 2 KV heads, ffn 384): per rank, qkv A [8, 128] + B [256 / 2, 8], proj A [8, 128 / 2]
    + B [128, 8], fc1 A [8, 128] + B [768 / 2, 8], fc2 A [8, 384 / 2] + B [128, 8] per layer; fp32
    gradients (4 bytes) and Adam's two fp32 moments (8 bytes) for those only; no reference role."""
    from megaflow.dryrun import build_plan

    per_layer = 8 * ((128 + 128) + (64 + 128) + (128 + 384) + (192 + 128))
    adapters = 2 * per_layer
    full = build_plan(load_run(RECIPE, [*BASE, "algorithm.use_kl_loss=true", "ref.enabled=true", "ref.tp=2"]))
    lora = build_plan(load_run(RECIPE, [*BASE, *ON, "algorithm.use_kl_loss=true"]))

    def roles(plan):
        return {r.role: r for r in plan.roles}

    actor, base = roles(lora)["actor"].memory, roles(full)["actor"].memory
    assert actor.grads == adapters * 4 and actor.optimizer == adapters * 8
    assert actor.params == base.params + adapters * 4
    assert base.grads == base.params  # full training: fp32 gradient per parameter
    assert "ref" in roles(full) and "ref" not in roles(lora)


def test_planner_counts_the_critic_adapters_with_its_value_head_and_shards_the_optimizer_over_dp():
    """critic.lora.rank=4 at t=2: the critic's trained parameters are its adapters (rank 4, the
    per-rank shapes of the test above) plus its value head ``[1, 128]``; they alone get fp32
    gradients and Adam's two fp32 moments. actor.lora.rank=8 at t=1, dp=2 with the distributed
    optimizer: every adapter whole on each rank (qkv A [8, 128] + B [256, 8], proj A [8, 128] +
    B [128, 8], fc1 A [8, 128] + B [768, 8], fc2 A [8, 384] + B [128, 8]), gradients whole,
    the Adam moments split over the 2 DP ranks."""
    from megaflow.dryrun import build_plan

    critic_trained = 2 * 4 * ((128 + 128) + (64 + 128) + (128 + 384) + (192 + 128)) + 128
    plan = build_plan(load_run(RECIPE, [*BASE, *PPO]))
    critic = {r.role: r for r in plan.roles}["critic"].memory
    assert critic.grads == critic_trained * 4 and critic.optimizer == critic_trained * 8
    actor_adapters = 2 * 8 * ((128 + 256) + (128 + 128) + (128 + 768) + (384 + 128))
    plan = build_plan(load_run(RECIPE, [*BASE, *ON, "actor.tp=1", "actor.use_distributed_optimizer=true"]))
    actor = {r.role: r for r in plan.roles}["actor"]
    assert actor.parallel.dp == 2
    assert actor.memory.grads == actor_adapters * 4 and actor.memory.optimizer == actor_adapters * 8 / 2


def test_planner_counts_merged_lora_weights_as_generation_extra():
    """actor.lora.sync=merged: the engine's adapted weights are W + s B A computed into new
    tensors, so no training tensor of the adapted linears is aliased into the generation
    buffers. Adapted weights of the tiny model (2 layers: qkv 128 x 256, proj 128 x 128, fc1
    128 x 768, fc2 384 x 128, fp32): at t=2 -> t_g=1 the generation extra grows by their training
    half; at t=1 with the distributed optimizer (DDP's param buffer holds the adapters only, so the
    frozen rest aliases) it is exactly their full size. The adapter route sends the base unmerged:
    the extra of a run without LoRA."""
    from megaflow.dryrun import build_plan

    adapted = 2 * (128 * 256 + 128 * 128 + 128 * 768 + 384 * 128) * 4

    def extra(*overrides: str) -> float:
        return build_plan(load_run(RECIPE, [*BASE, *overrides])).rollout.memory.extra_weights

    assert extra(*ON) == extra() + adapted / 2
    assert extra(*ON, "actor.lora.sync=adapter") == extra()
    assert extra(*ON, "actor.tp=1", "actor.use_distributed_optimizer=true") == adapted
