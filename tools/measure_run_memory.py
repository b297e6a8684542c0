"""Peak memory of a real training run, per process and per phase, beside the dry-run plan.

Starts ``python -m megaflow.trainer.main --recipe RECIPE OVERRIDES...`` and samples its whole
process tree (the controller, Ray's own processes, the Ray workers) every ``--period``
seconds from ``/proc``: each process's resident set (``VmRSS``, split into anonymous, file
and shared-memory pages) and its kernel-kept high-water mark (``VmHWM``, the exact peak
RSS of the process, however short). A Ray worker's process title names the method it runs
(``ray::WorkerHost.execute actor.update_actor``, set by
:meth:`megaflow.single_controller.host.WorkerHost.execute`), so each sample of a worker is attributed
to a phase of the step; the controller is the root process, Ray's helpers (GCS, raylet,
dashboard agents, log monitor) are the rest.

Printed (and written as JSON with ``--json``):

* per process: its peak RSS (the largest ``VmHWM`` seen) and, for workers, the largest
  RSS sampled during each phase (method);
* the peak of the RSS summed over the tree (what ``/usr/bin/time`` or a monitor would call
  the run's memory), the same sum of anonymous pages only (shared pages such as Ray's
  object store count once per process mapping them in the RSS sum), and how the peak
  splits into controller, Ray's processes and workers;
* the planner's figures for the same config (:func:`megaflow.dryrun.plan.build_plan`): the
  per-rank peak phase and the node total (:attr:`~megaflow.dryrun.plan.Plan.node_memory`),
  with the ratio measured / planned.

Usage::

    python tools/measure_run_memory.py --recipe smollm2_gsm8k_grpo [--json out.json] \\
        trainer.total_steps=1 trainer.test_freq=0 ...

CPU only (``/proc``, Linux). The run's own exit status is returned.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

GIB = 1024 ** 3
_STATUS_FIELDS = ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem")


def read_status(pid: int) -> dict[str, int] | None:
    """``/proc/PID/status`` memory fields in bytes (``_STATUS_FIELDS``), None if the process is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            text = f.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    out = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in _STATUS_FIELDS:
            out[key] = int(value.split()[0]) * 1024
    return out if "VmRSS" in out else None


def read_title(pid: int) -> str:
    """The process title (``/proc/PID/cmdline`` joined; Ray rewrites it per method)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return ""
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()


def descendants(root: int) -> list[int]:
    """``root`` and every process below it (from each process's ``PPid``), without forks that
    have not exec'd yet (a child with its parent's title: ``subprocess`` between fork and exec,
    whose RSS is the parent's copy-on-write pages, counted once already)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        title = read_title(pid)
        todo += [c for c in children.get(pid, []) if read_title(c) != title]
    return out


#: Ray's own Python processes that carry a ``ray::`` title.
_RAY_AGENTS = ("DashboardAgent", "RuntimeEnvAgent")
_RAY_METHOD = re.compile(r"^ray::([\w.]+)(?: ([\w.]+))?")


def classify(pid: int, root: int, title: str) -> tuple[str, str | None]:
    """(kind, phase): kind ``controller`` (the root), ``worker`` (a Ray actor or task process;
    phase = the method its title names, ``IDLE`` between tasks) or ``ray`` (Ray's helpers and
    agents)."""
    if pid == root:
        return "controller", None
    match = _RAY_METHOD.match(title)
    if match and match.group(1) in _RAY_AGENTS:
        return "ray", None
    if match:
        name = match.group(2) or match.group(1)  # megaflow's host appends "role.method"
        return "worker", name.split(".", 1)[1] if "." in name and not match.group(2) else name
    return "ray", None


@dataclass
class ProcessRecord:
    """What the sampler saw of one process."""

    pid: int
    kind: str
    name: str
    hwm: int = 0
    """Largest ``VmHWM`` seen: the process's exact peak RSS up to its last sample."""
    phases: dict[str, int] = field(default_factory=dict)
    """Worker: largest sampled RSS per phase (method)."""


@dataclass
class TreePeak:
    """The sample with the largest RSS summed over the tree."""

    rss: int = 0
    anon: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)
    worker_phases: dict[int, str] = field(default_factory=dict)
    peak_anon: int = 0
    """Largest anonymous-pages sum over the tree (any sample)."""


class TreeSampler:
    """Samples ``/proc`` for the tree under ``root`` every ``period`` s in a thread."""

    def __init__(self, root: int, period: float = 0.25) -> None:
        self.root, self.period = root, period
        self.processes: dict[int, ProcessRecord] = {}
        self.peak = TreePeak()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> TreeSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def sample(self) -> None:
        """One sample of every live process of the tree."""
        total = anon = 0
        kinds: dict[str, int] = {}
        phases: dict[int, str] = {}
        for pid in descendants(self.root):
            status, title = read_status(pid), read_title(pid)
            if status is None:
                continue
            kind, phase = classify(pid, self.root, title)
            rec = self.processes.get(pid)
            if rec is None or rec.kind != kind and kind == "worker":
                rec = self.processes[pid] = ProcessRecord(pid=pid, kind=kind, name=title[:100])
            rss = status["VmRSS"]
            rec.hwm = max(rec.hwm, status.get("VmHWM", rss))
            if phase is not None:
                rec.phases[phase] = max(rec.phases.get(phase, 0), rss)
                phases[pid] = phase
            total += rss
            anon += status.get("RssAnon", rss)
            kinds[kind] = kinds.get(kind, 0) + rss
        self.peak.peak_anon = max(self.peak.peak_anon, anon)
        if total > self.peak.rss:
            self.peak.rss, self.peak.anon, self.peak.by_kind, self.peak.worker_phases = total, anon, kinds, phases

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.period)


