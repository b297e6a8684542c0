"""tools/gpu_smoke.py (prepared for a GPU, never run on one): its CPU-independent parts and
the ``--device cpu --dry`` rehearsal of the same five phases."""
import os
import subprocess
import sys

import pytest

from toolslib import TOOLS, load_tool

smoke = load_tool("gpu_smoke")


def test_parse_args_refusals_name_the_option(capsys):
    assert smoke.parse_args(["--device", "cpu", "--dry"]).dry
    for argv, word in ((["--dry"], "--dry"), (["--batch", "3"], "--batch"), (["--response-length", "0"],
                                                                          "--response-length"),
                       (["--wheels", "/nonexistent-dir"], "--wheels")):
        with pytest.raises(SystemExit):
            smoke.parse_args(argv)
        assert word in capsys.readouterr().err


def test_compare_and_table():
    assert smoke.compare(None, 10.0) == "-" and smoke.compare(5.0, 0.0) == "-"
    assert smoke.compare(5.0, 4.0) == "1.25"
    table = smoke.format_table([smoke.PhaseResult("update", 1.5, 3 * 2**20, 2 * 2**20, "ok"),
                                smoke.PhaseResult("generate", 0.25, None, 2**20)])
    lines = table.splitlines()
    assert lines[1].split()[:5] == ["update", "1.50", "3.00", "2.00", "1.50"]
    assert lines[2].split()[:5] == ["generate", "0.25", "-", "1.00", "-"]


def test_planned_generation_adds_the_kv_cache_by_hand():
    cfg = smoke.smoke_config(8, 4, "bfloat16", use_gpu=True)
    plan = smoke.planned_bytes(cfg, 8)
    hf = cfg.model.hf_config
    head_dim = hf["hidden_size"] // hf["num_attention_heads"]
    seq = cfg.data.max_prompt_length + 4
    kv = 2 * hf["num_hidden_layers"] * hf["num_key_value_heads"] * head_dim * 2 * seq * 8  # K and V, bf16
    assert plan["generate (HF)"] - plan["reshard t=t_g=1"] == pytest.approx(kv)
    assert set(plan) == set(smoke.PHASES)


@pytest.mark.slow
def test_dry_cpu_rehearsal_runs_every_phase():
    proc = subprocess.run([sys.executable, os.path.join(TOOLS, "gpu_smoke.py"), "--device", "cpu", "--dry"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "PASS" in out and all(phase in out for phase in smoke.PHASES)
    assert "FAILED" not in out
