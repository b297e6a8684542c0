"""A single-machine run listens on 127.0.0.1 only (Ray and every process of a training run),
checked with the socket table."""
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

REPO = Path(__file__).resolve().parents[2]

# Start Ray the way the trainer does (megaflow.trainer.main.init_ray with the tiny recipe's
# ray section), create one actor (a worker process with its own gRPC server), then list
# every listening TCP socket of this process and its descendants.
_SCRIPT = textwrap.dedent("""
    import json, os, time
    import psutil, ray
    from megaflow.topology import load_run
    from megaflow.trainer.main import init_ray

    init_ray(load_run("tiny_arith_grpo", ["ray.num_cpus=1"]))

    @ray.remote(num_cpus=0)
    class Probe:
        def pid(self):
            return os.getpid()

    probe = Probe.remote()
    actor_pid = ray.get(probe.pid.remote())
    time.sleep(2)  # agents start their servers a moment after ray.init returns
    me = psutil.Process()
    procs = {p.pid: p for p in me.children(recursive=True)}
    procs[me.pid] = me
    rows = []
    for conn in psutil.net_connections(kind="inet"):
        if conn.status == psutil.CONN_LISTEN and conn.pid in procs:
            try:
                name = " ".join(procs[conn.pid].cmdline())[:200]
            except psutil.Error:
                name = "?"
            rows.append({"ip": conn.laddr.ip, "port": conn.laddr.port, "pid": conn.pid, "cmd": name})
    print("LISTEN " + json.dumps({"rows": rows, "actor_pid": actor_pid}), flush=True)
    ray.shutdown()
""")


def _is_loopback(ip: str) -> bool:
    import ipaddress

    addr = ipaddress.ip_address(ip)
    mapped = getattr(addr, "ipv4_mapped", None)
    return (mapped or addr).is_loopback


def test_every_ray_listener_is_on_loopback():
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("LISTEN "))
    report = json.loads(line.removeprefix("LISTEN "))
    rows = report["rows"]
    # Ray's own servers were seen: GCS, raylet and the probe actor's worker server at least.
    cmds = " ".join(r["cmd"] for r in rows)
    assert "gcs_server" in cmds and "raylet" in cmds, rows
    assert any(r["pid"] == report["actor_pid"] for r in rows), rows
    exposed = [r for r in rows if not _is_loopback(r["ip"])]
    assert exposed == [], exposed


def _listeners(root, seen: dict) -> None:
    """Add every listening TCP socket of ``root`` and its descendants to ``seen`` (key: ip, port, pid)."""
    import psutil

    try:
        procs = {p.pid: p for p in root.children(recursive=True)}
    except psutil.Error:
        return
    procs[root.pid] = root
    for conn in psutil.net_connections(kind="inet"):
        if conn.status == psutil.CONN_LISTEN and conn.pid in procs:
            key = (conn.laddr.ip, conn.laddr.port, conn.pid)
            if key not in seen:
                try:
                    seen[key] = " ".join(procs[conn.pid].cmdline())[:200]
                except psutil.Error:
                    seen[key] = "?"


def test_every_listener_of_a_training_run_is_on_loopback(tmp_path):
    # Every process of a one-step training run (controller, Ray, the workers with their
    # torch.distributed store and gloo pairs, vLLM), sampled while it runs.
    import time

    import psutil

    cmd = [sys.executable, "-m", "megaflow.trainer.main", "--recipe", "tiny_arith_grpo", "trainer.total_steps=2",
           f"trainer.output_dir={tmp_path}", "trainer.experiment_name=listeners", "trainer.save_freq=-1"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    root, seen = psutil.Process(proc.pid), {}
    deadline = time.monotonic() + 280
    while proc.poll() is None and time.monotonic() < deadline:
        _listeners(root, seen)
        time.sleep(0.5)
    if proc.poll() is None:
        proc.kill()
    err = proc.communicate()[1]
    assert proc.returncode == 0, err[-3000:]
    rows = [{"ip": ip, "port": port, "pid": pid, "cmd": cmd} for (ip, port, pid), cmd in seen.items()]
    cmds = " ".join(r["cmd"] for r in rows)
    assert "gcs_server" in cmds and "raylet" in cmds, rows
    assert any(r["cmd"].startswith("ray::") and "IDLE" not in r["cmd"] for r in rows), rows  # the workers' own
    exposed = [r for r in rows if not _is_loopback(r["ip"])]
    assert exposed == [], exposed
