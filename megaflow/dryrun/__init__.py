"""The dry run: what a validated config will place where and how much memory each phase
needs, before any process starts (``make train DRY_RUN=1``).

    print(format_plan(build_plan(load_run("tiny_arith_grpo"))))

Modules: :mod:`~megaflow.dryrun.plan` (the planner), :mod:`~megaflow.dryrun.memory` (the
memory model), :mod:`~megaflow.dryrun.report` (the printed plan). It reads only
:mod:`megaflow.topology` and :mod:`megaflow.config`.
"""
from megaflow.dryrun.plan import Plan, PlanError, build_plan
from megaflow.dryrun.report import format_plan

__all__ = ["Plan", "PlanError", "build_plan", "format_plan"]
