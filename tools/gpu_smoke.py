"""A prepared single-GPU smoke check of the actor path (NOT YET RUN ON A GPU).

Target machine: one CUDA GPU, no network, Python 3.12 with CUDA torch 2.11 and
``transformers`` only (no megatron-core, vLLM, Transformer Engine or Ray), at most 64 MiB of
files brought along. megaflow is imported from this working tree (``sys.path``); the
missing pure-Python wheels are downloaded beforehand on a machine with network::

    pip download --no-deps --python-version 3.12 --only-binary=:all: \\
        megatron-core==0.16.1 tensordict==0.15.3 pyvers==0.2.3 cloudpickle==3.1.3 -d .whl/

(:data:`WHEELS`: megatron-core for the model and optimizer, tensordict for megaflow's
``DataProto``, and pyvers and cloudpickle, which ``import tensordict`` imports and neither torch
nor transformers brings; together well under 64 MiB) and copied next to the tree. ``--wheels .whl`` installs them with
``pip install --no-deps --target .smoke_site`` (nothing outside the tree is touched) and puts
that folder on ``sys.path``.

In one process, world size 1 on NCCL (gloo with ``--device cpu``), it

1. builds the actor of ``recipes/tiny_arith_grpo.yaml`` (a tiny Llama) from its HF config in
   bf16 on CUDA with megatron-core's local layer spec (no TE) and loads the weights of a
   ``transformers`` model built from the same config;
2. compares the actor's log-probs with ``transformers``' on the same weights and tokens;
3. runs one update with full activation recomputation;
4. runs the HybridEngine's micro-DP resharding at ``t = t_g = 1`` and loads the generation
   shard into the ``transformers`` model (it must then equal the updated actor);
5. generates with megaflow's HF rollout (:class:`megaflow.rollout.hf_rollout.HFRollout`);

and prints one table: per phase its seconds, ``torch.cuda.max_memory_allocated`` (peak reset
per phase) and the dry-run planner's estimate (:func:`megaflow.dryrun.plan.build_plan` of the
same config). Then

6. the device-index check (issue 31 item 1) in a subprocess: with ``LOCAL_RANK=3`` and
   ``CUDA_VISIBLE_DEVICES`` naming one GPU, megaflow's Megatron entry point must bind CUDA
   device 0 (skipped, with the reason, while ``megaflow.utils.device.pin_local_rank`` is absent);
7. a random Llama-shaped model (~1.1B parameters on CUDA, the tiny one with ``--dry``) built
   alone: ``max_memory_allocated`` of its parameters, a log-prob forward and a full-recompute
   update against the planner (measured / planned, target 0.8-1.25), and tokens/s and model
   TFLOP/s (``2N`` per token forward, ``6N`` per token update; Kaplan et al. 2020).

8. an offload/reload round trip (issue 31 item 9): two actors with the distributed optimizer
   from the same weights, one offloading parameters, gradients and optimizer state between
   phases as the workers do, the twin never; after two steps their log-probs, parameters and
   optimizer state must agree (exact in fp32, :data:`ROUND_TRIP_TOLERANCE` in bf16). On CPU
   only the gradient buffers really move; on CUDA everything does;
9. the bf16 log-prob gap (max / mean / p99 of |Delta log p|, bf16 vs fp32 compute on the same
   bf16 weights of a random ``transformers`` model, ~1.1B on CUDA; the probe of
   ``tools/calibrate_verify_sync.py``) recorded next to ``rollout.verify_sync``'s bf16
   tolerance; on CUDA twice the largest gap must be within it, the CPU rehearsal only records;
10. a sync-peak rehearsal: one streamed weight sync of the section-7 model into a level-2
    sleeping stand-in engine (``tools/bench_reshard.py``), its peak (``max_memory_allocated``
    on CUDA, the live-tensor account of ``tools/bench_memory.py`` on CPU) at most
    :func:`megaflow.topology.weight_sync.weight_sync_peak_bytes` less the actor shard.

``--json PATH`` (default ``$OUT/gpu_smoke.json`` when ``$OUT`` is set) writes every result
(``offload_round_trip``, ``log_prob_gap`` and ``sync_peak`` for sections 8-10).
Exit status 1 when a check fails; each failure is printed naming its check. It is sized to
finish in well under 8 minutes.

``--device cpu --dry`` runs the same code on the CPU (fp32, gloo, no memory statistics: the
memory column reads "-"); the tests run that path so the script is not dead code. It has not
been run on a GPU yet: no GPU was available to this task.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import glob
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(1, os.path.join(ROOT, "tools"))  # bench_memory, bench_reshard, calibrate_verify_sync

RECIPE = "tiny_arith_grpo"
#: Pure-Python wheels the target lacks (it has Python 3.12, CUDA torch and transformers).
WHEELS = ("megatron-core==0.16.1", "tensordict==0.15.3", "pyvers==0.2.3", "cloudpickle==3.1.3")
#: The module each wheel of :data:`WHEELS` provides (imported first, to fail early naming it).
WHEEL_MODULES = {"megatron-core": "megatron.core", "tensordict": "tensordict", "pyvers": "pyvers",
                 "cloudpickle": "cloudpickle"}
#: The ~1.1B Llama shape of the memory/throughput section on CUDA (random weights).
LLAMA_1B = {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
            "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000,
            "max_position_embeddings": 4096, "tie_word_embeddings": False}
#: Measured / planned memory the planner must meet on a GPU.
RATIO_RANGE = (0.8, 1.25)
PHASES = ("build+load", "log-probs", "update (recompute=full)", "reshard t=t_g=1", "generate (HF)")
#: (rtol, atol) of the offload round trip's comparison with the twin engine, by ``model.dtype``.
#: fp32 on CPU: exact (nothing changes but where the tensors live). bf16 on CUDA: the copies to
#: host and back are exact too, but the two engines' kernels run on different allocations, where
#: cuBLAS may choose other algorithms: one bf16 rounding step (2^-8 relative) is allowed, with an
#: absolute floor far below any Adam update of a parameter.
ROUND_TRIP_TOLERANCE = {"float32": (0.0, 0.0), "bfloat16": (2.0 ** -8, 1e-8)}
#: Updates (each a log-prob forward and a train step, as one RL step) of the offload round trip.
ROUND_TRIP_STEPS = 2


@dataclasses.dataclass
class PhaseResult:
    """One row of the table: ``seconds``, measured peak bytes (None on CPU), planner bytes."""

    phase: str
    seconds: float
    peak_bytes: float | None
    planned_bytes: float | None
    note: str = ""


def parse_args(argv=None) -> argparse.Namespace:
    """Command line (``--device``, ``--dry``, ``--wheels``, ``--batch``, ``--response-length``)."""
    parser = argparse.ArgumentParser(description="single-GPU smoke check of the actor path (see module docstring)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--dry", action="store_true", help="CPU rehearsal: fp32, gloo (needs --device cpu)")
    parser.add_argument("--wheels", default=None, help="folder of pip-downloaded wheels to install (--no-deps)")
    parser.add_argument("--batch", type=int, default=8, help="prompts per phase (default 8)")
    parser.add_argument("--response-length", type=int, default=4, help="generated tokens (default 4)")
    parser.add_argument("--mem-batch", type=int, default=4, help="rows of the memory section (default 4)")
    parser.add_argument("--mem-seq", type=int, default=None,
                        help="tokens per row of the memory section (default 2048 on CUDA, 32 on CPU)")
    parser.add_argument("--json", default=None,
                        help="write the results here (default $OUT/gpu_smoke.json when $OUT is set)")
    args = parser.parse_args(argv)
    if args.dry and args.device != "cpu":
        parser.error("--dry is the CPU rehearsal: use it with --device cpu")
    if args.batch < 2 or args.batch % 2:
        parser.error(f"--batch must be an even number >= 2 (rollout.n = 2), got {args.batch}")
    if args.response_length < 1:
        parser.error(f"--response-length must be >= 1, got {args.response_length}")
    if args.mem_batch < 2 or args.mem_batch % 2 or (args.mem_seq is not None and args.mem_seq < 2):
        parser.error(f"--mem-batch must be an even number >= 2 and --mem-seq >= 2, got {args.mem_batch}, "
                     f"{args.mem_seq}")
    if args.json is None and os.environ.get("OUT"):
        args.json = os.path.join(os.environ["OUT"], "gpu_smoke.json")
    if args.wheels is not None and not glob.glob(os.path.join(args.wheels, "*.whl")):
        parser.error(f"--wheels {args.wheels!r}: no .whl files there (see the pip download command in the docstring)")
    return args


def missing_wheels() -> list[str]:
    """The entries of :data:`WHEELS` whose module does not import here."""
    import importlib

    missing = []
    for wheel in WHEELS:
        try:
            importlib.import_module(WHEEL_MODULES[wheel.split("==")[0]])
        except ImportError:
            missing.append(wheel)
    return missing


#: Run in a fresh interpreter by :func:`device_index_check`; prints one JSON line. With
#: ``MEGAFLOW_SMOKE_MOCK_CUDA=1`` (the CPU rehearsal) torch.cuda is one mocked device.
_DEVICE_INDEX_CHILD = """
import json, os, sys
sys.path.insert(0, os.environ["MEGAFLOW_SMOKE_ROOT"])
import torch
if os.environ.get("MEGAFLOW_SMOKE_MOCK_CUDA") == "1":
    bound = []
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 1
    def set_device(index):
        if int(index) >= 1:
            raise RuntimeError(f"CUDA error: invalid device ordinal {index} (mocked: one visible device)")
        bound.append(int(index))
    torch.cuda.set_device = set_device
    torch.cuda.current_device = lambda: bound[-1] if bound else 0
