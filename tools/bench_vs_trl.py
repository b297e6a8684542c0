#!/usr/bin/env python3
"""megaflow vs TRL's GRPOTrainer on the same GRPO workload, side by side on the CPU.

The workload is built in process from fixed numbers and a seed (nothing from a hub):

* model: Llama architecture, vocab 512, intermediate 688, 8 heads, 4 KV heads, tied embeddings,
  fp32; ``3m`` = hidden 256 x 4 layers, ``15m`` = hidden 512 x 8 layers; seeded random init;
* tokenizer: a word-level tokenizer (specials, digits, '+', '=', ' ', filler tokens up to the vocab);
* data: prompts "A+B=" with A, B in [0, 99]; reward 1.0 iff the completion starts with A+B;
* step: 8 prompts x 4 samples, up to 32 response tokens (exactly 32 with ``--fixed-length``), one
  optimizer step (lr 1e-5 constant, no KL, clip 0.2, grad clip 1.0).
* LoRA (``--lora-rank R``): the LoRA row: both frameworks train rank-R adapters (alpha ``--lora-alpha``, no dropout)
  on every attention and MLP linear of the frozen base: TRL through ``peft`` (``GRPOTrainer(peft_config=...)``),
  megaflow through ``actor.lora`` (adapter-only sync to vLLM with ``--lora-sync adapter``). Rows are named
  ``<size>-lora<R>``.

Every run is a fresh process; TRL and megaflow alternate (``--repeats`` runs each). megaflow runs
through its own trainer (``megaflow.trainer.main.train``) with ``algorithm.rollout_correction.bypass``
(old log-probs = rollout log-probs: no old-log-prob forward) and ``rollout.cpu_kv_cache_auto``.
Printed per framework and size: median step time over the timed steps, its phases, start-up (process
start to the first step's start), peak memory (RSS summed over the run's process tree, sampled every
0.1 s), and megaflow / TRL ratios.

    python tools/bench_vs_trl.py --setup             # TRL's own venv at --trl-venv (default /tmp/trl-venv)
    python tools/bench_vs_trl.py                     # 3 repeats, sizes 3m,15m
    python tools/bench_vs_trl.py --quick             # 1 repeat, 3 steps (1 warm-up), 3m only
    python tools/bench_vs_trl.py --busy 1            # a loaded machine: one busy-loop process beside every run
    python tools/bench_vs_trl.py --lora-rank 8       # the LoRA row (TRL with peft, megaflow actor.lora)
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

T0 = time.perf_counter()
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _k, _v in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
               "TOKENIZERS_PARALLELISM": "false", "WANDB_DISABLED": "true", "TRL_EXPERIMENTAL_SILENCE": "1"}.items():
    os.environ.setdefault(_k, _v)

SIZES = {"3m": dict(hidden=256, layers=4), "15m": dict(hidden=512, layers=8)}
VOCAB, INTERMEDIATE, HEADS, KV_HEADS, MAX_POS = 512, 688, 8, 4, 256
PROMPTS_PER_STEP, NUM_GENERATIONS, RESPONSE_LENGTH, LR, MAX_OPERAND, NUM_PROMPTS = 8, 4, 32, 1e-5, 99, 512
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>"]
BASIC = [str(d) for d in range(10)] + ["+", "=", " "]
DATA_SOURCE = "bench_sum"
TRL_PACKAGES = ["trl", "transformers", "datasets", "accelerate", "peft"]
#: LoRA targets: megaflow's Megatron module names and the HF modules they cover (megaflow.models.peft_io).
LORA_TARGETS = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
LORA_HF_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
_LEADING_INT = re.compile(r"\d+")


# ------------------------------------------------------------------------------------------- workload
def word_tokenizer(vocab_size: int = VOCAB):
    """A ``PreTrainedTokenizerFast``: one token per special, digit, '+', '=', ' ', then ``<xN>`` fillers
    up to ``vocab_size`` (left padding, pad 0, eos 1, bos 2). Raises ValueError when the vocab is too small."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    base = SPECIALS + BASIC
    if vocab_size < len(base):
        raise ValueError(f"vocab size must be >= {len(base)}, got {vocab_size}")
    vocab = {t: i for i, t in enumerate(base + [f"<x{i}>" for i in range(vocab_size - len(base))])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"<x\d+>|\d|[+=]| |."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
                                   unk_token="<unk>", padding_side="left", model_max_length=4096)


