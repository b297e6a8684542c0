#!/usr/bin/env python
"""Check that a change leaves training numerics where they were: the reward sequence of a
recipe, bit for bit, at the working tree and at a git revision.

::

    .venv/bin/python tools/check_reward_sequence.py --base 8a5e5ba --steps 10
    .venv/bin/python tools/check_reward_sequence.py                  # working tree vs HEAD, 20 steps
    .venv/bin/python tools/check_reward_sequence.py --base main -- rollout.n=4   # extra overrides for both

Both sides run ``python -m megaflow.trainer.main --recipe <recipe> trainer.total_steps=<N>``
(the same overrides, the recipe's fixed seed or ``--seed``), one after the other, each in
a fresh process with its own local Ray. The revision runs from a temporary
``git worktree add`` checkout with the same virtual environment; its source comes first
on ``PYTHONPATH``, so the controller and the Ray workers import the revision's megaflow.
The per-step ``critic/score/mean`` values of the two ``metrics.jsonl`` files are then
compared with ``==`` (no tolerance).

Exit status: 0 identical, 1 different (the first differing step and both values are
printed), 2 bad arguments or a run that failed (its log's tail is printed).
"""
from __future__ import annotations

import argparse
import math
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
METRIC = "critic/score/mean"


def first_difference(base: Mapping[int, float], head: Mapping[int, float], steps: int
                     ) -> tuple[int, float | None, float | None] | None:
    """The first step in ``1..steps`` whose ``base`` and ``head`` values differ.

    Values are compared exactly (two NaNs count as equal); a step missing on one side is
    a difference (its value is None there).

    Returns:
        ``(step, base value, head value)``, or None when all ``steps`` steps agree.
    """
    for step in range(1, steps + 1):
        a, b = base.get(step), head.get(step)
        same = a is not None and b is not None and (a == b or (math.isnan(a) and math.isnan(b)))
        if not same:
            return step, a, b
    return None


def reward_sequence(metrics_jsonl: Path) -> dict[int, float]:
    """``{step: critic/score/mean}`` of one run's ``metrics.jsonl`` (records of a step merged)."""
    from megaflow.utils.tracking import read_metrics_jsonl

    return {int(r["step"]): float(r[METRIC]) for r in read_metrics_jsonl(metrics_jsonl) if METRIC in r}


def _python() -> str:
    venv = REPO / ".venv" / "bin" / "python"
    return str(venv) if venv.exists() else sys.executable


def run_recipe(tree: Path, out_dir: Path, args: argparse.Namespace, label: str) -> Path:
    """Train ``args.recipe`` for ``args.steps`` steps with the source of ``tree``; returns
    the run's ``metrics.jsonl``.

    Raises:
        RuntimeError: the run exited non-zero or wrote no metrics (the log's tail included).
    """
    name = f"reward_seq_{label}"
    cmd = [_python(), "-m", "megaflow.trainer.main", "--recipe", args.recipe, f"trainer.total_steps={args.steps}",
           f"trainer.output_dir={out_dir}", f"trainer.experiment_name={name}"]
    if args.seed is not None:
        cmd.append(f"trainer.seed={args.seed}")
    cmd += list(args.overrides)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    log = out_dir / f"{label}.log"
    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"[check_reward_sequence] {label}: {' '.join(cmd[1:])} (in {tree})", flush=True)
    with open(log, "w") as f:
        rc = subprocess.run(cmd, cwd=tree, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    found = sorted(out_dir.glob(f"*/{name}/metrics.jsonl"))
    if rc != 0 or not found:
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-30:])
        raise RuntimeError(f"the {label} run exited with status {rc}{'' if found else ' and wrote no metrics'}; "
                           f"last lines of {log}:\n{tail}")
    return found[0]


def _resolve(rev: str) -> str:
    out = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"],
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise ValueError(f"--base {rev!r} is not a commit of {REPO}")
    return out.stdout.strip()


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="check_reward_sequence.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default="HEAD", help="git revision to compare the working tree with (default HEAD)")
    p.add_argument("--steps", type=int, default=20, help="training steps per run (default 20)")
    p.add_argument("--recipe", default="tiny_arith_grpo", help="recipe of both runs (default tiny_arith_grpo)")
    p.add_argument("--seed", type=int, default=None, help="trainer.seed of both runs (default: the recipe's)")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory (runs' outputs and logs)")
    p.add_argument("overrides", nargs="*", help="key=value overrides for both runs (after --)")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps must be >= 1, got {args.steps}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        commit = _resolve(args.base)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="megaflow_reward_seq_"))
    base_tree = tmp / "base"
    try:
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "--quiet", str(base_tree), commit],
                       check=True)
        try:
            head = reward_sequence(run_recipe(REPO, tmp / "out", args, "working_tree"))
            base = reward_sequence(run_recipe(base_tree, tmp / "out", args, f"base_{commit[:8]}"))
        except RuntimeError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(base_tree)], check=False)
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    diff = first_difference(base, head, args.steps)
    if diff is not None:
        step, a, b = diff
        print(f"DIFFERENT: {METRIC} first differs at step {step}: {args.base} ({commit[:8]}) {a!r}, "
              f"working tree {b!r}")
        return 1
    print(f"IDENTICAL: {METRIC} over {args.steps} steps of {args.recipe} equals {args.base} ({commit[:8]}) bit for bit")
    return 0


if __name__ == "__main__":
    sys.exit(main())