try:
    from megaflow.utils.device import pin_local_rank  # noqa: F401  (the fix of issue 31 item 1)
except ImportError as exc:
    print(json.dumps({"status": "skip", "reason": "megaflow.utils.device.pin_local_rank is not in this tree "
                      f"(the device-index fix of issue 31 item 1): {exc}"}))
    sys.exit(0)
import tempfile
import torch.distributed as dist
from megaflow.megatron import parallel
# the entry point runs after the process group exists (initialize_parallel), as under Ray
dist.init_process_group("gloo", store=dist.FileStore(tempfile.mktemp(prefix="megaflow_smoke_"), 1), rank=0,
                        world_size=1)
try:
    parallel._set_cuda_device()
except Exception as exc:  # noqa: BLE001  (any error binding the device is the check's failure)
    print(json.dumps({"status": "fail", "reason": f"{type(exc).__name__}: {str(exc).splitlines()[0]}"}))
    sys.exit(0)
device, local = torch.cuda.current_device(), os.environ.get("LOCAL_RANK")
ok = device == 0 and local == "0"
print(json.dumps({"status": "pass" if ok else "fail", "device": device, "LOCAL_RANK": local,
                  "node_local_rank": os.environ.get("MEGAFLOW_NODE_LOCAL_RANK"),
                  "reason": "" if ok else f"bound cuda:{device} with LOCAL_RANK={local}"}))