def hf_config(size: str) -> dict:
    """The Llama config (a dict of ``LlamaConfig`` fields) of ``size`` ('3m' or '15m')."""
    s = SIZES[size]
    return dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=VOCAB, hidden_size=s["hidden"],
                intermediate_size=INTERMEDIATE, num_hidden_layers=s["layers"], num_attention_heads=HEADS,
                num_key_value_heads=KV_HEADS, max_position_embeddings=MAX_POS, tie_word_embeddings=True,
                rms_norm_eps=1e-6, rope_theta=10000.0, pad_token_id=0, eos_token_id=1, bos_token_id=2)


def problems(seed: int, num: int = NUM_PROMPTS) -> list[tuple[str, int]]:
    """``num`` seeded ("A+B=", A+B) pairs."""
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(num):
        a, b = rng.randint(0, MAX_OPERAND), rng.randint(0, MAX_OPERAND)
        out.append((f"{a}+{b}=", a + b))
    return out


def exact_sum(text: str, answer) -> float:
    """1.0 iff ``text`` starts with the decimal ``answer`` not followed by another digit."""
    m = _LEADING_INT.match(text)
    return 1.0 if m is not None and m.group(0) == str(int(answer)) else 0.0


def sum_reward(solution_str, ground_truth, extra_info=None, **kwargs) -> float:
    """megaflow scorer (``reward.functions`` signature: text, ground truth, extra info) of the bench's source."""
    return exact_sum(solution_str, ground_truth)


# ------------------------------------------------------------------------------------------- memory
class TreeRss:
    """Peak of the RSS summed over this process and all its descendants, sampled every ``period`` s."""

    def __init__(self, period: float = 0.1):
        import psutil

        self._psutil, self._period, self.peak_mb = psutil, period, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def sample(self) -> float:
        me = self._psutil.Process()
        total = 0
        for p in [me, *me.children(recursive=True)]:
            try:
                total += p.memory_info().rss
            except (self._psutil.NoSuchProcess, self._psutil.AccessDenied):
                pass
        return total / 2**20

    def _run(self):
        while not self._stop.is_set():
            self.peak_mb = max(self.peak_mb, self.sample())
            self._stop.wait(self._period)

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return self.peak_mb


