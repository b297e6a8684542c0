"""tools/bench_vs_trl.py: its workload pieces, and a --quick side-by-side run (slow; needs TRL's venv)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import bench_vs_trl as bench  # noqa: E402

TRL_VENV = os.environ.get("MEGAFLOW_TRL_VENV", "/tmp/trl-venv")


def test_word_tokenizer_round_trips_sums():
    tok = bench.word_tokenizer()
    ids = tok("12+7=")["input_ids"]
    assert tok.convert_ids_to_tokens(ids) == ["1", "2", "+", "7", "="]
    assert tok.decode(ids) == "12+7=" and len(tok) == 512
    assert (tok.pad_token_id, tok.eos_token_id, tok.bos_token_id) == (0, 1, 2)


def test_exact_sum_reward():
    got = [bench.exact_sum(t, 19) for t in ["19", "19<eos>", "19 x", "190", " 19", "1", ""]]
    assert got == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]


def test_megaflow_config_is_the_workload(tmp_path):
    import argparse

    from megaflow.topology import generation_sizes, num_samples_per_step

    args = argparse.Namespace(size="15m", seed=0, tp=2, gen_tp=1, procs=2, warmup=1, steps=2, fixed_length=True,
                              kv_cache_gib=0, cpus_per_proc=1)
    cfg = bench.megaflow_config(args, str(tmp_path))
    assert cfg.model.hf_config["hidden_size"] == 512 and cfg.model.hf_config["num_hidden_layers"] == 8
    assert num_samples_per_step(cfg) == 32 and generation_sizes(cfg).num_replicas == 2
    assert cfg.rollout.ignore_eos and cfg.algorithm.rollout_correction.bypass
    assert cfg.resources.num_cpus_per_proc == 1
    lines = (tmp_path / "train.jsonl").read_text().splitlines()
    assert len(lines) == bench.NUM_PROMPTS
    a, b = map(int, re.fullmatch(r"(\d+)\+(\d+)=", __import__("json").loads(lines[0])["prompt"]).groups())
    assert __import__("json").loads(lines[0])["reward_model"]["ground_truth"] == str(a + b)


@pytest.mark.slow
def test_quick_side_by_side_prints_both_frameworks():
    if not os.path.exists(os.path.join(TRL_VENV, "bin", "python")):
        pytest.skip(f"TRL's venv {TRL_VENV} is absent (python tools/bench_vs_trl.py --setup)")
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_vs_trl.py"), "--quick", "--trl-venv", TRL_VENV,
                           "--timeout", "280"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {m.group(1): float(m.group(2)) for m in re.finditer(r"^3m\s+(trl|megaflow)\s+([\d.]+)", proc.stdout, re.M)}
    assert set(rows) == {"trl", "megaflow"} and all(v > 0 for v in rows.values()), proc.stdout
    assert re.search(r"^3m\s+ratio\s+[\d.]+x", proc.stdout, re.M), proc.stdout


def test_kv_cache_gib_option_turns_auto_off(tmp_path):
    import argparse

    args = argparse.Namespace(size="3m", seed=0, tp=2, gen_tp=1, procs=2, warmup=1, steps=2, fixed_length=False,
                              kv_cache_gib=2, cpus_per_proc=2)
    cfg = bench.megaflow_config(args, str(tmp_path))
    assert not cfg.rollout.cpu_kv_cache_auto and cfg.rollout.cpu_kv_cache_gib == 2 and not cfg.rollout.ignore_eos
    assert cfg.resources.num_cpus_per_proc == 2  # --cpus-per-proc


def test_data_parallel_layout_splits_the_step_into_one_micro_batch_per_rank(tmp_path):
    import argparse

    from megaflow.topology import num_samples_per_step

    args = argparse.Namespace(size="3m", seed=0, tp=1, gen_tp=1, procs=2, warmup=1, steps=2, fixed_length=True,
                              kv_cache_gib=0, cpus_per_proc=1)
    cfg = bench.megaflow_config(args, str(tmp_path))
    assert num_samples_per_step(cfg) == 32
    # dp = 2: each rank updates its 16 rows in one micro-batch, as TP=2 (dp = 1) does with all 32
    assert cfg.actor.ppo_micro_batch_size_per_gpu == 16 and cfg.actor.log_prob_micro_batch_size_per_gpu == 16


def test_a_layout_megaflow_refuses_stops_before_any_run(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_vs_trl.py"), "--tp", "2", "--procs", "3",
                           "--trl-venv", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "--procs 3" in proc.stderr and "actor.tp" in proc.stderr, proc.stderr


def test_busy_processes_spin_during_the_block_and_end_with_it():
    import psutil

    me = psutil.Process()
    before = {p.pid for p in me.children()}
    with bench.busy_processes(2):
        spinning = [p for p in me.children() if p.pid not in before]
        assert len(spinning) == 2 and all(p.nice() == me.nice() for p in spinning)  # the same priority as us
        assert all(p.cmdline()[-1] == "while True: pass" for p in spinning)
    assert not [p for p in spinning if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def test_lora_row_configures_both_frameworks(tmp_path):
    """--lora-rank: megaflow's actor.lora (lora-core's keys) and the peft targets TRL gets cover the same linears."""
    import argparse

    from megaflow.models.peft_io import MEGATRON_TO_HF_MODULES

    assert sorted(h for m in bench.LORA_TARGETS for h in MEGATRON_TO_HF_MODULES[m]) == sorted(bench.LORA_HF_TARGETS)
    assert "peft" in bench.TRL_PACKAGES
    args = argparse.Namespace(size="3m", seed=0, tp=1, gen_tp=1, procs=1, warmup=1, steps=2, fixed_length=True,
                              kv_cache_gib=0, cpus_per_proc=1, lora_rank=8, lora_alpha=16.0, lora_sync="adapter")
    from megaflow.config.typed import ConfigError

    try:
        cfg = bench.megaflow_config(args, str(tmp_path))
    except ConfigError as exc:  # the keys are lora-core's (issue 35); this branch predates their merge
        if "actor.lora: unknown key" in str(exc):
            pytest.skip("actor.lora is not in this branch's config schema yet")
        raise
    lora = cfg.actor.lora
    assert (lora.rank, lora.alpha, lora.dropout, list(lora.target_modules), lora.sync) == (
        8, 16.0, 0.0, bench.LORA_TARGETS, "adapter")