"""


def device_index_check(cuda: bool) -> dict:
    """Issue 31 item 1 in a subprocess: ``LOCAL_RANK=3`` and one visible GPU (the first of
    ``CUDA_VISIBLE_DEVICES``, else GPU 0; a mocked one-device CUDA on CPU) must make
    ``megaflow.megatron.parallel._set_cuda_device`` bind device 0.

    Returns:
        ``{"status": "pass" | "fail" | "skip", "reason": ..., ...}``; "skip" while the fix's
        ``megaflow.utils.device.pin_local_rank`` is missing.
    """
    import json

    env = dict(os.environ, LOCAL_RANK="3", MEGAFLOW_SMOKE_ROOT=ROOT,
               CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or "0")
    env.pop("MEGAFLOW_NODE_LOCAL_RANK", None)
    if not cuda:
        env["MEGAFLOW_SMOKE_MOCK_CUDA"] = "1"
    proc = subprocess.run([sys.executable, "-c", _DEVICE_INDEX_CHILD], env=env, capture_output=True, text=True,
                          timeout=300)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode or not lines:
        return {"status": "fail", "reason": f"the check's process exited {proc.returncode}: {proc.stderr[-500:]}"}
    return json.loads(lines[-1])


def install_wheels(folder: str, target: str) -> None:
    """``pip install --no-deps --target target folder/*.whl`` and put ``target`` on sys.path.

    Raises:
        RuntimeError: pip failed (its output is included).
    """
    wheels = sorted(glob.glob(os.path.join(folder, "*.whl")))
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--target", target,
                           *wheels], capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"pip install of {wheels} failed:\n{proc.stdout}\n{proc.stderr}")
    sys.path.insert(0, target)


def smoke_config(batch: int, response_length: int, dtype: str, use_gpu: bool, extra: Sequence[str] = ()):
    """The tiny recipe at world size 1, TP = PP = 1, full recomputation, one micro-batch
    (``extra``: further ``load_run`` overrides)."""
    from megaflow.topology import load_run

    prompts = batch // 2
    overrides = ["resources.procs_per_node=1", "actor.tp=1", "actor.pp=1", "rollout.tp=1", "rollout.n=2",
                 f"model.dtype={dtype}", "actor.recompute_granularity=full",
                 f"data.train_batch_size={prompts}", f"actor.ppo_mini_batch_size={prompts}",
                 f"actor.ppo_micro_batch_size_per_gpu={batch}", f"actor.log_prob_micro_batch_size_per_gpu={batch}",
                 f"rollout.response_length={response_length}", f"resources.use_gpu={str(use_gpu).lower()}"]
    if use_gpu:
        overrides.append("resources.gpu_memory_gib=80")
    return load_run(RECIPE, [*overrides, *extra])


def planned_bytes(cfg, batch: int) -> dict[str, float]:
    """The planner's per-phase bytes for :data:`PHASES` (same model as ``DRY_RUN=1``).

    Generation is planned for the HF rollout: the generation shard plus the KV cache of
    ``batch`` samples at full length (no vLLM reservation).
    """
    from megaflow.dryrun.plan import build_plan

    plan = build_plan(cfg)
    mem, gen = plan.role("actor").memory, plan.rollout.memory
    return {"build+load": mem.params, "log-probs": mem.params, "update (recompute=full)": mem.peak,
            "reshard t=t_g=1": mem.static + gen.extra_weights,
            "generate (HF)": mem.static + gen.extra_weights + gen.kv_per_sequence * batch}


def memory_config(cuda: bool, batch: int, seq: int):
    """The run of the memory section: the ~1.1B :data:`LLAMA_1B` in bf16 on CUDA (the tiny
    recipe's model in fp32 with ``--dry``), world size 1, ``batch`` rows of ``seq`` tokens
    (half prompt, half response), one micro-batch, full recomputation."""
    from megaflow.topology import load_run

    response = seq // 2
    overrides = ["resources.procs_per_node=1", "actor.tp=1", "actor.pp=1", "rollout.tp=1", "rollout.n=2",
                 "actor.recompute_granularity=full", f"data.max_prompt_length={seq - response}",
                 f"rollout.response_length={response}", f"data.train_batch_size={batch // 2}",
                 f"actor.ppo_mini_batch_size={batch // 2}", f"actor.ppo_micro_batch_size_per_gpu={batch}",
                 f"actor.log_prob_micro_batch_size_per_gpu={batch}", f"resources.use_gpu={str(cuda).lower()}",
                 f"model.dtype={'bfloat16' if cuda else 'float32'}"]
    if cuda:
        hf = ", ".join(f"{k}: {str(v).lower() if isinstance(v, bool) else v}" for k, v in LLAMA_1B.items())
        overrides += ["resources.gpu_memory_gib=139", f"model.hf_config={{{hf}}}"]
    return load_run(RECIPE, overrides)


def planned_memory(cfg) -> dict[str, float]:
    """The planner's bytes for the memory section's phases: the parameters; a log-prob forward
    (parameters + one layer's activations + the logits, as the planner's forward roles); the
    update's peak (parameters, fp32 grads, Adam state, recomputation's activations, logits)."""
    from megaflow.dryrun.plan import build_plan

    actor = build_plan(cfg).role("actor")
    mem = actor.memory
    forward = _forward_memory(cfg, actor)
    return {"params": mem.params, "log-prob forward": mem.params + forward, "update": mem.peak}


def _forward_memory(cfg, actor) -> float:
    from megaflow.dryrun.memory import ParallelShape, role_memory
    from megaflow.topology.sizes import max_seq_len
    from megaflow.topology.transformer_engine import transformer_engine_usable

    par = actor.parallel
    shape = ParallelShape(tp=par.tp, pp=par.pp, cp=par.cp, dp=par.dp, vpp=par.vpp, sequence_parallel=False,
                          recompute="none", micro_batch=actor.forward_micro_batch, num_micro_batches=1,
                          seq=max_seq_len(cfg))
    return role_memory("actor", actor.model, shape, dtype=cfg.model.dtype, trained=False, distributed_optimizer=False,
                       fused_attention=bool(cfg.resources.use_gpu) and transformer_engine_usable(need_cuda=False),
                       head="lm").activations


def model_tflops(num_params: int, tokens: int, seconds: float, flops_per_param_token: int) -> float:
    """Model TFLOP/s: ``flops_per_param_token * N * tokens / seconds / 1e12`` (2 for a forward,
    6 for forward + backward; Kaplan et al. 2020, attention scores not counted; recomputation
    is not counted either, so this is the model's, not the hardware's, rate)."""
    return flops_per_param_token * num_params * tokens / seconds / 1e12


def measure_memory(cuda: bool, batch: int, seq: int) -> dict:
    """Section 7: build the random model alone and measure each phase against the planner.

    Returns:
        ``{"model": ..., "phases": {phase: {seconds, peak_bytes, planned_bytes, ratio,
        within_range, tokens_per_s, model_tflops}}}``; ``peak_bytes`` and ``ratio`` are None on CPU.
    """
    import torch

    from megaflow.config.loader import config_to_dict
    from megaflow.megatron import parallel
    from megaflow.megatron.engine import MegatronEngine
    from megaflow.megatron.model import build_gpt_model
    from megaflow.topology.role_spec import RoleSpec

    cfg = memory_config(cuda, batch, seq)
    planned = planned_memory(cfg)
    hf_dict = dict(config_to_dict(cfg)["model"]["hf_config"])
    dtype = getattr(torch, cfg.model.dtype)
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    info = parallel.initialize_parallel(tp=1, pp=1, seed=1)
    results: dict = {}
    baseline = float(torch.cuda.memory_allocated()) if cuda else 0.0  # what earlier sections left

    def phase(name: str, fn: Callable[[], None], tokens: int = 0, flops: int = 0) -> None:
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        peak = float(torch.cuda.max_memory_allocated()) - baseline if cuda else None
        ratio = peak / planned[name] if peak is not None else None
        results[name] = {"seconds": seconds, "peak_bytes": peak, "planned_bytes": planned[name], "ratio": ratio,
                         "within_range": None if ratio is None else RATIO_RANGE[0] <= ratio <= RATIO_RANGE[1],
                         "tokens_per_s": tokens / seconds if tokens else None,
                         "model_tflops": model_tflops(num_params, tokens, seconds, flops) if tokens else None}

    state: dict = {}
    spec = RoleSpec(cfg, "actor", cfg.trainer.total_steps)
    torch.manual_seed(0)
    num_params = 0

    def build() -> None:
        model = build_gpt_model(hf_dict, dtype=dtype, **spec.model_overrides)
        state["engine"] = MegatronEngine(model if cuda else model.to(device), info, spec,
                                         vocab_size=hf_dict["vocab_size"])

    phase("params", build)
    num_params = sum(p.numel() for p in state["engine"].module.parameters())
    g = torch.Generator().manual_seed(0)
    prompt = cfg.data.max_prompt_length
    ids = torch.randint(1, hf_dict["vocab_size"], (batch, seq), generator=g)
    rows = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
            "position_ids": torch.arange(seq).expand_as(ids).contiguous(), "responses": ids[:, prompt:],
            "response_mask": torch.ones(batch, seq - prompt),
            "advantages": torch.randn(batch, seq - prompt, generator=g)}

    def loss(outputs, mb, den):
        return -(outputs["log_probs"] * mb["advantages"] * mb["response_mask"].float()).sum() / den.num_tokens, {}

    phase("log-prob forward", lambda: state["engine"].forward(rows), tokens=batch * seq, flops=2)
    phase("update", lambda: state["engine"].train_step(rows, loss), tokens=batch * seq, flops=6)
    sync = sync_peak_check(state["engine"].module, hf_dict, cfg.rollout.weight_sync_bucket_mb << 20, cuda)
    del state["engine"]
    return {"model": {k: hf_dict[k] for k in LLAMA_1B if k in hf_dict}, "num_params": num_params,
            "dtype": cfg.model.dtype, "batch": batch, "seq": seq, "phases": results, "sync_peak": sync}


def generation_resharder(module, hf_dict: dict):
    """The HybridEngine's micro-DP resharder of ``module`` at ``t = t_g = 1`` (world size 1)."""
    from megaflow.hybrid_engine import MicroDPResharder, build_reshard_groups, plan_hybrid_layout

    layout = plan_hybrid_layout(1, 1, 1, gen_tp=1, num_attention_heads=hf_dict["num_attention_heads"],
                                num_query_groups=hf_dict["num_key_value_heads"])
    return MicroDPResharder(build_reshard_groups(layout), dict(module.named_parameters()),
                            share_embeddings_and_output_weights=module.share_embeddings_and_output_weights)


def sync_peak_check(module, hf_dict: dict, bucket_bytes: int, cuda: bool) -> dict:
    """Section 10: one streamed weight sync of ``module`` (the worker's route, into
    ``tools/bench_reshard.py``'s level-2 sleeping engine on the same device) measured against
    :func:`megaflow.topology.weight_sync.weight_sync_peak_bytes` less the actor's shard
    (allocated before): engine weights + one bucket + the largest tensor.

    Measured: ``torch.cuda.max_memory_allocated`` over the sync on CUDA; on CPU the live-tensor
    account of ``tools/bench_memory.py``'s ``measure_sync`` (recorded on CUDA too).

    Returns:
        ``{"measured_bytes", "tracked_bytes", "bound_bytes", "actor_shard_bytes", "bucket_bytes",
        "ratio", "within"}``; ``within`` is False when the measured peak is above the bound.
    """
    import torch

    from bench_memory import measure_sync
    from bench_reshard import SleepingEngine, _vllm_shapes, sync_bound
    from megaflow.models.hf_mapping import ModelSpec

    resharder = generation_resharder(module, hf_dict)
    dtype = next(module.parameters()).dtype
    device = next(module.parameters()).device
    shard = sum(p.numel() * p.element_size() for p in module.parameters())
    shapes = _vllm_shapes(resharder, ModelSpec.from_hf_config(hf_dict), 1)
    bound = sync_bound(resharder, SleepingEngine(shapes, dtype), bucket_bytes, shard)  # not woken: no allocation
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    tracked = measure_sync(resharder, hf_dict, bucket_bytes, dtype, device)
    measured = float(torch.cuda.max_memory_allocated() - base) if cuda else float(tracked)
    return {"measured_bytes": measured, "tracked_bytes": tracked, "bound_bytes": bound, "actor_shard_bytes": shard,
            "bucket_bytes": bucket_bytes, "ratio": measured / bound, "within": measured <= bound}


def log_prob_gap_check(hf_dict: dict, device, enforce: bool, prompts: int = 32, length: int = 20) -> dict:
    """Section 9: |Delta log p| of bf16 vs fp32 compute on the same bf16 weights (a random
    ``transformers`` model of ``hf_dict`` on ``device``; ``tools/calibrate_verify_sync.py``'s
    probe: greedy tokens after every prefix of >= 5 random tokens), next to
    ``rollout.verify_sync``'s bf16 tolerance (:func:`megaflow.rollout.verify_sync.verify_sync_tolerance`).

    The tolerance holds when twice the largest gap is within it (the engine's and the
    trainer's gaps to the exact value add up at worst). ``enforce`` (CUDA) makes a miss a
    failure; the CPU rehearsal (CPU bf16 kernels, not the GPU's) only records.

    Returns:
        ``{"dtype", "device", "max", "mean", "p99", "tokens", "tolerance", "implied_tolerance",
        "enforced", "within"}`` (gaps in nats).
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from calibrate_verify_sync import model_gap_statistics
    from megaflow.rollout.verify_sync import round_up_one_digit, verify_sync_tolerance

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**hf_dict), dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    stats = model_gap_statistics(model, prompts, length, seed=0, dtype=torch.bfloat16)
    del model
    tolerance = verify_sync_tolerance("bfloat16")
    return {"dtype": "bfloat16", "device": str(device), **stats, "tolerance": tolerance,
            "implied_tolerance": round_up_one_digit(2 * stats["max"]) if stats["max"] > 0 else 0.0,
            "enforced": enforce, "within": 2 * stats["max"] <= tolerance}


def _state_gap(a: list, b: list, rtol: float, atol: float) -> tuple[float, int]:
    """Largest |a - b| over paired tensors and how many pairs miss ``|a - b| <= atol + rtol |b|``."""
    import torch

    worst, misses = 0.0, 0
    for x, y in zip(a, b, strict=True):
        x, y = x.detach().float().cpu(), y.detach().float().cpu()
        if x.shape != y.shape:
            return float("inf"), misses + 1
        if x.numel():
            worst = max(worst, float((x - y).abs().max()))
        misses += int(not torch.allclose(x, y, rtol=rtol, atol=atol))
    return worst, misses


def offload_round_trip(cuda: bool, batch: int, response_length: int) -> dict:
    """Section 8: two actors with the distributed optimizer built from the same weights; one
    offloads parameters, gradients and optimizer state after every phase and reloads what the
    next phase needs (the workers' ``MegatronRole.phase`` with
    ``actor.param_offload``/``grad_offload``/``optimizer_offload`` on), the twin never offloads.
    After :data:`ROUND_TRIP_STEPS` steps (a log-prob forward, then an update) their log-probs,
    parameters and optimizer state (fp32 main parameters and Adam moments) must agree within
    :data:`ROUND_TRIP_TOLERANCE` of the dtype.

    On CPU the tensors already live in host memory: parameters and optimizer state stay put,
    the gradient buffers are really released and re-allocated; on CUDA everything moves
    (``device_bytes_freed``: what the offload released; it must be above 0 there).

    Returns:
        ``{"dtype", "steps", "offloaded", "device_bytes_freed", "log_prob_max_diff",
        "param_max_diff", "param_mismatches", "optimizer_max_diff", "optimizer_mismatches",
        "optimizer_tensors", "rtol", "atol", "within"}``.
    """
    import torch

    from bench_memory import _loss, _optimizer_tensors, tiny_batch
    from megaflow.config.loader import config_to_dict
    from megaflow.megatron import parallel
    from megaflow.megatron.engine import MegatronEngine
    from megaflow.megatron.model import build_gpt_model
    from megaflow.topology.role_spec import RoleSpec

    dtype_name = "bfloat16" if cuda else "float32"
    cfg = smoke_config(batch, response_length, dtype_name, use_gpu=cuda,
                       extra=["actor.use_distributed_optimizer=true", "actor.param_offload=true",
                              "actor.grad_offload=true", "actor.optimizer_offload=true"])
    hf_dict = dict(config_to_dict(cfg)["model"]["hf_config"])
    spec = RoleSpec(cfg, "actor", cfg.trainer.total_steps)
    info = parallel.initialize_parallel(tp=1, pp=1, seed=1)
    torch.manual_seed(0)
    models = [build_gpt_model(hf_dict, dtype=getattr(torch, dtype_name), **spec.model_overrides) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())  # the twin: the same weights before any optimizer exists
    offloaded, twin = (MegatronEngine(m if cuda else m.cpu(), info, spec, vocab_size=hf_dict["vocab_size"])
                       for m in models)
    parts = spec.offload
    offloaded.offload(**parts)  # as after the worker's init
    freed, log_prob_diff = 0.0, 0.0
    for step in range(ROUND_TRIP_STEPS):
        rows = tiny_batch(batch, cfg.data.max_prompt_length, response_length, hf_dict["vocab_size"], seed=step)
        offloaded.reload(("params",))  # a forward phase needs the parameters only
        ours, theirs = offloaded.forward(rows), twin.forward(rows)  # None only off the last PP stage
        assert ours is not None and theirs is not None
        log_prob_diff = max(log_prob_diff, float((ours["log_probs"].float() - theirs["log_probs"].float()).abs().max()))
        offloaded.offload(**parts)
        offloaded.reload()
        offloaded.train_step(rows, _loss)
        twin.train_step(rows, _loss)
        before = torch.cuda.memory_allocated() if cuda else 0
        offloaded.offload(**parts)
        freed = float(before - torch.cuda.memory_allocated()) if cuda else 0.0
    offloaded.reload()
    rtol, atol = ROUND_TRIP_TOLERANCE[dtype_name]
    param_diff, param_misses = _state_gap(list(offloaded.module.parameters()), list(twin.module.parameters()),
                                          rtol, atol)
    ours_opt, twin_opt = _optimizer_tensors(offloaded.optimizer), _optimizer_tensors(twin.optimizer)
    opt_diff, opt_misses = _state_gap(ours_opt, twin_opt, rtol, atol)
    within = (param_misses == 0 and opt_misses == 0 and len(ours_opt) > 0
              and log_prob_diff <= atol + rtol * 10  # log-probs: a few nats at most, so rtol scaled by 10
              and (freed > 0 or not cuda))  # on CUDA the offload must really release device memory
    return {"dtype": dtype_name, "steps": ROUND_TRIP_STEPS, "offloaded": sorted(k for k, on in parts.items() if on),
            "device_bytes_freed": freed, "log_prob_max_diff": log_prob_diff, "param_max_diff": param_diff,
            "param_mismatches": param_misses, "optimizer_max_diff": opt_diff, "optimizer_mismatches": opt_misses,
            "optimizer_tensors": len(ours_opt), "rtol": rtol, "atol": atol, "within": within}


def compare(measured: float | None, planned: float | None) -> str:
    """``measured / planned`` as text (``-`` when either is missing or the plan is 0)."""
    if measured is None or not planned:
        return "-"
    return f"{measured / planned:.2f}"


def format_table(rows: list[PhaseResult]) -> str:
    """The result table: phase, seconds, measured MiB, planned MiB, ratio, note."""
    mib = lambda b: "-" if b is None else f"{b / 2**20:.2f}"  # noqa: E731
    lines = [f"{'phase':<26} {'s':>7} {'peak MiB':>10} {'plan MiB':>10} {'meas/plan':>9}  note"]
    for r in rows:
        lines.append(f"{r.phase:<26} {r.seconds:>7.2f} {mib(r.peak_bytes):>10} {mib(r.planned_bytes):>10} "
                     f"{compare(r.peak_bytes, r.planned_bytes):>9}  {r.note}")
    return "\n".join(lines)


def _timed(phase: str, device, fn: Callable[[], str], planned: dict[str, float]) -> PhaseResult:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    note = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    peak = float(torch.cuda.max_memory_allocated()) if device.type == "cuda" else None
    return PhaseResult(phase, time.perf_counter() - start, peak, planned.get(phase), note)


def run_smoke(args: argparse.Namespace) -> tuple[list[PhaseResult], list[str], dict, dict]:
    """Run the five phases, the memory section (with the sync-peak rehearsal), the offload
    round trip and the log-prob gap; returns the table rows, the failed checks (empty = pass),
    :func:`measure_memory`'s results and ``{"offload_round_trip", "log_prob_gap", "sync_peak"}``."""
    import torch
    import torch.distributed as dist
    from transformers import AutoConfig, AutoModelForCausalLM

    from megaflow.config.loader import config_to_dict
    from megaflow.megatron import parallel

    cuda = args.device == "cuda"
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    dtype_name = "bfloat16" if cuda else "float32"
    tol = 5e-2 if cuda else 1e-4  # bf16 vs fp32 log-prob agreement
    cfg = smoke_config(args.batch, args.response_length, dtype_name, use_gpu=cuda)
    planned = planned_bytes(cfg, args.batch)
    hf_dict = dict(config_to_dict(cfg)["model"]["hf_config"])
    prompt_len, resp_len = cfg.data.max_prompt_length, cfg.rollout.response_length
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    if cuda:
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    failures: list[str] = []
    state: dict = {}
    torch_dtype = getattr(torch, dtype_name)

    def build() -> str:
        from megaflow.megatron.engine import MegatronEngine
        from megaflow.megatron.model import build_gpt_model
        from megaflow.models.weights import load_hf_weights
        from megaflow.topology.role_spec import RoleSpec

        info = parallel.initialize_parallel(tp=1, pp=1, seed=1)
        torch.manual_seed(0)
        hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(**hf_dict), dtype=torch_dtype,
                                              attn_implementation="eager").to(device).eval()
        spec = RoleSpec(cfg, "actor", cfg.trainer.total_steps)  # what the actor worker reads
        model = build_gpt_model(hf_dict, dtype=torch_dtype, **spec.model_overrides)
        if not cuda:
            model = model.to(device)
        load_hf_weights(model, {k: v.detach().cpu() for k, v in hf.state_dict().items()}, hf_dict, info)
        engine = MegatronEngine(model, info, spec, vocab_size=hf_dict["vocab_size"])
        state.update(hf=hf, engine=engine, info=info)
        return f"{sum(p.numel() for p in model.parameters())} params, {dtype_name}, local spec"

    def batch() -> dict:
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(1, hf_dict["vocab_size"], (args.batch, prompt_len + resp_len), generator=g)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                "position_ids": torch.arange(ids.shape[1]).expand_as(ids).contiguous(),
                "responses": ids[:, prompt_len:], "response_mask": torch.ones(args.batch, resp_len),
                "advantages": torch.randn(args.batch, resp_len, generator=g)}

    def max_log_prob_diff() -> float:
        b = batch()
        ours = state["engine"].forward(b)["log_probs"]
        with torch.no_grad():
            logits = state["hf"](input_ids=b["input_ids"].to(device)).logits.float()
        ref = torch.log_softmax(logits[:, prompt_len - 1:-1], dim=-1).gather(
            -1, b["responses"].to(device).unsqueeze(-1)).squeeze(-1).cpu()
        return float((ours - ref).abs().max())

    def log_probs() -> str:
        diff = max_log_prob_diff()
        if not diff < tol:
            failures.append(f"log-probs differ from transformers by {diff:.3g} (tolerance {tol})")
        return f"max |diff| vs transformers {diff:.2e} (tol {tol})"

    def update() -> str:
        def loss(outputs, mb, den):
            mask = mb["response_mask"].float()
            return -(outputs["log_probs"] * mb["advantages"] * mask).sum() / den.num_tokens, {}

        metrics = state["engine"].train_step(batch(), loss)
        if not (metrics["update_successful"] and torch.isfinite(torch.tensor(metrics["grad_norm"]))):
            failures.append(f"update failed: {metrics}")
        return f"grad_norm {metrics['grad_norm']:.3g}"

    def reshard() -> str:
        from megaflow.hybrid_engine import MicroDPResharder, build_reshard_groups, plan_hybrid_layout
        from megaflow.models.hf_mapping import ModelSpec, find_mapping, hf_names, megatron_shards_to_hf

        module = state["engine"].module
        layout = plan_hybrid_layout(1, 1, 1, gen_tp=1, num_attention_heads=hf_dict["num_attention_heads"],
                                    num_query_groups=hf_dict["num_key_value_heads"])
        resharder = MicroDPResharder(build_reshard_groups(layout), dict(module.named_parameters()),
                                     share_embeddings_and_output_weights=module.share_embeddings_and_output_weights)
        hf_params = dict(state["hf"].named_parameters())
        loaded = 0
        spec = ModelSpec.from_hf_config(hf_dict)
        with resharder.generation() as stats, torch.no_grad():
            for megatron_name, shard in resharder.named_generation_tensors():  # t_g = 1: whole tensors
                row, layer = find_mapping(megatron_name, spec)
                if row.tied_hf and spec.tie_word_embeddings:
                    continue  # the HF model ties lm_head to the embedding itself
                shards = megatron_shards_to_hf(row, [shard], spec)
                for name, tensor in zip(hf_names(row, spec, layer), shards, strict=True):
                    hf_params[name].copy_(tensor)
                    loaded += 1
        if loaded != len(hf_params):
            failures.append(f"reshard loaded {loaded} of {len(hf_params)} HF tensors")
        diff = max_log_prob_diff()  # the HF model now holds the updated actor's weights
        if not diff < tol:
            failures.append(f"after the reshard the HF model's log-probs differ from the updated actor's by {diff:.3g}")
        return f"{loaded} tensors, {stats.num_aliased} aliased; updated actor vs HF {diff:.2e}"

    def generate() -> str:
        from megaflow.protocol import DataProto
        from megaflow.rollout.hf_rollout import HFRollout
        from megaflow.rollout.sampling import SamplingConfig

        g = torch.Generator().manual_seed(1)
        ids = torch.randint(1, hf_dict["vocab_size"], (args.batch // 2, prompt_len), generator=g)
        prompts = DataProto.from_dict({"input_ids": ids, "attention_mask": torch.ones_like(ids)},
                                      {"uid": [f"p{i}" for i in range(len(ids))]}, {})
        rollout = HFRollout(state["hf"], SamplingConfig(n=2, response_length=resp_len, temperature=1.0,
                                                        eos_token_ids=(), pad_token_id=0))
        out = rollout.generate_sequences(prompts)
        assert out.batch is not None
        got = tuple(out.batch["responses"].shape)
        if got != (args.batch, resp_len):
            failures.append(f"generate returned responses {got}, expected {(args.batch, resp_len)}")
        return f"responses {got}"

    rows = []
    try:
        for phase, fn in zip(PHASES, (build, log_probs, update, reshard, generate), strict=True):
            rows.append(_timed(phase, device, fn, planned))
        state.clear()
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        memory = measure_memory(cuda, args.mem_batch, args.mem_seq or (2048 if cuda else 32))
        for name, r in memory["phases"].items():
            if r["within_range"] is False:
                failures.append(f"memory {name}: measured / planned = {r['ratio']:.2f}, outside {RATIO_RANGE}")
        checks = {"sync_peak": memory.pop("sync_peak"),
                  "offload_round_trip": offload_round_trip(cuda, args.batch, args.response_length),
                  "log_prob_gap": log_prob_gap_check(hf_dict if not cuda else LLAMA_1B, device, enforce=cuda)}
        failures.extend(check_failures(checks))
    finally:
        parallel.destroy_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()
    return rows, failures, memory, checks


def check_failures(checks: dict) -> list[str]:
    """One line per failed check of sections 8-10 (``checks`` as :func:`run_smoke` returns it)."""
    failures = []
    trip, gap, sync = checks["offload_round_trip"], checks["log_prob_gap"], checks["sync_peak"]
    if not trip["within"]:
        failures.append(f"offload round trip: the offloaded engine differs from its twin after {trip['steps']} "
                        f"steps (log-probs {trip['log_prob_max_diff']:.3g}, params {trip['param_max_diff']:.3g} "
                        f"in {trip['param_mismatches']} tensors, optimizer {trip['optimizer_max_diff']:.3g} in "
                        f"{trip['optimizer_mismatches']} of {trip['optimizer_tensors']} tensors; rtol {trip['rtol']}, "
                        f"atol {trip['atol']}; {trip['device_bytes_freed'] / 2**20:.1f} MiB freed by the offload)")
    if gap["enforced"] and not gap["within"]:
        failures.append(f"log-prob gap: bf16 vs fp32 max |delta log p| {gap['max']:.3g} needs a verify_sync "
                        f"tolerance of {gap['implied_tolerance']}, above the {gap['tolerance']} in use")
    if not sync["within"]:
        failures.append(f"sync peak: {sync['measured_bytes'] / 2**20:.2f} MiB measured, above the "
                        f"{sync['bound_bytes'] / 2**20:.2f} MiB of weight_sync_peak_bytes (less the actor shard)")
    return failures


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.wheels:
        install_wheels(args.wheels, os.path.join(ROOT, ".smoke_site"))
    missing = missing_wheels()
    if missing:
        print(f"error: {', '.join(missing)} not importable; bring the wheel(s) and pass --wheels (see the docstring)",
              file=sys.stderr)
        return 2
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but torch.cuda.is_available() is False; use --device cpu --dry", file=sys.stderr)
        return 2
    start = time.perf_counter()
    device_index = device_index_check(args.device == "cuda")
    rows, failures, memory, checks = run_smoke(args)
    if device_index["status"] == "fail":
        failures.insert(0, f"device index: {device_index['reason']}")
    print(f"gpu_smoke: device={args.device} torch={torch.__version__} "
          f"({'dry CPU rehearsal' if args.dry else 'smoke check'}), {time.perf_counter() - start:.1f} s total")
    print(format_table(rows))
    print(f"device index (LOCAL_RANK=3, one visible GPU -> cuda:0): {device_index['status']}"
          + (f" ({device_index['reason']})" if device_index.get("reason") else ""))
    print(format_memory(memory))
    print(format_checks(checks))
    for f in failures:
        print("FAILED:", f)
    print("PASS" if not failures else f"{len(failures)} check(s) failed")
    if args.json:
        write_json(args.json, {
            "device": args.device, "dry": args.dry, "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else None,
            "seconds": time.perf_counter() - start, "phases": [dataclasses.asdict(r) for r in rows],
            "device_index": device_index, "memory": memory, **checks, "failures": failures,
            "passed": not failures})
    return 1 if failures else 0


def format_memory(memory: dict) -> str:
    """The memory section as text: per phase seconds, measured / planned MiB, ratio, tokens/s, TFLOP/s."""
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    lines = [f"random Llama, {memory['num_params']} params, {memory['dtype']}, {memory['batch']} x "
             f"{memory['seq']} tokens (target measured/planned {RATIO_RANGE[0]}-{RATIO_RANGE[1]})",
             f"  {'phase':<18} {'s':>7} {'peak MiB':>10} {'plan MiB':>10} {'ratio':>6} {'tokens/s':>10} {'TFLOP/s':>8}"]
    for name, r in memory["phases"].items():
        peak = None if r["peak_bytes"] is None else r["peak_bytes"] / 2**20
        lines.append(f"  {name:<18} {r['seconds']:>7.2f} {fmt(peak, '.1f'):>10} {r['planned_bytes'] / 2**20:>10.1f} "
                     f"{fmt(r['ratio'], '.2f'):>6} {fmt(r['tokens_per_s'], '.0f'):>10} "
                     f"{fmt(r['model_tflops'], '.3g'):>8}")
    return "\n".join(lines)


def format_checks(checks: dict) -> str:
    """Sections 8-10 as three lines."""
    trip, gap, sync = checks["offload_round_trip"], checks["log_prob_gap"], checks["sync_peak"]
    verdict = lambda ok: "pass" if ok else "FAIL"  # noqa: E731
    return "\n".join([
        f"offload round trip ({trip['dtype']}, distributed optimizer, {trip['steps']} steps, offloaded "
        f"{'+'.join(trip['offloaded'])}) vs twin: log-probs {trip['log_prob_max_diff']:.2e}, params "
        f"{trip['param_max_diff']:.2e}, optimizer {trip['optimizer_max_diff']:.2e} "
        f"({trip['optimizer_tensors']} tensors): {verdict(trip['within'])}",
        f"bf16 vs fp32 log-prob gap on {gap['device']} ({gap['tokens']} probe tokens): max {gap['max']:.3g}, mean "
        f"{gap['mean']:.3g}, p99 {gap['p99']:.3g}; implies tolerance {gap['implied_tolerance']}, in use "
        f"{gap['tolerance']}: {verdict(gap['within']) if gap['enforced'] else 'recorded'}",
        f"weight sync peak: {sync['measured_bytes'] / 2**20:.2f} MiB measured vs {sync['bound_bytes'] / 2**20:.2f} "
        f"MiB by weight_sync_peak_bytes (ratio {sync['ratio']:.2f}): {verdict(sync['within'])}"])


def write_json(path: str, results: dict) -> None:
    """Write ``results`` to ``path`` (its folder created)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    sys.exit(main())