# ------------------------------------------------------------------------------------------- runners
def run_trl(args) -> dict:
    """One TRL GRPOTrainer run (call in TRL's venv); returns per-step times and memory."""
    import warnings

    import torch
    import transformers
    from datasets import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    from trl import GRPOConfig, GRPOTrainer

    mem = TreeRss() if _has_psutil() else None
    tok = word_tokenizer()
    cfg = {k: v for k, v in hf_config(args.size).items() if k not in ("model_type", "architectures")}
    torch.manual_seed(args.seed)
    # transformers 5's stubs: LlamaConfig takes attn_implementation through **kwargs; .to is wrapped
    model = LlamaForCausalLM(LlamaConfig(**cfg, attn_implementation="sdpa")).to(torch.float32)  # type: ignore[call-arg,arg-type]
    rows = problems(args.seed)
    data = Dataset.from_dict({"prompt": [p for p, _ in rows], "answer": [a for _, a in rows]})

    def reward(completions, answer, **kw):
        return [exact_sum(t, a) for t, a in zip(completions, answer, strict=True)]

    steps, t = [], {}

    class Trainer(GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            s = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            t["gen"] = time.perf_counter() - s
            return out

    class Timer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            t.clear()
            t["start"] = time.perf_counter()

        def on_step_end(self, *a, **k):
            step = time.perf_counter() - t["start"]
            steps.append({"start_s": t["start"] - T0, "step_s": step, "phases": {"gen": t.get("gen", 0.0),
                                                                                  "train": step - t.get("gen", 0.0)}})

    work = tempfile.mkdtemp(prefix="bench_vs_trl_")
    conf = GRPOConfig(
        output_dir=os.path.join(work, "out"), use_cpu=True, bf16=False, fp16=False,
        per_device_train_batch_size=PROMPTS_PER_STEP * NUM_GENERATIONS, gradient_accumulation_steps=1,
        steps_per_generation=1, num_iterations=1, num_generations=NUM_GENERATIONS,
        max_completion_length=RESPONSE_LENGTH, learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.0, max_grad_norm=1.0, beta=0.0, epsilon=0.2, temperature=1.0,
        gradient_checkpointing=False, use_vllm=False, max_steps=args.warmup + args.steps, seed=args.seed,
        data_seed=args.seed, logging_strategy="no", save_strategy="no", eval_strategy="no", report_to="none",
        disable_tqdm=True, log_completions=False, dataloader_num_workers=0,
        generation_kwargs={"min_new_tokens": RESPONSE_LENGTH} if args.fixed_length else None)
    peft_config = None
    if getattr(args, "lora_rank", 0):
        from peft import LoraConfig

        peft_config = LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha, lora_dropout=0.0,
                                 target_modules=LORA_HF_TARGETS, bias="none", task_type="CAUSAL_LM")
    trainer = Trainer(model=model, reward_funcs=[reward], args=conf, train_dataset=data, processing_class=tok,
                      callbacks=[Timer()], peft_config=peft_config)
    trainer.train()
    return {"framework": f"trl {_version('trl')}", "steps": steps,
            "peak_mb": mem.stop() if mem else _self_peak_mb(), "torch_threads": torch.get_num_threads()}


