"""The worker processes of a local Ray started the trainer's way (megaflow.trainer.main.init_ray):
normal priority, the run's environment, and Ray's prestarted workers reused as the job's actors."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]

# Start Ray with init_ray (2 CPUs: Ray prestarts 2 workers), wait until the prestarted workers
# are up (ray::IDLE), then create an actor and report its pid, niceness and environment.
_SCRIPT = textwrap.dedent("""
    import json, os, time
    import psutil, ray
    from megaflow.topology import load_run
    from megaflow.trainer.main import init_ray

    init_ray(load_run("tiny_arith_grpo", ["ray.num_cpus=2"]))
    me = psutil.Process()

    def idle_workers():
        found = set()
        for p in me.children(recursive=True):
            try:
                if p.cmdline()[:1] == ["ray::IDLE"]:
                    found.add(p.pid)
            except psutil.Error:
                pass
        return found

    deadline = time.monotonic() + 60
    while not idle_workers() and time.monotonic() < deadline:
        time.sleep(0.2)
    idle = idle_workers()

    @ray.remote(num_cpus=1)
    class Probe:
        def report(self):
            names = ("OMP_NUM_THREADS", "VLLM_LOGGING_LEVEL", "PYTHONWARNINGS")
            return os.getpid(), os.nice(0), {n: os.environ.get(n) for n in names}

    pid, nice, env = ray.get(Probe.remote().report.remote())
    print("REPORT " + json.dumps({"idle": sorted(idle), "pid": pid, "nice": nice, "env": env,
                                   "controller_omp": os.environ.get("OMP_NUM_THREADS")}), flush=True)
    ray.shutdown()
""")


def test_actors_are_prestarted_workers_at_nice_0_with_the_run_environment():
    env = {k: v for k, v in os.environ.items()
           if k not in ("RAY_worker_niceness", "OMP_NUM_THREADS", "VLLM_LOGGING_LEVEL")}
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=240,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("REPORT "))[7:])
    assert report["idle"], "Ray prestarted no worker"
    # the actor is one of the workers Ray had prestarted (the job has no runtime_env to mismatch)
    assert report["pid"] in report["idle"]
    assert report["nice"] == 0  # Ray's default worker_niceness is 15
    assert report["env"]["OMP_NUM_THREADS"] == "1" and report["env"]["VLLM_LOGGING_LEVEL"] == "ERROR"
    assert "ignore::FutureWarning" in report["env"]["PYTHONWARNINGS"]
    assert report["controller_omp"] is None  # the controller's own environment is unchanged
