"""The planner's GPU runtime headroom, host copies per node, warnings, and the work a dry run does
(issue 31 item 3). The expected numbers are written out by hand for Llama-3-70B (llama70b_ppo)."""
import sys
from pathlib import Path

import pytest

from megaflow.dryrun import build_plan, format_plan
from megaflow.dryrun.memory import GIB, pipeline_bubble, runtime_headroom_bytes
from megaflow.topology import load_run

RECIPES = sorted(p.stem for p in (Path(__file__).resolve().parents[2] / "recipes").glob("*.yaml"))

# Llama-3-70B by hand: h=8192, f=28672, 64 heads / 8 KV heads of 128, 80 layers, vocab 128256.
H, F, LAYERS = 8192, 28672, 80
ATTENTION = H * H + 2 * H * 1024 + H * H          # q, k+v, o
MLP = 3 * H * F                                    # gate, up, down
PADDED_VOCAB = 129024                              # 128256 rounded up to a multiple of 128 * tp (tp=8)


def _stage_params(tp: int, layers: int) -> int:
    """Parameters of ``layers`` layers on one TP rank: the linears split, the two norms whole."""
    return layers * ((ATTENTION + MLP) // tp + 2 * H)


# tp=8, pp=4: 20 layers per stage; the lm stage adds the final norm and its vocab shard, a
# value-head model's largest stage is the first (embedding shard; its last adds only norm + 1 x h)
LM_STAGE = _stage_params(8, 20) + H + PADDED_VOCAB * H // 8
VALUE_STAGE = _stage_params(8, 20) + PADDED_VOCAB * H // 8
# generation shard t_g=4, p_g=1: every layer, embedding + lm_head in the training padding, final norm
GEN_SHARD = _stage_params(4, LAYERS) + 2 * PADDED_VOCAB * H // 4 + H


def _parts(phase) -> dict[str, float]:
    return dict(phase.parts)


def test_runtime_headroom_by_hand():
    plan = build_plan(load_run("llama70b_ppo"))
    pool = plan.pools[0]
    # tp=8 pp=4 dp=2 and t_g=4, d_g=8: the groups of size > 1 a rank's process creates
    assert pool.communicators == ("world", "tp", "dp", "pp", "model-parallel", "embedding", "generation tp",
                                  "micro-dp")
    for phase in pool.phases:
        parts = _parts(phase)
        tensors = sum(b for name, b in parts.items() if name != "runtime headroom")
        expected = 1.0 * GIB + 8 * 0.65 * GIB + 0.05 * tensors
        assert parts["runtime headroom"] == pytest.approx(expected)
        assert phase.total == pytest.approx(tensors + expected)
    text = format_plan(plan)
    assert "runtime headroom counts 8 NCCL communicator(s): world, tp, dp, pp, model-parallel" in text
    # a fixed headroom replaces the estimate in every phase
    fixed = build_plan(load_run("llama70b_ppo", ["resources.gpu_runtime_headroom_gib=3"]))
    for before, after in zip(pool.phases, fixed.pools[0].phases):
        tensors = before.total - _parts(before)["runtime headroom"]
        assert after.total == pytest.approx(tensors + 3 * GIB)
    assert runtime_headroom_bytes(communicators=5, tensor_bytes=GIB, fixed_gib=0.0) == 0.0


def test_gpu_runtime_headroom_gib_decides_whether_a_layout_fits():
    # generation holds the largest tensors, 4.23 + 32.9 + 15.1 = 52.2 GiB: with 20 GiB of
    # headroom it fits 80 GiB, with 30 GiB it does not (and the critic update, 45.9 GiB, still does)
    assert build_plan(load_run("llama70b_ppo", ["resources.gpu_runtime_headroom_gib=20"])).fits
    plan = build_plan(load_run("llama70b_ppo", ["resources.gpu_runtime_headroom_gib=30"]))
    assert [p.split(";")[0] for p in plan.problems] == [
        "pool 'global', generate: 82.2 GiB per GPU > resources.gpu_memory_gib=80"]


def test_cpu_plans_have_no_runtime_headroom_or_host_copies():
    plan = build_plan(load_run("tiny_arith_grpo", ["resources.gpu_runtime_headroom_gib=5"]))
    assert all("runtime headroom" not in _parts(ph) for pool in plan.pools for ph in pool.phases)
    assert plan.host_per_node == () and "host memory per node" not in format_plan(plan)


def test_host_copies_per_node_on_gpu_by_hand():
    level1 = ["rollout.sleep_level=1"]
    plan = build_plan(load_run("llama70b_ppo", level1))
    assert plan.role("ref").memory.params == 2 * LM_STAGE  # the hand count matches the planner's stage
    # per rank: ref, critic and reward-model params offloaded (pinned), vLLM asleep at level 1
    # keeps its generation shard (pinned); actor and critic Adam state + fp32 main params
    # (12 bytes per param, sharded over dp=2) go to pageable memory; offloaded grads are freed
    pinned = 2 * (LM_STAGE + 2 * VALUE_STAGE + GEN_SHARD)
    pageable = 12 * (LM_STAGE + VALUE_STAGE) / 2
    assert plan.host_per_node == tuple((node, 8 * pinned, pytest.approx(8 * pageable)) for node in range(8))
    # the default (sleep_level null: 2 when colocated) discards the engine's weights: no pinned shard
    default = build_plan(load_run("llama70b_ppo"))
    assert default.host_per_node == tuple((node, 8 * (pinned - 2 * GEN_SHARD), pytest.approx(8 * pageable))
                                          for node in range(8))
    assert (8 * (pinned + pageable)) / GIB == pytest.approx(567.5, abs=0.1)  # issue 31: "about 570 GiB per node"
    text = format_plan(plan)
    assert "nodes 0-7: 567.5 GiB each (364.4 GiB pinned, 203.1 GiB pageable)" in text
    assert "note: GPU run: set resources.cpu_memory_gib to check the host copies per node" in text
    # resources.cpu_memory_gib checks them on GPU runs too
    small = build_plan(load_run("llama70b_ppo", [*level1, "resources.cpu_memory_gib=512"]))
    assert [p for p in small.problems if p.startswith("node ")] == [
        f"node {n}: 567.5 GiB of host copies (364.4 pinned, 203.1 pageable) > resources.cpu_memory_gib=512; "
        f"turn off some <role>.param_offload/optimizer_offload or use more nodes" for n in range(8)]
    assert build_plan(load_run("llama70b_ppo", [*level1, "resources.cpu_memory_gib=1024"])).fits


def test_pipeline_bubble_formula():
    assert pipeline_bubble(4, 2) == pytest.approx(3 / 5)
    assert pipeline_bubble(4, 32) == pytest.approx(3 / 35)
    assert pipeline_bubble(4, 8, vpp=2) == pytest.approx(3 / 19)
    assert pipeline_bubble(1, 1) == 0.0
    with pytest.raises(ValueError, match="micro_batches"):
        pipeline_bubble(2, 0)


def test_degenerate_layouts_warn_without_failing():
    # 1,024 GPUs: dp = 1024 / (tp 8 * pp 4) = 32, a mini-batch of 128 is 4 samples per dp rank,
    # 2 micro-batches of 2 -> bubble 3/5; 512 samples over 32 * d_g 8 = 256 replicas -> 2 each
    plan = build_plan(load_run("llama70b_ppo", ["resources.nodes=128"]))
    assert plan.fits and plan.role("actor").update_micro_batches == 2
    assert [w.split(":")[0] for w in plan.warnings] == ["actor update", "critic update", "rollout"]
    assert "pipeline bubble 60% of the update" in plan.warnings[0] and "pp=4, m=2" in plan.warnings[0]
    assert plan.warnings[2].startswith("rollout: 2 sample(s) per generation replica per step < "
                                       "resources.warn_samples_per_replica=8")
    assert "warning: actor update: pipeline bubble 60%" in format_plan(plan)
    # the shipped layout: m = 64 / 2 = 32 micro-batches (bubble 3/35) and 512 / 16 = 32 samples per replica
    assert build_plan(load_run("llama70b_ppo")).warnings == ()


def test_warning_thresholds_are_the_resources_keys():
    plan = build_plan(load_run("llama70b_ppo", ["resources.warn_pipeline_bubble=0.08",
                                                "resources.warn_samples_per_replica=33"]))
    assert len(plan.warnings) == 3 and "pipeline bubble 9% " in plan.warnings[0]  # 3/35 > 0.08
    assert plan.warnings[2].startswith("rollout: 32 sample(s) per generation replica per step < "
                                       "resources.warn_samples_per_replica=33")
    assert build_plan(load_run("llama70b_ppo", ["resources.warn_pipeline_bubble=0.09"])).warnings == ()


@pytest.mark.parametrize("key, value, message", [
    ("warn_pipeline_bubble", "1.5", "must lie in [0, 1]"),
    ("gpu_runtime_headroom_gib", "-1", "must be >= 0"),
    ("warn_samples_per_replica", "0", "must be > 0"),
])
def test_planner_knobs_are_range_checked(key, value, message):
    with pytest.raises(ValueError, match=rf"resources\.{key}.*{message.replace('[', '.').replace(']', '.')}"):
        load_run("llama70b_ppo", [f"resources.{key}={value}"])


def _calls_while_planning(cfg) -> int:
    """Python and C function calls made by ``build_plan`` + ``format_plan`` (``sys.setprofile``)."""
    calls = 0

    def count(frame, event, arg):
        nonlocal calls
        calls += event in ("call", "c_call")

    sys.setprofile(count)
    try:
        format_plan(build_plan(cfg))
    finally:
        sys.setprofile(None)
    return calls


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_shipped_recipe_plans_with_bounded_work(recipe):
    # Under 1 s of planning, counted rather than timed: even at a pessimistic 5 us per call on
    # a slow, loaded CPU, 100,000 calls take 0.5 s. (Measured: 700 calls for the tiny recipes,
    # about 8,000 for llama70b_ppo's 64 GPUs.)
    assert _calls_while_planning(load_run(recipe)) < 100_000


def test_planning_work_grows_no_faster_than_the_cluster():
    # 16 x the GPUs (64 -> 1,024): the groups grow linearly with the ranks, so must the work
    small = _calls_while_planning(load_run("llama70b_ppo"))
    large = _calls_while_planning(load_run("llama70b_ppo", ["resources.nodes=128"]))
    assert large < 16 * small


def test_split_placement_counts_the_engines_communicators_and_their_sleeping_weights():
    from test_split_plan import SPLIT

    plan = build_plan(load_run("tiny_arith_grpo", SPLIT + ["resources.use_gpu=true"]))
    actor_pool, gen_pool = plan.pools
    assert actor_pool.communicators == ("world", "tp", "model-parallel", "weight broadcast")  # tp=2, pp=dp=1
    assert gen_pool.communicators == ("world", "generation tp", "weight broadcast")
    # the engines sleep at level 1: each rank pins its generation shard. tiny_arith_grpo at t_g=2,
    # fp32: per layer (q, k, v, o 128 x 256 + 2 x 128 x 64 + 128 x 128 = 49152, MLP 3 x 128 x 384) / 2 + two
    # norms; embedding and lm_head in the training padding (vocab 16 -> 256 at tp=2) / 2; the final norm
    shard = 4 * (2 * ((49152 + 3 * 128 * 384) // 2 + 2 * 128) + 2 * 256 * 128 // 2 + 128)
    assert plan.rollout.memory.weights == shard
    assert gen_pool.host.pinned == shard and gen_pool.host.pageable == 0
    assert plan.host_per_node == ((0, 4 * shard + 2 * actor_pool.host.pinned, 2 * actor_pool.host.pageable),)
