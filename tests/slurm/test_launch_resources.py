"""Cluster requirements computed from recipes, and the matching against joined nodes."""
import pytest

from megaflow.launch.resources import NodeResources, launch_requirements, unmet
from megaflow.topology import cluster_requirements, load_run

# Llama-3-70B PPO with one pool per model group: actor(+rollout) on 4 nodes, critic on 2,
# reference and reward model colocated on the last 2 (TP=8 x PP=2 for the 16-rank pools).
SPLIT_70B = [
    "resources.pools={actor_rollout: {nodes: 4}, critic: {nodes: 2}, ref_rm: {nodes: 2}}",
    "resources.placement={actor: actor_rollout, critic: critic, ref: ref_rm, reward_model: ref_rm}",
    "critic.pp=2", "ref.pp=2", "reward_model.pp=2",
]


def node(ip, cpus, gpus=0, alive=True):
    return NodeResources(node_id=f"id-{ip}", ip=ip, hostname=f"host-{ip}", cpus=cpus, gpus=gpus, alive=alive)


def test_llama70b_needs_eight_full_gpu_nodes():
    req = launch_requirements(load_run("llama70b_ppo"))
    # 8 nodes x 8 ranks; a rank is one GPU + resources.num_cpus_per_proc=8 CPUs.
    assert req.num_nodes == 8 and req.uniform
    assert (req.gpus_per_node, req.cpus_per_node) == (8, 8 * 8)
    assert (req.total_gpus, req.total_cpus) == (8 * 8, 8 * 8 * 8)
    (pool,) = req.pools
    assert pool.name == "global" and pool.roles == ("actor", "ref", "critic", "reward_model")
    assert pool.nodes == tuple(range(8)) and pool.world_size == 64
    assert req.describe() == "8 nodes, each with 8 GPUs and 64 CPUs (64 GPUs and 512 CPUs in all)"
    # G1's summary of the same config agrees.
    summary = cluster_requirements(load_run("llama70b_ppo"))
    assert (summary.nodes, summary.gpus_per_node, summary.cpus_per_node) == (8, 8, 64)


def test_llama70b_split_pools_lie_on_disjoint_nodes():
    req = launch_requirements(load_run("llama70b_ppo", SPLIT_70B))
    pools = {p.name: p for p in req.pools}
    assert pools["actor_rollout"].nodes == (0, 1, 2, 3) and pools["actor_rollout"].roles == ("actor",)
    assert pools["critic"].nodes == (4, 5) and pools["critic"].roles == ("critic",)
    assert pools["ref_rm"].nodes == (6, 7) and pools["ref_rm"].roles == ("ref", "reward_model")
    assert [p.total_gpus for p in req.pools] == [32, 16, 16]
    assert req.num_nodes == 8 and req.uniform and req.total_gpus == 64
    assert "pool 'ref_rm' (ref, reward_model): 2 nodes x 8 ranks, each rank 1 GPU + 8 CPUs" in req.describe_pools()


def test_tiny_cpu_recipe_needs_one_node_of_two_cpus():
    req = launch_requirements(load_run("tiny_arith_grpo"))
    assert not req.use_gpu and req.num_nodes == 1
    assert (req.cpus_per_node, req.gpus_per_node, req.total_cpus) == (2, 0, 2)
    assert req.pools[0].roles == ("actor",)
    assert req.describe() == "1 node, each with 2 CPUs (2 CPUs in all)"
    more = launch_requirements(load_run("tiny_arith_grpo", ["resources.num_cpus_per_proc=3"]))
    assert more.cpus_per_node == 2 * 3


