"""A single-machine run's Ray listens on 127.0.0.1 only, checked with the socket table."""
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

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
