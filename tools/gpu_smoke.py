"""A prepared single-GPU smoke check of the actor path (NOT YET RUN ON A GPU).

Target machine: one CUDA GPU, no network, Python 3.12 with CUDA torch 2.11 and
``transformers`` only (no megatron-core, vLLM, Transformer Engine or Ray), at most 64 MiB of
files brought along. megaflow is imported from this working tree (``sys.path``); the
missing pure-Python wheels are downloaded beforehand on a machine with network::

    pip download --no-deps --python-version 3.12 --only-binary=:all: \\
        megatron-core==0.16.1 tensordict==0.15.3 -d .whl/

(megatron-core for the model and optimizer, tensordict for megaflow's ``DataProto``; together
well under 64 MiB) and copied next to the tree. ``--wheels .whl`` installs them with
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
same config). Exit status 1 when a check fails. It is sized to finish in well under 8 minutes.

``--device cpu --dry`` runs the same code on the CPU (fp32, gloo, no memory statistics: the
memory column reads "-"); the tests run that path so the script is not dead code. It has not
been run on a GPU yet: no GPU was available to this task.
"""
from __future__ import annotations

import argparse
import dataclasses
import glob
import os
import subprocess
import sys
import time
from typing import Callable, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

RECIPE = "tiny_arith_grpo"
PHASES = ("build+load", "log-probs", "update (recompute=full)", "reshard t=t_g=1", "generate (HF)")


@dataclasses.dataclass
class PhaseResult:
    """One row of the table: ``seconds``, measured peak bytes (None on CPU), planner bytes."""

    phase: str
    seconds: float
    peak_bytes: Optional[float]
    planned_bytes: Optional[float]
    note: str = ""


def parse_args(argv=None) -> argparse.Namespace:
    """Command line (``--device``, ``--dry``, ``--wheels``, ``--batch``, ``--response-length``)."""
    parser = argparse.ArgumentParser(description="single-GPU smoke check of the actor path (see module docstring)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--dry", action="store_true", help="CPU rehearsal: fp32, gloo (needs --device cpu)")
    parser.add_argument("--wheels", default=None, help="folder of pip-downloaded wheels to install (--no-deps)")
    parser.add_argument("--batch", type=int, default=8, help="prompts per phase (default 8)")
    parser.add_argument("--response-length", type=int, default=4, help="generated tokens (default 4)")
    args = parser.parse_args(argv)
    if args.dry and args.device != "cpu":
        parser.error("--dry is the CPU rehearsal: use it with --device cpu")
    if args.batch < 2 or args.batch % 2:
        parser.error(f"--batch must be an even number >= 2 (rollout.n = 2), got {args.batch}")
    if args.response_length < 1:
        parser.error(f"--response-length must be >= 1, got {args.response_length}")
    if args.wheels is not None and not glob.glob(os.path.join(args.wheels, "*.whl")):
        parser.error(f"--wheels {args.wheels!r}: no .whl files there (see the pip download command in the docstring)")
    return args


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


def smoke_config(batch: int, response_length: int, dtype: str, use_gpu: bool):
    """The tiny recipe at world size 1, TP = PP = 1, full recomputation, one micro-batch."""
    from megaflow.topology import load_run

    prompts = batch // 2
    overrides = ["resources.procs_per_node=1", "actor.tp=1", "actor.pp=1", "rollout.tp=1", "rollout.n=2",
                 f"model.dtype={dtype}", "actor.recompute_granularity=full",
                 f"data.train_batch_size={prompts}", f"actor.ppo_mini_batch_size={prompts}",
                 f"actor.ppo_micro_batch_size_per_gpu={batch}", f"actor.log_prob_micro_batch_size_per_gpu={batch}",
                 f"rollout.response_length={response_length}", f"resources.use_gpu={str(use_gpu).lower()}"]
    if use_gpu:
        overrides.append("resources.gpu_memory_gib=80")
    return load_run(RECIPE, overrides)


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


def compare(measured: Optional[float], planned: Optional[float]) -> str:
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


def run_smoke(args: argparse.Namespace) -> tuple[list[PhaseResult], list[str]]:
    """Run the five phases; returns the table rows and the failed checks (empty = pass)."""
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
                for name, tensor in zip(hf_names(row, spec, layer), megatron_shards_to_hf(row, [shard], spec)):
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
        got = tuple(out.batch["responses"].shape)
        if got != (args.batch, resp_len):
            failures.append(f"generate returned responses {got}, expected {(args.batch, resp_len)}")
        return f"responses {got}"

    rows = []
    try:
        for phase, fn in zip(PHASES, (build, log_probs, update, reshard, generate)):
            rows.append(_timed(phase, device, fn, planned))
    finally:
        parallel.destroy_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()
    return rows, failures


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.wheels:
        install_wheels(args.wheels, os.path.join(ROOT, ".smoke_site"))
    try:
        import megatron.core  # noqa: F401
        import tensordict  # noqa: F401
    except ImportError as exc:
        print(f"error: {exc.name} is not importable; bring its wheel and pass --wheels (see the docstring)",
              file=sys.stderr)
        return 2
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but torch.cuda.is_available() is False; use --device cpu --dry", file=sys.stderr)
        return 2
    start = time.perf_counter()
    rows, failures = run_smoke(args)
    print(f"gpu_smoke: device={args.device} torch={torch.__version__} "
          f"({'dry CPU rehearsal' if args.dry else 'smoke check'}), {time.perf_counter() - start:.1f} s total")
    print(format_table(rows))
    for f in failures:
        print("FAILED:", f)
    print("PASS" if not failures else f"{len(failures)} check(s) failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
