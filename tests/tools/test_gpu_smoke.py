"""tools/gpu_smoke.py (prepared for a GPU, never run on one): its CPU-independent parts and
the ``--device cpu --dry`` rehearsal of the same phases."""
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

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


def _requirements(dist: str) -> set[str]:
    """Distributions ``dist`` needs on the target (Python 3.12, no extras), recursively."""
    seen, todo = set(), [dist]
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        for text in importlib.metadata.requires(name) or ():
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"python_version": "3.12", "extra": ""}):
                todo.append(req.name)
    return seen


def test_the_wheel_list_brings_everything_the_target_lacks():
    # the target has torch and transformers (and what they require): every other distribution
    # that megatron-core and tensordict require must be a carried wheel (pyvers was missing)
    target = _requirements("torch") | _requirements("transformers")
    carried = {canonicalize_name(w.split("==")[0]) for w in smoke.WHEELS}
    needed = (_requirements("megatron-core") | _requirements("tensordict")) - target
    assert needed <= carried, f"missing from gpu_smoke.WHEELS: {sorted(needed - carried)}"
    assert {"pyvers", "cloudpickle"} <= carried
    for wheel in smoke.WHEELS:  # pinned to what the CPU suite runs, and named in the docstring's pip command
        name, version = wheel.split("==")
        assert importlib.metadata.version(name) == version and wheel in smoke.__doc__
        assert name in smoke.WHEEL_MODULES
    assert smoke.missing_wheels() == []


def _device_fix_present() -> bool:
    spec = importlib.util.find_spec("megaflow.utils.device") if importlib.util.find_spec("megaflow.utils") else None
    return spec is not None and "def pin_local_rank" in open(spec.origin).read()


def test_device_index_check_runs_in_a_subprocess_on_a_mocked_one_gpu_cuda():
    result = smoke.device_index_check(cuda=False)
    if _device_fix_present():  # the fix of issue 31 item 1: LOCAL_RANK=3 with one visible GPU -> cuda:0
        assert result == {"status": "pass", "device": 0, "LOCAL_RANK": "0", "node_local_rank": "3", "reason": ""}
    else:
        assert result["status"] == "skip" and "megaflow.utils.device.pin_local_rank" in result["reason"]


def test_model_tflops_and_the_1b_plan_by_hand():
    assert smoke.model_tflops(10**9, 4096, 2.0, 6) == pytest.approx(6 * 4096 / 2.0 / 1e3)
    cfg = smoke.memory_config(cuda=True, batch=4, seq=2048)
    h, f, layers, vocab, s, b = 2048, 8192, 16, 32000, 2048, 4
    n = layers * (2 * h * h + 2 * h * 512 + 3 * h * f + 2 * h) + 2 * vocab * h + h  # 32000 = 250 x 128: no padding
    assert n == 1_104_218_112
    plan = smoke.planned_memory(cfg)
    assert plan["params"] == 2 * n
    # bf16 params, fp32 grads, fp32 master + 2 Adam moments (dp=1: not sharded); full
    # recomputation keeps each layer's bf16 input; the final norm's (3h+1) and fp32 logits + grad
    activations = layers * 2 * b * s * h + 2 * b * s * (3 * h + 1) + 2 * 4 * b * s * vocab
    assert plan["update"] == pytest.approx(2 * n + 4 * n + 12 * n + activations)
    assert plan["log-prob forward"] > plan["params"]


@pytest.mark.slow
def test_dry_cpu_rehearsal_runs_every_phase(tmp_path):
    out_json = tmp_path / "gpu_smoke.json"
    proc = subprocess.run([sys.executable, os.path.join(TOOLS, "gpu_smoke.py"), "--device", "cpu", "--dry",
                           "--json", str(out_json)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "PASS" in out and all(phase in out for phase in smoke.PHASES)
    assert "FAILED" not in out
    results = json.loads(out_json.read_text())
    assert results["passed"] and results["dry"] and [p["phase"] for p in results["phases"]] == list(smoke.PHASES)
    assert results["device_index"]["status"] == ("pass" if _device_fix_present() else "skip")
    memory = results["memory"]
    assert memory["num_params"] == 426_624 and list(memory["phases"]) == ["params", "log-prob forward", "update"]
    for name, phase in memory["phases"].items():  # no memory statistics on CPU; throughput measured
        assert phase["peak_bytes"] is None and phase["ratio"] is None and phase["planned_bytes"] > 0
        if name != "params":
            assert phase["tokens_per_s"] == pytest.approx(4 * 32 / phase["seconds"])