def megaflow_config(args, work: str):
    """The megaflow :class:`~megaflow.config.Config` of the workload (tokenizer and data written to ``work``)."""
    sys.path.insert(0, ROOT)
    from megaflow.topology import run_from_dict

    tok_dir = os.path.join(work, "tokenizer")
    word_tokenizer().save_pretrained(tok_dir)
    train = os.path.join(work, "train.jsonl")
    with open(train, "w") as f:
        for i, (prompt, answer) in enumerate(problems(args.seed)):
            f.write(json.dumps({"data_source": DATA_SOURCE, "prompt": prompt, "ability": "arithmetic",
                                "reward_model": {"style": "rule", "ground_truth": str(answer)},
                                "extra_info": {"index": i}}) + "\n")
    # one micro-batch per DP rank: the whole step's rows, split over dp = procs / tp (pp = 1)
    dp = max(1, args.procs // args.tp)
    rows_per_rank = PROMPTS_PER_STEP * NUM_GENERATIONS // dp
    rollout = {"tp": args.gen_tp, "n": NUM_GENERATIONS, "response_length": RESPONSE_LENGTH, "temperature": 1.0,
               "cpu_kv_cache_auto": not args.kv_cache_gib, "ignore_eos": bool(args.fixed_length)}
    if args.kv_cache_gib:
        rollout["cpu_kv_cache_gib"] = args.kv_cache_gib
    tree = {
        "model": {"hf_config": hf_config(args.size), "tokenizer": tok_dir, "dtype": "float32"},
        "data": {"train_files": [train], "max_prompt_length": 8, "train_batch_size": PROMPTS_PER_STEP,
                 "apply_chat_template": False, "seed": args.seed},
        "algorithm": {"adv_estimator": "grpo", "norm_adv_by_std": True, "use_kl_in_reward": False,
                      "use_kl_loss": False, "rollout_correction": {"bypass": True}},
        "actor": {"tp": args.tp, "pp": 1, "ppo_mini_batch_size": PROMPTS_PER_STEP, "ppo_epochs": 1,
                  "ppo_micro_batch_size_per_gpu": rows_per_rank,
                  "log_prob_micro_batch_size_per_gpu": rows_per_rank,
                  "optim": {"lr": LR, "weight_decay": 0.0, "clip_grad": 1.0, "lr_warmup_steps": 0},
                  "clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "loss_agg_mode": "token-mean",
                  "entropy_coeff": 0.0},
        "rollout": rollout,
        "reward": {"functions": {DATA_SOURCE: "bench_vs_trl:sum_reward"}},
        "trainer": {"total_steps": args.warmup + args.steps, "test_freq": 0, "save_freq": -1,
                    "logger": ["jsonl"], "output_dir": os.path.join(work, "out"), "project_name": "bench",
                    "experiment_name": "run", "seed": args.seed},
        "resources": {"nodes": 1, "procs_per_node": args.procs, "num_cpus_per_proc": args.cpus_per_proc,
                      "use_gpu": False},
    }
    if getattr(args, "lora_rank", 0):
        tree["actor"]["lora"] = {"rank": args.lora_rank, "alpha": args.lora_alpha, "dropout": 0.0,
                                 "target_modules": LORA_TARGETS, "sync": args.lora_sync}
    return run_from_dict(tree)


def run_megaflow(args) -> dict:
    """One megaflow run through ``megaflow.trainer.main.train``; returns per-step times and memory.

    Garbage collection is paused from here, before the config and its imports, as
    ``python -m megaflow.trainer.main`` (``make train``) pauses it before its own
    (:mod:`megaflow.utils.startup_gc`); ``train`` resumes it once the workers are ready."""
    sys.path.insert(0, HERE)  # the reward function: bench_vs_trl:sum_reward
    from megaflow.utils import startup_gc

    startup_gc.pause()
    mem = TreeRss()
    work = tempfile.mkdtemp(prefix="bench_vs_trl_mf_")
    cfg = megaflow_config(args, work)
    from megaflow.trainer.main import train
    from megaflow.utils import tracking
    from megaflow.utils.tracking import read_metrics_jsonl

    # start-up ends where the first step starts, as TRL's on_step_begin marks it: the first
    # logged step's end (the tracker logs right after the step) minus that step's time
    first_start: list[float] = []
    log = tracking.Tracking.log

    def log_first_step(self, metrics, step):
        if not first_start and "timing_s/step" in metrics:
            first_start.append(time.perf_counter() - float(metrics["timing_s/step"]) - T0)
        return log(self, metrics, step)

    tracking.Tracking.log = log_first_step  # type: ignore[method-assign]  # a timing hook for this run only
    t_train = time.perf_counter()
    try:
        train(cfg)
    finally:
        tracking.Tracking.log = log  # type: ignore[method-assign]  # restored
    end = time.perf_counter()
    records = read_metrics_jsonl(os.path.join(work, "out", "bench", "run", "metrics.jsonl"))
    steps = []
    for rec in sorted(records, key=lambda r: r["step"]):
        step = float(rec["timing_s/step"])
        steps.append({"step_s": step, "phases": {k.split("/", 1)[1]: float(v) for k, v in rec.items()
                                                 if k.startswith("timing_s/") and k != "timing_s/step"}})
    for s in steps:
        s["start_s"] = first_start[0]
    return {"framework": "megaflow", "steps": steps, "peak_mb": mem.stop(), "train_call_s": end - t_train}


def _has_psutil() -> bool:
    try:
        import psutil  # noqa: F401
        return True
    except ImportError:
        return False


def _self_peak_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _version(pkg: str) -> str:
    import importlib.metadata as md

    try:
        return md.version(pkg)
    except md.PackageNotFoundError:
        return "?"


# ------------------------------------------------------------------------------------------- driver
def setup_trl(venv: str) -> None:
    """Create TRL's venv: python3.11 -m venv, torch==2.13.0 alone first (the CPU wheel), then TRL."""
    pip = os.path.join(venv, "bin", "pip")
    if not os.path.exists(pip):
        subprocess.run(["python3.11", "-m", "venv", venv], check=True)
    subprocess.run([pip, "install", "torch==2.13.0"], check=True)
    subprocess.run([pip, "install", *TRL_PACKAGES, "psutil"], check=True)


def summarize(runs: list[dict], warmup: int) -> dict:
    """Medians over the timed steps of all runs (the first ``warmup`` steps of each run dropped)."""
    timed = [s for r in runs for s in r["steps"][warmup:]]
    phases = sorted({k for s in timed for k in s["phases"]})
    return {"step_s": statistics.median(s["step_s"] for s in timed),
            "phases": {k: statistics.median(s["phases"].get(k, 0.0) for s in timed) for k in phases},
            "startup_s": statistics.median(r["steps"][0]["start_s"] for r in runs),
            "peak_mb": max(r["peak_mb"] for r in runs), "runs": len(runs), "steps": len(timed),
            "run_medians": [statistics.median(s["step_s"] for s in r["steps"][warmup:]) for r in runs]}


def child(args, framework: str, size: str, out: str) -> subprocess.CompletedProcess:
    py = os.path.join(args.trl_venv, "bin", "python") if framework == "trl" else sys.executable
    cmd = [py, os.path.abspath(__file__), "--_child", framework, "--_size", size, "--_out", out,
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--seed", str(args.seed),
           "--tp", str(args.tp), "--gen-tp", str(args.gen_tp), "--procs", str(args.procs),
           "--cpus-per-proc", str(args.cpus_per_proc),
           "--kv-cache-gib", str(args.kv_cache_gib), "--lora-rank", str(args.lora_rank),
           "--lora-alpha", str(args.lora_alpha), "--lora-sync", args.lora_sync]
    if args.fixed_length:
        cmd.append("--fixed-length")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, HERE])) if framework == "megaflow" else None
    return subprocess.run(cmd, env=env, timeout=args.timeout)


