"""Cross-section validation and the derived sizes (values computed by hand here)."""
import json

import pytest

from megaflow.config import ConfigError
from megaflow.dryrun import build_plan, format_plan

from megaflow.topology import run_from_dict
from megaflow.topology.sizes import (
    cluster_requirements,
    enabled_roles,
    generation_sizes,
    num_training_steps,
    pools_in_use,
    role_parallel,
    train_batch_sizes,
)
from megaflow.launch.resources import launch_requirements


def test_tp_must_divide_the_attention_heads(tiny):
    with pytest.raises(ConfigError) as err:
        run_from_dict(tiny(actor={"tp": 3}, resources={"use_gpu": False, "procs_per_node": 3}))
    assert err.value.key == "actor.tp"
    assert "tp=3 must divide the model's num_attention_heads=4 (model.hf_config)" in str(err.value)


def test_tp_must_divide_the_kv_heads(tiny):
    # 4 query heads, 2 KV heads: tp=4 divides the heads but not the KV heads.
    with pytest.raises(ConfigError, match=r"^actor\.tp: tp=4 must divide the model's num_key_value_heads=2"):
        run_from_dict(tiny(actor={"tp": 4}, resources={"use_gpu": False, "procs_per_node": 4}))


def test_critic_tp_is_checked_against_the_same_model(tiny):
    with pytest.raises(ConfigError, match=r"^critic\.tp: tp=4 must divide the model's num_key_value_heads"):
        run_from_dict(tiny(algorithm={"adv_estimator": "gae"}, critic={"enabled": True, "tp": 4},
                           resources={"use_gpu": False, "procs_per_node": 4}))


def test_pp_must_divide_the_layers(tiny):
    tree = tiny(actor={"pp": 3}, resources={"use_gpu": False, "procs_per_node": 3})
    with pytest.raises(ConfigError, match=r"^actor\.pp: pp=3 must divide the model's num_hidden_layers=4"):
        run_from_dict(tree)


def test_world_size_must_be_tp_pp_cp_dp_exactly(tiny):
    with pytest.raises(ConfigError) as err:
        run_from_dict(tiny(actor={"tp": 2, "pp": 2}, resources={"use_gpu": False, "procs_per_node": 6}))
    msg = str(err.value)
    assert err.value.key == "actor.tp"
    assert "pool 'global' has 6 ranks" in msg and "not a multiple of tp*pp*cp = 2*2*1 = 4" in msg
    assert "(resources.pools.global: 1 nodes x 6)" in msg


def test_reward_model_architecture_is_its_own(tiny):
    rm = {"enabled": True, "tp": 2, "hf_config": {"model_type": "qwen2", "hidden_size": 96, "intermediate_size": 64,
                                                   "num_hidden_layers": 2, "num_attention_heads": 3,
                                                   "num_key_value_heads": 3, "vocab_size": 32}}
    with pytest.raises(ConfigError, match=r"^reward_model\.tp: .*num_attention_heads=3 \(reward_model\.hf_config\)"):
        run_from_dict(tiny(reward_model=rm))


def test_rollout_tp_must_divide_the_actor_tp(tiny):
    tree = tiny(actor={"tp": 2, "pp": 2}, rollout={"tp": 2, "pp": 1},
                resources={"use_gpu": False, "procs_per_node": 4})
    run_from_dict(tree)  # t_g = t, stages folded into replicas is valid
    tree["rollout"]["tp"] = 4
    with pytest.raises(ConfigError, match=r"^rollout\.tp: generation TP t_g=4 must divide actor\.tp=2"):
        run_from_dict(tree)
    tree["rollout"].update(tp=1, pp=3)
    with pytest.raises(ConfigError, match=r"^rollout\.pp: generation PP p_g=3 must divide actor\.pp=2"):
        run_from_dict(tree)
    tree["rollout"].update(tp=2, pp=2)  # divides, but the engine has no pipeline stages
    with pytest.raises(ConfigError, match=r"^rollout\.pp: pipeline-parallel generation is not supported: use 1"):
        run_from_dict(tree)


