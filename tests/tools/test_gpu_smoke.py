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
    # recomputation keeps each layer's bf16 input; the final norm's (3h+1); the fp32 log-prob head
    # with T = b*s tokens and R = b*s/2 response tokens: the logits and their contiguous copy (2T),
    # the response rows' logits, exp and a temporary (T + 3R), backward's 3R: max = T + 3R = 2.5T
    tokens, response = b * s, b * s // 2
    head = 4 * vocab * max(2 * tokens, tokens + 3 * response, 3 * response)
    activations = layers * 2 * b * s * h + 2 * b * s * (3 * h + 1) + head
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
    trip = results["offload_round_trip"]  # fp32 on CPU: exact
    assert trip["within"] and trip["dtype"] == "float32" and trip["offloaded"] == ["grads", "optimizer", "params"]
    assert trip["param_max_diff"] == trip["optimizer_max_diff"] == 0.0 and trip["optimizer_tensors"] > 0
    gap = results["log_prob_gap"]  # bf16 on CPU: recorded, not enforced
    assert not gap["enforced"] and gap["dtype"] == "bfloat16" and gap["tokens"] == 32 * 16
    assert 0 < gap["mean"] <= gap["p99"] <= gap["max"] and gap["tolerance"] > 0
    sync = results["sync_peak"]  # the live-tensor account on CPU, within the formula
    assert sync["within"] and 0 < sync["measured_bytes"] == sync["tracked_bytes"] <= sync["bound_bytes"]
    assert "offload round trip" in out and "log-prob gap" in out and "weight sync peak" in out


@pytest.fixture
def world_of_one(tmp_path):
    """A gloo process group of one rank in this process (torn down after the test)."""
    import torch.distributed as dist

    from megaflow.megatron import parallel

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield
    parallel.destroy_parallel()
    dist.destroy_process_group()


def test_offload_round_trip_matches_its_twin_and_catches_a_broken_reload(world_of_one, monkeypatch):
    good = smoke.offload_round_trip(cuda=False, batch=4, response_length=4)
    assert good["within"] and good["offloaded"] == ["grads", "optimizer", "params"]
    assert good["param_max_diff"] == good["optimizer_max_diff"] == good["log_prob_max_diff"] == 0.0
    assert good["optimizer_tensors"] > 0 and good["rtol"] == good["atol"] == 0.0
    assert smoke.check_failures({"offload_round_trip": good, "log_prob_gap": {"enforced": False},
                                 "sync_peak": {"within": True}}) == []

    import torch

    from megaflow.megatron import offload

    reload_params = offload.reload_params

    def stale_reload(model):  # a reload that brings back one parameter off by one bf16 step
        reload_params(model)
        with torch.no_grad():
            next(model.parameters()).mul_(1 + 2 ** -8)

    monkeypatch.setattr(offload, "reload_params", stale_reload)
    bad = smoke.offload_round_trip(cuda=False, batch=4, response_length=4)
    assert not bad["within"] and bad["param_mismatches"] >= 1 and bad["optimizer_mismatches"] >= 1
    failures = smoke.check_failures({"offload_round_trip": bad, "log_prob_gap": {"enforced": False},
                                     "sync_peak": {"within": True}})
    assert len(failures) == 1 and failures[0].startswith("offload round trip:")


def test_log_prob_gap_is_recorded_next_to_the_tolerance_and_fails_when_enforced(monkeypatch):
    import torch

    from megaflow.rollout import verify_sync

    hf_dict = dict(smoke.smoke_config(8, 4, "float32", use_gpu=False).model.hf_config)
    gap = smoke.log_prob_gap_check(hf_dict, torch.device("cpu"), enforce=False, prompts=4, length=10)
    assert gap["tolerance"] == verify_sync.VERIFY_SYNC_ATOL["bfloat16"] and gap["tokens"] == 4 * 6
    assert 0 < gap["mean"] <= gap["p99"] <= gap["max"] and gap["within"] and not gap["enforced"]
    assert gap["implied_tolerance"] == verify_sync.round_up_one_digit(2 * gap["max"])
    monkeypatch.setitem(verify_sync.VERIFY_SYNC_ATOL, "bfloat16", gap["max"])  # below twice the largest gap
    tight = smoke.log_prob_gap_check(hf_dict, torch.device("cpu"), enforce=True, prompts=4, length=10)
    assert tight["max"] == gap["max"] and not tight["within"]
    failures = smoke.check_failures({"offload_round_trip": {"within": True}, "log_prob_gap": tight,
                                     "sync_peak": {"within": True}})
    assert len(failures) == 1 and failures[0].startswith("log-prob gap:")
    recorded = dict(tight, enforced=False)  # the CPU rehearsal records without failing
    assert smoke.check_failures({"offload_round_trip": {"within": True}, "log_prob_gap": recorded,
                                 "sync_peak": {"within": True}}) == []


def test_sync_peak_within_the_formula_and_a_gather_first_sync_above_it(world_of_one, monkeypatch):
    import torch

    import bench_reshard
    from megaflow.config.loader import config_to_dict
    from megaflow.megatron import parallel
    from megaflow.megatron.model import build_gpt_model

    cfg = smoke.smoke_config(8, 4, "float32", use_gpu=False)
    hf_dict = dict(config_to_dict(cfg)["model"]["hf_config"])
    parallel.initialize_parallel(tp=1, pp=1, seed=1)
    module = build_gpt_model(hf_dict, dtype=torch.float32).cpu()
    shard = sum(p.numel() * p.element_size() for p in module.parameters())
    bucket = 4096  # far below the model: one bucket holds one tensor
    ok = smoke.sync_peak_check(module, hf_dict, bucket, cuda=False)
    # vLLM's tensors by hand (h 128, ffn 384, 2 layers, 4 heads / 2 KV heads of 32, vocab 16
    # padded to 64 rows): embedding and LM head, fused QKV, o_proj, gate_up, down, two norms a
    # layer, the final norm; fp32. The largest is gate_up (2 x 384 rows).
    h, f, layers, kv = 128, 384, 2, 2 * 32
    assert (hf_dict["hidden_size"], hf_dict["intermediate_size"], hf_dict["vocab_size"]) == (h, f, 16)
    engine = 4 * (2 * 64 * h + layers * ((h + 2 * kv) * h + h * h + 2 * f * h + h * f + 2 * h) + h)
    largest = 4 * 2 * f * h
    assert ok["bound_bytes"] == engine + 2 * largest  # engine + one bucket (one tensor) + the largest tensor
    assert ok["within"] and ok["measured_bytes"] == ok["tracked_bytes"] > shard
    load_buckets = bench_reshard.load_buckets

    def gather_first(engine, buckets):  # the route before issue 31: the whole generation shard
        # gathered into buffers of its own (at t = 1 they would alias the parameters: copied here)
        # before the engine wakes, so two generation shards are alive at once
        gathered = [[(name, tensor.clone()) for name, tensor in bucket] for bucket in buckets]
        return load_buckets(engine, iter(gathered))

    monkeypatch.setattr(bench_reshard, "load_buckets", gather_first)
    bad = smoke.sync_peak_check(module, hf_dict, bucket, cuda=False)
    assert not bad["within"] and bad["measured_bytes"] > bad["bound_bytes"]
    failures = smoke.check_failures({"offload_round_trip": {"within": True}, "log_prob_gap": {"enforced": False},
                                     "sync_peak": bad})
    assert len(failures) == 1 and failures[0].startswith("sync peak:")
