"""The dry-run plan against a measured real run (issue 36 item 7): ``tools/measure_run_memory.py``
runs the SmolLM2 recipe for one step at small sizes (2 prompts x 2 samples, 64-token
responses, two optimizer steps so the second update runs with Adam's state allocated) and
samples its process tree; the worker's peak RSS must be within 25 % of the planned rank peak
and the tree's within 25 % of the planned node total. Also the tool's own parts: process
classification and the fork filter. (The full recipe's measurement: docs/performance.md.)"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from toolslib import load_tool

RECIPE = "smollm2_gsm8k_grpo"


def test_process_titles_name_kind_and_phase():
    tool = load_tool("measure_run_memory")
    assert tool.classify(10, 10, "python -m megaflow.trainer.main") == ("controller", None)
    assert tool.classify(11, 10, "ray::WorkerHost.execute actor.update_actor") == ("worker", "actor.update_actor")
    assert tool.classify(11, 10, "ray::IDLE") == ("worker", "IDLE")
    assert tool.classify(11, 10, "ray::WorkerHost.init_roles") == ("worker", "init_roles")
    assert tool.classify(12, 10, "/venv/lib/ray/core/src/ray/raylet/raylet --x") == ("ray", None)
    assert tool.classify(13, 10, "ray::DashboardAgent") == ("ray", None)


def test_sampler_counts_a_child_once_and_skips_unexeced_forks():
    tool = load_tool("measure_run_memory")
    # a child that allocates 200 MiB and a fork of this test process (same title, shared pages)
    code = "import time; b = b'x' * (200 << 20); print('ready', flush=True); time.sleep(60)"
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    pid = os.fork()
    if pid == 0:  # the fork: sleeps with this process's pages (not exec'd)
        import time
        time.sleep(60)
        os._exit(0)
    try:
        assert child.stdout.readline().strip() == "ready"  # its 200 MiB are written
        sampler = tool.TreeSampler(os.getpid())
        sampler.sample()
        seen = set(sampler.processes)
        assert child.pid in seen and pid not in seen
        assert sampler.processes[child.pid].hwm >= 200 << 20
    finally:
        child.kill()
        os.kill(pid, 9)
        child.wait()
        os.waitpid(pid, 0)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_planned_peaks_within_25_percent_of_a_measured_smollm2_run(tmp_path):
    from megaflow.data.gsm8k_layout import prepare_gsm8k
    from megaflow.models.smollm2 import ensure_smollm2

    model, data = ensure_smollm2(), tmp_path / "gsm8k"
    prepare_gsm8k(out=data)
    out = tmp_path / "memory.json"
    overrides = [f"model.path={model}", f"data.train_files=[{data / 'train.parquet'}]",
                 f"data.val_files=[{data / 'test.parquet'}]", "resources.use_gpu=false",
                 "data.train_batch_size=2", "rollout.n=2", "actor.ppo_mini_batch_size=1",
                 "actor.ppo_micro_batch_size_per_gpu=2", "actor.log_prob_micro_batch_size_per_gpu=4",
                 "ref.log_prob_micro_batch_size_per_gpu=4", "rollout.response_length=64", "rollout.cpu_kv_cache_gib=1",
                 "trainer.total_steps=1", "trainer.test_freq=0", "trainer.save_freq=-1", "trainer.logger=[jsonl]",
                 f"trainer.output_dir={tmp_path / 'out'}", "trainer.resume=disable"]
    tool = os.path.join(os.path.dirname(load_tool("measure_run_memory").__file__), "measure_run_memory.py")
    subprocess.run([sys.executable, tool, "--recipe", RECIPE, "--json", str(out), *overrides], check=True,
                   timeout=1700)
    rep = json.loads(out.read_text())
    plan = rep["plan"]
    # the update ran (its phase was sampled) with two optimizer steps
    (worker,) = [w for w in rep["workers"] if "actor.update_actor" in w["phases_gib"]]
    assert worker["peak_gib"] == pytest.approx(plan["rank_peak_gib"], rel=0.25), rep
    assert rep["tree_peak_rss_gib"] == pytest.approx(plan["node_gib"]["0"], rel=0.25), rep