@pytest.mark.parametrize("actor, key, fragment", [
    ({"ppo_mini_batch_size": 5}, "actor.ppo_mini_batch_size",
     "data.train_batch_size=16 prompts per step do not split into mini-batches of 5 prompts"),
    ({"ppo_mini_batch_size": 1, "ppo_micro_batch_size_per_gpu": 3}, "actor.ppo_micro_batch_size_per_gpu",
     "4 samples per DP rank per mini-batch do not split into micro-batches of 3"),
])
def test_batch_sizes_must_divide(tiny, actor, key, fragment):
    # default rollout.n = 8; 2 ranks at tp=1 -> dp=2
    with pytest.raises(ConfigError) as err:
        run_from_dict(tiny(actor=actor))
    assert err.value.key == key and fragment in str(err.value)


def test_mini_batch_must_split_over_dp(tiny):
    tree = tiny(rollout={"n": 3}, actor={"ppo_mini_batch_size": 1, "ppo_micro_batch_size_per_gpu": 1})
    with pytest.raises(ConfigError, match=r"3 samples does not split over actor dp=2"):
        run_from_dict(tree)


def test_train_batch_sizes_by_hand(tiny):
    # 4 ranks, tp=2 -> dp=2; 16 prompts x n=8 = 128 samples; mini-batch 4 prompts = 32
    # samples = 16 per dp rank = 4 micro-batches of 4; 4 mini-batches x 2 epochs.
    cfg = run_from_dict(tiny(actor={"tp": 2, "ppo_mini_batch_size": 4, "ppo_micro_batch_size_per_gpu": 4,
                                    "ppo_epochs": 2},
                             data={"task": "arith", "train_batch_size": 16, "max_prompt_length": 10},
                             rollout={"response_length": 6}, resources={"use_gpu": False, "procs_per_node": 4}))
    sizes = train_batch_sizes(cfg, "actor")
    assert (sizes.num_samples, sizes.mini_batch_size, sizes.num_mini_batches) == (128, 32, 4)
    assert (sizes.mini_batch_size_per_dp_rank, sizes.num_micro_batches, sizes.num_optimizer_steps) == (16, 4, 8)
    assert sizes.max_seq_len == 16 and sizes.max_tokens_per_mini_batch == 32 * 16
    par = role_parallel(cfg, "actor")
    assert (par.world_size, par.tp, par.pp, par.dp) == (4, 2, 1, 2)


def test_generation_sizes_hybridflow_example(tiny):
    # 16 ranks, t=4 (needs 4 KV heads), p=2, d=2, t_g=2 -> d_g = (4*2)/(2*1) = 4 and
    # d * d_g = 8 replicas; 128 samples -> 16 per replica.
    hf = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
          "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 16}
    cfg = run_from_dict(tiny(model={"hf_config": hf, "tokenizer": "arith"}, actor={"tp": 4, "pp": 2},
                             rollout={"tp": 2}, resources={"use_gpu": False, "procs_per_node": 16}))
    gen = generation_sizes(cfg)
    assert (gen.tp, gen.pp, gen.micro_dp, gen.num_replicas, gen.samples_per_replica) == (2, 1, 4, 8, 16)


def test_pools_and_placement(tiny):
    res = {"use_gpu": False, "nodes": 2, "procs_per_node": 4,
           "pools": {"train": {"nodes": 1}, "score": {"nodes": 1, "procs_per_node": 2}},
           "placement": {"actor": "train", "ref": "train", "critic": "train", "reward_model": "score"}}
    rm = {"enabled": True, "tp": 2, "hf_config": tiny()["model"]["hf_config"]}
    cfg = run_from_dict(tiny(resources=res, reward_model=rm))
    assert role_parallel(cfg, "actor").world_size == 4 and role_parallel(cfg, "reward_model").dp == 1
    req = cluster_requirements(cfg)
    assert (req.nodes, req.procs_per_node, req.gpus_per_node, req.cpus_per_node) == (2, 4, 0, 4)
    res["pools"]["extra"] = {"nodes": 1}
    with pytest.raises(ConfigError, match=r"^resources\.pools\.extra: needs 1 nodes with 4 free ranks each; the "
                                          r"cluster \(resources\.nodes=2 x resources\.procs_per_node=4\) has only 0"):
        run_from_dict(tiny(resources=res, reward_model=rm))
    del res["pools"]["extra"]
    res["placement"]["critic"] = "scoring"
    with pytest.raises(ConfigError, match=r"^resources\.placement\.critic: unknown pool 'scoring'; pools: train, score"):
        run_from_dict(tiny(resources=res, reward_model=rm, critic={"enabled": True},
                           algorithm={"adv_estimator": "gae"}))