def test_a_split_rollout_pool_counts_its_ranks():
    # Actor (and the other roles) on a 2-rank pool, the vLLM engines on their own 2-rank pool:
    # 4 ranks of 1 CPU each on the one node, the rollout pool listed with its role.
    split = ["resources.procs_per_node=4", "resources.pools.train.procs_per_node=2",
             "resources.pools.gen.procs_per_node=2", "resources.placement.actor=train",
             "resources.placement.ref=train", "resources.placement.critic=train",
             "resources.placement.reward_model=train", "resources.placement.rollout=gen"]
    req = launch_requirements(load_run("tiny_arith_grpo", split))
    pools = {p.name: p for p in req.pools}
    assert set(pools) == {"train", "gen"} and pools["gen"].roles == ("rollout",)
    assert (req.num_nodes, req.cpus_per_node, req.total_cpus) == (1, 2 + 2, 4)


def test_pools_sharing_a_node_add_up():
    # Pool a: 2 nodes x 2 ranks (actor, TP=2, DP=2); pool b: 1 node x 2 ranks (ref). First fit puts
    # b on node 0 next to a, so node 0 hosts 4 ranks and node 1 hosts 2.
    cfg = load_run("tiny_arith_grpo", [
        "resources.nodes=2", "resources.procs_per_node=4",
        "resources.pools={a: {nodes: 2, procs_per_node: 2}, b: {nodes: 1, procs_per_node: 2}}",
        "resources.placement={actor: a, ref: b, critic: a, reward_model: a}", "ref.enabled=true", "ref.tp=2"])
    req = launch_requirements(cfg)
    assert [(n.index, n.cpus, n.pools) for n in req.nodes] == [(0, 4, ("a", "b")), (1, 2, ("a",))]
    assert not req.uniform and req.total_cpus == 6
    assert unmet(req, [node("10.0.0.2", 2), node("10.0.0.1", 4)]) == []
    missing = unmet(req, [node("10.0.0.1", 2), node("10.0.0.2", 2)])
    assert missing[0] == "1 more node with 4 CPUs" and "enough nodes joined" in missing[1]


def test_unmet_counts_missing_and_dead_nodes():
    req = launch_requirements(load_run("llama70b_ppo"))
    full = [node(f"10.0.0.{i}", 64, 8) for i in range(8)]
    assert unmet(req, full) == []
    assert unmet(req, full[:7]) == ["1 more node with 8 GPUs and 64 CPUs"]
    # A dead node does not count; a node with fewer GPUs cannot host 8 ranks.
    assert unmet(req, full[:7] + [node("10.0.0.9", 64, 8, alive=False)]) == ["1 more node with 8 GPUs and 64 CPUs"]
    short = unmet(req, full[:7] + [node("10.0.0.8", 64, 4)])
    assert short[0] == "1 more node with 8 GPUs and 64 CPUs" and "enough nodes joined" in short[1]
    assert unmet(req, []) == ["8 more nodes with 8 GPUs and 64 CPUs"]
    # Extra nodes are fine.
    assert unmet(req, full + [node("10.0.0.99", 2)]) == []


def test_node_resources_from_ray_entry():
    entry = {"NodeID": "abc", "Alive": True, "NodeManagerAddress": "10.1.2.3", "NodeManagerHostname": "gpu-3",
             "Resources": {"CPU": 64.0, "GPU": 8.0, "memory": 1e12}}
    n = NodeResources.from_ray(entry)
    assert (n.node_id, n.ip, n.hostname, n.cpus, n.gpus, n.alive) == ("abc", "10.1.2.3", "gpu-3", 64.0, 8.0, True)
    assert n.describe() == "10.1.2.3 (gpu-3): 8 GPUs, 64 CPUs"
    assert NodeResources.from_ray({"NodeID": "x", "Alive": False, "Resources": {}}).cpus == 0.0


@pytest.mark.parametrize("recipe", ["llama3_8b_ppo", "qwen25_7b_gsm8k_grpo", "smollm2_gsm8k_grpo"])
def test_single_node_recipes(recipe):
    cfg = load_run(recipe)
    req = launch_requirements(cfg)
    res = cfg.resources
    assert req.num_nodes == 1
    assert req.cpus_per_node == res.procs_per_node * res.num_cpus_per_proc
    assert req.gpus_per_node == (res.procs_per_node if res.use_gpu else 0)