def planned(recipe: str, overrides: list[str]) -> dict:
    """The dry-run planner's figures (GiB) for the same recipe and overrides."""
    from megaflow.dryrun.plan import build_plan
    from megaflow.topology import load_run

    plan = build_plan(load_run(recipe, overrides))
    pools = {pool.placement.name: {phase.phase: phase.total / GIB for phase in pool.phases} for pool in plan.pools}
    rank_peak = max(pool.peak for pool in plan.pools)
    return {"rank_peak_gib": rank_peak / GIB, "node_gib": {str(n): b / GIB for n, b in plan.node_memory},
            "phases_gib": pools}


def run(recipe: str, overrides: list[str], period: float, timeout: float) -> tuple[int, TreeSampler, float]:
    """Run the trainer under the sampler; (exit status, sampler, seconds)."""
    cmd = [sys.executable, "-m", "megaflow.trainer.main", "--recipe", recipe, *overrides]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, start_new_session=True)
    sampler = TreeSampler(proc.pid, period).start()
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 15)
        rc = proc.wait()
    finally:
        sampler.stop()
    return rc, sampler, time.monotonic() - start


def report(sampler: TreeSampler, plan: dict) -> dict:
    """The measurement (and the plan beside it) as a JSON-able dict, GiB."""
    procs = sorted(sampler.processes.values(), key=lambda r: -r.hwm)
    workers = [r for r in procs if r.kind == "worker"]
    peak = sampler.peak
    return {
        "tree_peak_rss_gib": peak.rss / GIB,
        "tree_peak_anon_gib": peak.peak_anon / GIB,
        "tree_peak_by_kind_gib": {k: v / GIB for k, v in peak.by_kind.items()},
        "tree_peak_worker_phases": {str(k): v for k, v in peak.worker_phases.items()},
        "controller_peak_gib": max((r.hwm for r in procs if r.kind == "controller"), default=0) / GIB,
        "ray_processes_peak_sum_gib": sum(r.hwm for r in procs if r.kind == "ray") / GIB,
        "workers": [{"pid": r.pid, "peak_gib": r.hwm / GIB, "phases_gib": {p: b / GIB for p, b in r.phases.items()}}
                    for r in workers],
        "worker_peak_gib": max((r.hwm for r in workers), default=0) / GIB,
        "processes": [{"pid": r.pid, "kind": r.kind, "name": r.name, "peak_gib": r.hwm / GIB} for r in procs],
        "plan": plan,
    }


def format_report(rep: dict) -> str:
    lines = [f"tree peak RSS {rep['tree_peak_rss_gib']:.2f} GiB (anonymous pages {rep['tree_peak_anon_gib']:.2f} GiB)"
             f"; at the peak: " + ", ".join(f"{k} {v:.2f}" for k, v in rep["tree_peak_by_kind_gib"].items())
             + f"; worker phases {rep['tree_peak_worker_phases']}",
             f"controller peak {rep['controller_peak_gib']:.2f} GiB; Ray's processes (sum of peaks) "
             f"{rep['ray_processes_peak_sum_gib']:.2f} GiB"]
    for w in rep["workers"]:
        phases = ", ".join(f"{p} {b:.2f}" for p, b in sorted(w["phases_gib"].items(), key=lambda kv: -kv[1]))
        lines.append(f"worker {w['pid']}: peak {w['peak_gib']:.2f} GiB; largest RSS by phase: {phases}")
    for p in rep["processes"][:12]:
        lines.append(f"  {p['kind']:<10} {p['peak_gib']:6.2f} GiB  {p['name'][:80]}")
    plan = rep["plan"]
    lines.append(f"planned: rank peak {plan['rank_peak_gib']:.2f} GiB (measured worker peak / planned = "
                 f"{rep['worker_peak_gib'] / plan['rank_peak_gib']:.2f}); node "
                 + ", ".join(f"{n}: {g:.2f} GiB (measured tree peak / planned = {rep['tree_peak_rss_gib'] / g:.2f})"
                             for n, g in plan["node_gib"].items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", required=True)
    p.add_argument("--period", type=float, default=0.25, help="seconds between samples (default 0.25)")
    p.add_argument("--timeout", type=float, default=3600, help="kill the run after this many seconds")
    p.add_argument("--json", help="write the report here")
    p.add_argument("overrides", nargs="*", help="config overrides (key=value), as for megaflow.trainer.main")
    args = p.parse_args(argv)
    plan = planned(args.recipe, args.overrides)
    rc, sampler, seconds = run(args.recipe, args.overrides, args.period, args.timeout)
    rep = report(sampler, plan) | {"exit_status": rc, "seconds": seconds, "recipe": args.recipe,
                                   "overrides": args.overrides}
    print(format_report(rep))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rep, f, indent=1)
    return rc


if __name__ == "__main__":
    sys.exit(main())