@pytest.mark.parametrize("role, enable", [
    ("ref", {"ref": {"enabled": True}, "algorithm": {"use_kl_loss": True}}),
    ("critic", {"critic": {"enabled": True}, "algorithm": {"adv_estimator": "gae"}}),
    ("reward_model", {"reward_model": {"enabled": True}}),
])
def test_a_disabled_roles_placement_is_not_read(tiny, role, enable):
    # Disabled (the defaults: GRPO without KL, no critic, no reward model), the role may name a
    # pool that does not exist; the run is laid out as if the entry were absent.
    res = {"use_gpu": False, "placement": {role: "nowhere"}}
    cfg = run_from_dict(tiny(resources=res))
    assert enabled_roles(cfg) == ("actor",)
    assert pools_in_use(cfg) == {"global": ("actor",)}
    assert cluster_requirements(cfg).nodes == 1
    assert [p.name for p in launch_requirements(cfg).pools] == ["global"]
    assert "nowhere" not in format_plan(build_plan(cfg))
    # Enabled, the same entry is refused at its dotted key, listing the pools there are.
    if role == "reward_model":
        enable["reward_model"]["hf_config"] = tiny()["model"]["hf_config"]
    with pytest.raises(ConfigError, match=rf"^resources\.placement\.{role}: unknown pool 'nowhere'; pools: global$"):
        run_from_dict(tiny(resources=res, **enable))


def test_an_idle_pool_named_only_by_a_disabled_role_is_not_needed(tiny):
    # The critic (disabled) names pool "spare" on node 1: neither the dry run's summary nor the
    # launch check asks for that node.
    res = {"use_gpu": False, "nodes": 2, "procs_per_node": 2,
           "pools": {"global": {"nodes": 1}, "spare": {"nodes": 1}}, "placement": {"critic": "spare"}}
    cfg = run_from_dict(tiny(resources=res))
    assert cluster_requirements(cfg).nodes == 1
    assert launch_requirements(cfg).num_nodes == 1
    assert pools_in_use(cfg) == {"global": ("actor",)}


def test_num_training_steps(tiny):
    cfg = run_from_dict(tiny(trainer={"total_epochs": 3}))
    assert num_training_steps(cfg, num_train_prompts=100) == 3 * (100 // 16)
    with pytest.raises(ConfigError, match="data.train_batch_size"):
        num_training_steps(cfg, num_train_prompts=10)
    assert num_training_steps(run_from_dict(tiny(trainer={"total_steps": 7})), 10) == 7


def test_model_path_config_json_is_read_and_cross_checked(tiny, tmp_path):
    hf = dict(tiny()["model"]["hf_config"])
    (tmp_path / "config.json").write_text(json.dumps(hf))
    cfg = run_from_dict(tiny(model={"path": str(tmp_path), "hf_config": None}))
    assert cfg.model.hf_config is None
    with pytest.raises(ConfigError, match=r"^model\.path: tp=3 must divide|^actor\.tp: tp=3 must divide .*\(model\.path\)"):
        run_from_dict(tiny(model={"path": str(tmp_path), "hf_config": None}, actor={"tp": 3},
                           resources={"use_gpu": False, "procs_per_node": 3}))
    wrong = dict(hf, num_hidden_layers=8)
    with pytest.raises(ConfigError, match=r"^model\.hf_config\.num_hidden_layers: 8 disagrees with 4 in "):
        run_from_dict(tiny(model={"path": str(tmp_path), "hf_config": wrong}))
    with pytest.raises(ConfigError, match=r"^model\.path: no config\.json in "):
        run_from_dict(tiny(model={"path": str(tmp_path / "missing"), "hf_config": None}))


@pytest.mark.parametrize("field, value, fragment", [
    ("model_type", "gpt2", "'gpt2' is not supported (supported: llama, qwen2, qwen3, qwen3_moe)"),
    ("num_local_experts", 8, "mixture-of-experts fields in a dense 'llama' config are not supported"),
    ("num_attention_heads", 0, "must be a positive int, got 0"),
    ("hidden_size", 66, "66 is not divisible by num_attention_heads=4 (set head_dim explicitly)"),
])
def test_unsupported_architectures_name_the_field(tiny, field, value, fragment):
    tree = tiny()
    tree["model"]["hf_config"][field] = value
    with pytest.raises(ConfigError) as err:
        run_from_dict(tree)
    assert err.value.key == f"model.hf_config.{field}" and fragment in str(err.value)
