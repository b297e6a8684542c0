"""megaflow's sbatch script on a real single-node Slurm cluster (slurmctld + slurmd + munged).

The fixture ``local_slurm`` (conftest.py) starts the daemons from Debian's ``slurm-wlm``
and ``munge`` packages; the tests are skipped when those are not installed. Each job runs
the full path of the generated script: Ray head via ``srun``, bounded wait for the
recipe's resources, controller, cleanup.
"""
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path

import pytest

from megaflow.launch.slurm import SlurmJob, SlurmSubmitError, write_sbatch
from megaflow.utils.launch import find_free_port

pytestmark = pytest.mark.slow

#: Flip to True once `make train` runs the tiny recipe end to end: the job then runs the
#: trainer with TRAINER_OVERRIDES instead of the probe, and the test checks its metrics file.
USE_TRAINER = True
TRAINER_OVERRIDES = ("trainer.total_steps=2", "trainer.test_freq=0", "trainer.save_freq=-1")

# The probe controller: connects through $RAY_ADDRESS (set by the script), runs one task on
# the cluster and writes what it saw.
PROBE = """
import json, os, socket, sys, ray
ray.init()
@ray.remote(num_cpus=1)
def task():
    return socket.gethostname(), os.getpid()
host, pid = ray.get(task.remote())
json.dump({"address": os.environ["RAY_ADDRESS"], "gcs": ray.get_runtime_context().gcs_address,
           "resources": ray.cluster_resources(), "alive_nodes": sum(n["Alive"] for n in ray.nodes()),
           "task_host": host, "task_pid": pid, "driver_pid": os.getpid()}, open(sys.argv[1], "w"))
"""


def make_job(job_dir: Path, **kw) -> SlurmJob:
    # Free ports so that the job's Ray never collides with the test session's own Ray.
    ports = [find_free_port() for _ in range(3)]
    return SlurmJob(recipe="tiny_arith_grpo", job_dir=job_dir, ray_port=ports[0], ray_client_server_port=ports[1],
                    ray_start_args=("--object-store-memory=200000000", f"--dashboard-agent-listen-port={ports[2]}"),
                    **kw)


def ray_processes_of(job_id: int) -> list[str]:
    """Command lines of live processes that belong to the job's Ray (its temp dir)."""
    marker = f"/tmp/megaflow-ray-{job_id}".encode()
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if marker in cmd:
            found.append(cmd.replace(b"\0", b" ").decode(errors="replace"))
    return found


def assert_ray_stopped(job_id: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while ray_processes_of(job_id) and time.monotonic() < deadline:
        time.sleep(1.0)
    assert ray_processes_of(job_id) == [], "Ray processes of the job survived it"


def read_logs(job_dir: Path, job_id: int) -> str:
    return (job_dir / f"slurm-{job_id}.out").read_text(errors="replace")


def assert_no_token_in_logs(job_dir: Path, job_id: int) -> None:
    log_dir = job_dir / "logs" / str(job_id)
    token = (log_dir / "ray_auth_token").read_text()
    assert len(token) == 64
    for path in [job_dir / f"slurm-{job_id}.out", *log_dir.glob("*.log")]:
        assert token not in path.read_text(errors="replace"), f"the Ray token leaked into {path}"


def test_job_starts_ray_runs_the_controller_and_stops_ray(local_slurm, tmp_path):
    job_dir = tmp_path / "ok"
    if USE_TRAINER:
        job = make_job(job_dir, overrides=TRAINER_OVERRIDES, wait_timeout_s=180)
    else:
        job = make_job(job_dir, wait_timeout_s=180, command=(sys.executable, "-c", PROBE, str(job_dir / "probe.json")))
    job_id = local_slurm.sbatch(write_sbatch(job))
    try:
        info = local_slurm.wait_job(job_id, timeout_s=1200 if USE_TRAINER else 420)
        logs = read_logs(job_dir, job_id)
        assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), logs + local_slurm.log_tails()
        assert "cluster ready after" in logs and "job finished with exit status 0" in logs
        if USE_TRAINER:
            from megaflow.utils.tracking import read_metrics_jsonl

            metrics = read_metrics_jsonl(job_dir / "outputs" / "megaflow" / "tiny_arith_grpo" / "metrics.jsonl")
            assert [m["step"] for m in metrics] == [1, 2]
        else:
            probe = json.loads((job_dir / "probe.json").read_text())
            assert probe["address"] == probe["gcs"] and probe["address"].endswith(f":{job.ray_port}")
            assert not probe["address"].startswith(("0.0.0.0", "127."))  # the node's address, not a wildcard
            # Ray got the CPUs Slurm allocated on the node (the whole node: --exclusive), one node.
            assert probe["resources"]["CPU"] == local_slurm.cpus and probe["alive_nodes"] == 1
            assert probe["task_pid"] != probe["driver_pid"]
        assert_no_token_in_logs(job_dir, job_id)
        assert_ray_stopped(job_id)
    finally:
        shutil.rmtree(f"/tmp/megaflow-ray-{job_id}", ignore_errors=True)


def test_job_short_of_cpus_fails_with_needed_and_joined_within_the_bound(local_slurm, tmp_path):
    job_dir = tmp_path / "short"
    # Two ranks x 2 CPUs = 4 CPUs on one node; the node (and so Ray) has 2.
    job = make_job(job_dir, overrides=("resources.num_cpus_per_proc=2",), wait_timeout_s=15,
                   command=(sys.executable, "-c", PROBE, str(job_dir / "probe.json")))
    job_id = local_slurm.sbatch(write_sbatch(job))
    try:
        info = local_slurm.wait_job(job_id, timeout_s=420)
        logs = read_logs(job_dir, job_id)
        assert (info["JobState"], info["ExitCode"]) == ("FAILED", "2:0"), logs
        assert "does not offer what run 'tiny_arith_grpo' needs" in logs
        waited = int(re.search(r"needs \(waited (\d+) s\)", logs).group(1))
        assert 15 <= waited <= 20  # the bounded wait, not a hang
        assert "needed: 1 node, each with 4 CPUs (4 CPUs in all)" in logs
        assert "pool 'global' (actor): 1 node x 2 ranks, each rank 2 CPUs" in logs
        assert f"joined: 1 node ({local_slurm.cpus} CPUs in all)" in logs
        assert "missing: 1 more node with 4 CPUs" in logs
        assert "error: the Ray cluster did not offer the recipe's resources (exit status 2)" in logs
        assert not (job_dir / "probe.json").exists()  # the controller never started
        assert_ray_stopped(job_id)
    finally:
        shutil.rmtree(f"/tmp/megaflow-ray-{job_id}", ignore_errors=True)


def test_more_nodes_than_the_cluster_has_is_refused_at_submission(local_slurm, tmp_path):
    script = write_sbatch(make_job(tmp_path / "big", overrides=("resources.nodes=2",)))
    assert "#SBATCH --nodes=2" in script.read_text()
    start = time.monotonic()
    with pytest.raises(SlurmSubmitError) as info:
        local_slurm.sbatch(script)
    assert time.monotonic() - start < 30  # refused at once, not left pending (PartitionNodeLimit)
    msg = str(info.value)
    assert "cannot run on this cluster: allocation failure: Requested node configuration is not available" in msg
    assert "(it asks for --job-name=megaflow-tiny_arith_grpo --nodes=2 --ntasks-per-node=1 --exclusive)" in msg
    assert local_slurm.queue() == []  # nothing was queued