@contextlib.contextmanager
def busy_processes(count: int):
    """``count`` processes spinning a CPU each at normal priority for the ``with`` block: the
    load of another job on the machine, met alike by both frameworks' runs."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--setup", action="store_true", help="install TRL into --trl-venv, then exit")
    p.add_argument("--trl-venv", default="/tmp/trl-venv", help="TRL's venv (default /tmp/trl-venv)")
    p.add_argument("--sizes", default="3m,15m", help="comma-separated: 3m, 15m (default both)")
    p.add_argument("--repeats", type=int, default=3, help="fresh runs per framework and size (default 3)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per run (default 5)")
    p.add_argument("--warmup", type=int, default=1, help="untimed first steps per run (default 1)")
    p.add_argument("--quick", action="store_true", help="smoke test: 1 repeat, 1 warm-up + 2 steps, 3m")
    p.add_argument("--fixed-length", action="store_true", help="every response exactly 32 tokens in both")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tp", type=int, default=2, help="megaflow actor.tp (default 2)")
    p.add_argument("--gen-tp", type=int, default=1, help="megaflow rollout.tp (default 1)")
    p.add_argument("--procs", type=int, default=2, help="megaflow resources.procs_per_node (default 2)")
    p.add_argument("--cpus-per-proc", type=int, default=1,
                   help="megaflow resources.num_cpus_per_proc: CPUs and torch threads per process (default 1)")
    p.add_argument("--kv-cache-gib", type=int, default=0,
                   help="megaflow rollout.cpu_kv_cache_gib; 0 (default): rollout.cpu_kv_cache_auto")
    p.add_argument("--timeout", type=float, default=900, help="seconds per run before it is killed")
    p.add_argument("--busy", type=int, default=0,
                   help="busy-loop processes (normal priority) running beside every run: a loaded machine")
    p.add_argument("--lora-rank", type=int, default=0,
                   help="the LoRA row: rank-R adapters in both frameworks (TRL with peft); 0 (default): full training")
    p.add_argument("--lora-alpha", type=float, default=16.0, help="LoRA alpha (scale alpha / rank; default 16)")
    p.add_argument("--lora-sync", choices=["merged", "adapter"], default="adapter",
                   help="megaflow actor.lora.sync with --lora-rank (default adapter)")
    p.add_argument("--json", help="write the summaries here")
    p.add_argument("--_child", choices=["trl", "megaflow"], help=argparse.SUPPRESS)
    p.add_argument("--_size", help=argparse.SUPPRESS)
    p.add_argument("--_out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args._child:
        args.size = args._size
        res = (run_trl if args._child == "trl" else run_megaflow)(args)
        with open(args._out, "w") as f:
            json.dump(res, f)
        return 0
    if args.setup:
        setup_trl(args.trl_venv)
        return 0
    if args.quick:
        args.repeats, args.steps, args.warmup, args.sizes = 1, 2, 1, "3m"
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    bad = [s for s in sizes if s not in SIZES]
    if bad or not sizes:
        p.error(f"--sizes: unknown {bad or sizes}; choose from {sorted(SIZES)}")
    if args.repeats < 1 or args.steps < 1 or args.warmup < 0 or args.kv_cache_gib < 0 or args.busy < 0:
        p.error("--repeats and --steps must be >= 1, --warmup, --kv-cache-gib and --busy >= 0")
    if args.lora_rank < 0 or (args.lora_rank and not args.lora_alpha > 0):
        p.error(f"--lora-rank must be >= 0 and --lora-alpha > 0, got {args.lora_rank} and {args.lora_alpha}")
    sys.path.insert(0, ROOT)
    from megaflow.config.typed import ConfigError

    for size in sizes:  # megaflow's settings are checked before any run starts
        args.size = size
        try:
            with tempfile.TemporaryDirectory(prefix="bench_vs_trl_check_") as work:
                megaflow_config(args, work)
        except ConfigError as exc:
            p.error(f"megaflow's config for --tp {args.tp} --gen-tp {args.gen_tp} --procs {args.procs}: {exc}")
    if not os.path.exists(os.path.join(args.trl_venv, "bin", "python")):
        p.error(f"--trl-venv: no python in {args.trl_venv}; run with --setup first")
    with busy_processes(args.busy):
        results = compare(args, sizes)
    if results is None:
        return 1
    print("\nmedians over timed steps (megaflow/TRL ratio); memory = peak RSS summed over the process tree"
          + (f"; {args.busy} busy-loop process(es) beside every run" if args.busy else ""))
    print(f"{'size':<5} {'framework':<9} {'step_s':>7} {'startup_s':>9} {'peak_MB':>8}  phases (s)")
    for size, res in results.items():
        size = f"{size}-lora{args.lora_rank}" if args.lora_rank else size
        for fw in ("trl", "megaflow"):
            s = res[fw]
            ph = ", ".join(f"{k} {v:.3f}" for k, v in s["phases"].items())
            print(f"{size:<5} {fw:<9} {s['step_s']:7.3f} {s['startup_s']:9.1f} {s['peak_mb']:8.0f}  {ph}")
        t, m = res["trl"], res["megaflow"]
        print(f"{size:<5} {'ratio':<9} {m['step_s'] / t['step_s']:6.2f}x {m['startup_s'] / t['startup_s']:8.2f}x "
              f"{m['peak_mb'] / t['peak_mb']:7.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


def compare(args, sizes: list[str]) -> dict | None:
    """``args.repeats`` fresh runs of each framework per size, alternating; size -> framework ->
    summary, or None when a framework produced no run of a size."""
    results: dict = {}
    for size in sizes:
        runs: dict[str, list[Any]] = {"trl": [], "megaflow": []}
        for r in range(args.repeats):
            for fw in ("trl", "megaflow"):
                fd, out = tempfile.mkstemp(suffix=".json")
                os.close(fd)
                try:
                    proc = child(args, fw, size, out)
                except subprocess.TimeoutExpired:
                    print(f"{size} run {r} {fw}: killed after {args.timeout:.0f} s", file=sys.stderr)
                    continue
                if proc.returncode != 0:
                    print(f"{size} run {r} {fw}: failed with exit code {proc.returncode}", file=sys.stderr)
                    continue
                with open(out) as f:
                    res = json.load(f)
                os.unlink(out)
                runs[fw].append(res)
                s = summarize([res], args.warmup)
                print(f"{size} run {r} {fw}: median step {s['step_s']:.3f} s, start-up {s['startup_s']:.1f} s, "
                      f"peak {s['peak_mb']:.0f} MB", flush=True)
        if not runs["trl"] or not runs["megaflow"]:
            print(f"{size}: a framework produced no run", file=sys.stderr)
            return None
        results[size] = {fw: summarize(v, args.warmup) for fw, v in runs.items()}
    return results


if __name__ == "__main__":
    sys.exit(main())
