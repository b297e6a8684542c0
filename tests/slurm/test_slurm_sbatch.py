"""The generated sbatch script: directives, settings, and its run under fake srun/scontrol.

The script is executed by bash with ``srun`` and ``scontrol`` replaced by small fakes that
record their arguments, so the order of the steps, the Ray head/worker start lines, the
address binding and the cleanup on success, failure and SIGTERM are checked without Slurm
(the real single-node Slurm test is test_slurm_cluster.py).
"""
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from megaflow.launch.resources import launch_requirements
from megaflow.launch.slurm import SlurmJob, check_job, main as slurm_main, render_sbatch, write_sbatch
from megaflow.topology import load_run

FAKE_SRUN = r"""#!/bin/bash
args="$*"
echo "srun $args" >> "$FAKE_LOG"
case "$args" in
  *"megaflow.launch.node ip"*) echo 10.0.0.1 ;;
  *"megaflow.launch.node head"*|*"megaflow.launch.node worker"*)
    kind=$([[ $args == *" head "* ]] && echo head || echo worker)
    trap 'kill $child 2>/dev/null; echo "TERM ray-$kind" >> "$FAKE_LOG"; exit 0' TERM
    sleep 1000 & child=$!; wait ;;
  *"megaflow.launch.wait"*) exit "${FAKE_WAIT_RC:-0}" ;;
  *"megaflow.trainer.main"*)
    trap 'kill $child 2>/dev/null; echo "TERM controller" >> "$FAKE_LOG"; exit 143' TERM
    echo "controller output"
    sleep "${FAKE_CONTROLLER_S:-0}" & child=$!; wait
    exit "${FAKE_CONTROLLER_RC:-0}" ;;
esac
"""
FAKE_SCONTROL = """#!/bin/bash
[[ "$1 $2" == "show hostnames" ]] && printf 'gpu%02d\\n' 1 2 3 4 5 6 7 8
"""


def job_70b(tmp_path, **kw):
    kw = {"partition": "gpu", "account": "proj", "time": "2-00:00:00", **kw}
    return SlurmJob(recipe="llama70b_ppo", job_dir=tmp_path / "job", **kw)


def directives(text):
    return [line.removeprefix("#SBATCH ") for line in text.splitlines() if line.startswith("#SBATCH ")]


def settings(text, tmp_path):
    """Evaluate the generated settings block in bash; return arrays/vars as Python values."""
    block = text.split("# ---- settings (generated)")[1].split("# ---- end of settings")[0]
    script = tmp_path / "settings.sh"
    script.write_text(block + '\nprintf "%s\\n" "${OVERRIDES[@]}" ---- "${CONTROLLER[@]}" ---- '
                      '"$GPUS_PER_NODE" "$CPUS_PER_NODE" "$DASHBOARD" "$DASHBOARD_HOST" "$WAIT_TIMEOUT_S"\n')
    out = subprocess.run(["bash", str(script)], capture_output=True, text=True, check=True).stdout
    overrides, controller, rest = out.rstrip("\n").split("\n----\n")
    return overrides.split("\n"), controller.split("\n"), rest.split("\n")


def test_directives_for_the_70b_recipe(tmp_path):
    text = render_sbatch(job_70b(tmp_path))
    job_dir = tmp_path / "job"
    assert directives(text) == [
        "--job-name=megaflow-llama70b_ppo", "--nodes=8", "--ntasks-per-node=1", f"--output={job_dir}/slurm-%j.out",
        f"--error={job_dir}/slurm-%j.out", "--exclusive", "--gpus-per-node=8", "--partition=gpu",
        "--account=proj", "--time=2-00:00:00"]
    # Slurm reads #SBATCH lines only before the first command.
    lines = text.splitlines()
    first_command = next(i for i, line in enumerate(lines) if line.strip() and not line.startswith("#"))
    assert max(i for i, line in enumerate(lines) if line.startswith("#SBATCH")) < first_command
    assert not re.search(r"@[A-Z_]+@", text)


def test_settings_quote_overrides_and_default_to_safe_binding(tmp_path):
    job = job_70b(tmp_path, overrides=("model.path=/models/my llama 70b", "trainer.total_epochs=2"),
                  cpus_per_node=96)
    text = render_sbatch(job)
    overrides, controller, (gpus, cpus, dashboard, dashboard_host, timeout) = settings(text, tmp_path)
    out_dir = f"trainer.output_dir={tmp_path / 'job' / 'outputs'}"
    assert overrides == [out_dir, "model.path=/models/my llama 70b", "trainer.total_epochs=2"]
    assert controller[1:] == ["-m", "megaflow.trainer.main", "--recipe", "llama70b_ppo", *overrides]
    assert (gpus, cpus, dashboard, dashboard_host) == ("8", "96", "false", "127.0.0.1")
    assert float(timeout) == load_run("llama70b_ppo").ray.resource_wait_timeout_s
    assert "--cpus-per-task=96" in directives(text) and "--exclusive" not in directives(text)
    assert "0.0.0.0" not in text and "set -x" not in text
    assert not re.search(r"^\s*(env|printenv|export -p|set)\s*$", text, re.M)  # never dump the environment


def test_bash_syntax_and_shellcheck(tmp_path):
    script = write_sbatch(job_70b(tmp_path, image="registry/megaflow:gpu", dashboard=True))
    subprocess.run(["bash", "-n", str(script)], check=True)
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck not installed (apt-get install shellcheck)")
    proc = subprocess.run(["shellcheck", "-s", "bash", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


def run_script(tmp_path, job, env_extra=None, stop_after_s=None):
    fake = tmp_path / "fakebin"
    fake.mkdir()
    for name, body in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (fake / name).write_text(body)
        (fake / name).chmod(0o755)
    script = write_sbatch(job)
    log = tmp_path / "calls.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RAY_"))}
    env.update(PATH=f"{fake}:{env['PATH']}", FAKE_LOG=str(log), SLURM_JOB_ID="42",
               SLURM_JOB_NODELIST="gpu[01-08]", SLURM_CPUS_ON_NODE="64", **(env_extra or {}))
    proc = subprocess.Popen(["bash", str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    if stop_after_s is not None:
        deadline = time.monotonic() + 30
        while "megaflow.trainer.main" not in (log.read_text() if log.exists() else ""):
            assert time.monotonic() < deadline, "the controller never started"
            time.sleep(0.1)
        time.sleep(stop_after_s)
        proc.send_signal(signal.SIGTERM)  # what scancel does to the batch script
    out, _ = proc.communicate(timeout=120)
    return proc.returncode, out, log.read_text().splitlines()


def test_run_starts_head_then_workers_waits_then_runs_the_controller_and_stops_ray(tmp_path):
    job = job_70b(tmp_path, overrides=("trainer.total_epochs=2",))
    rc, out, calls = run_script(tmp_path, job, {"FAKE_CONTROLLER_RC": "0"})
    assert rc == 0, out
    steps = [c for c in calls if c.startswith("srun")]
    assert len(steps) == 7

    def step(marker):
        (i,) = [i for i, c in enumerate(steps) if marker in c]
        return i, steps[i]

    job_dir = tmp_path / "job"
    log_dir = job_dir / "logs" / "42"
    py = os.sys.executable
    common = "--num-cpus 64 --num-gpus 8 --temp-dir /tmp/megaflow-ray-42"
    i_mkdir, mkdir = step("mkdir -p")
    i_ip, ip = step("megaflow.launch.node ip")
    i_head, head = step("megaflow.launch.node head")
    i_port, port = step("wait_for_port")
    i_workers, workers = step("megaflow.launch.node worker")
    i_wait, wait = step("megaflow.launch.wait")
    i_ctrl, ctrl = step("megaflow.trainer.main")
    # Foreground steps run in order; the head starts (in the background) once its IP is known, the
    # workers only after the head's port answered. (Background steps may log after later ones.)
    assert i_mkdir < i_ip < i_port < i_wait < i_ctrl and i_ip < i_head and i_port < i_workers
    assert mkdir == "srun --overlap --ntasks-per-node=1 --nodes=8 --ntasks=8 mkdir -p /tmp/megaflow-ray-42"
    assert ip == f"srun --overlap --nodes=1 --ntasks=1 --nodelist=gpu01 {py} -m megaflow.launch.node ip"
    assert head == (f"srun --overlap --nodes=1 --ntasks=1 --nodelist=gpu01 --cpus-per-task=64 "
                    f"--output={log_dir}/ray-head.log {py} -m megaflow.launch.node head "
                    f"{common} --port 6379 --ray-client-server-port 10001 --")
    assert port.endswith("10.0.0.1 6379 180")
    assert workers == (f"srun --overlap --nodes=7 --ntasks=7 --ntasks-per-node=1 --exclude=gpu01 "
                       f"--cpus-per-task=64 --output={log_dir}/ray-worker-%N.log {py} -m "
                       f"megaflow.launch.node worker --address 10.0.0.1:6379 {common} --")
    out_dir = f"trainer.output_dir={job_dir / 'outputs'}"
    assert wait == (f"srun --overlap --nodes=1 --ntasks=1 --nodelist=gpu01 {py} -m megaflow.launch.wait "
                    f"--recipe llama70b_ppo --address 10.0.0.1:6379 --timeout 300 --hint see the Ray logs in "
                    f"{log_dir} (ray-head.log, ray-worker-<node>.log) -- {out_dir} trainer.total_epochs=2")
    assert ctrl == (f"srun --overlap --nodes=1 --ntasks=1 --nodelist=gpu01 {py} -m megaflow.trainer.main "
                    f"--recipe llama70b_ppo {out_dir} trainer.total_epochs=2 ray.address=10.0.0.1:6379")
    assert sorted(calls[7:]) == ["TERM ray-head", "TERM ray-worker"]  # Ray stopped on every node
    assert "controller output" in (log_dir / "controller.log").read_text()
    token = log_dir / "ray_auth_token"
    assert token.stat().st_mode & 0o077 == 0 and len(token.read_text()) == 64
    assert token.read_text() not in out
    assert "job finished with exit status 0" in out


def test_run_propagates_controller_failure_and_still_stops_ray(tmp_path):
    rc, out, calls = run_script(tmp_path, job_70b(tmp_path), {"FAKE_CONTROLLER_RC": "3"})
    assert rc == 3
    assert sorted(c for c in calls if c.startswith("TERM")) == ["TERM ray-head", "TERM ray-worker"]
    assert "controller exited with status 3" in out


def test_run_stops_before_the_controller_when_resources_are_missing(tmp_path):
    rc, out, calls = run_script(tmp_path, job_70b(tmp_path), {"FAKE_WAIT_RC": "2"})
    assert rc == 2
    assert not any("megaflow.trainer.main" in c for c in calls)
    assert sorted(c for c in calls if c.startswith("TERM")) == ["TERM ray-head", "TERM ray-worker"]
    assert "the Ray cluster did not offer the recipe's resources" in out


def test_sigterm_stops_the_controller_and_ray_on_every_node(tmp_path):
    start = time.monotonic()
    rc, out, calls = run_script(tmp_path, job_70b(tmp_path), {"FAKE_CONTROLLER_S": "600"}, stop_after_s=0.5)
    assert time.monotonic() - start < 60
    assert rc == 143
    assert sorted(c for c in calls if c.startswith("TERM")) == ["TERM controller", "TERM ray-head", "TERM ray-worker"]
    assert "received SIGTERM (scancel or time limit)" in out


def test_custom_command_and_container(tmp_path):
    job = SlurmJob(recipe="tiny_arith_grpo", job_dir=tmp_path / "j", image="/shared/megaflow-cpu.sqsh",
                   container_mounts=("/data:/data",), command=("python", "-c", "import ray; ray.init()"))
    text = render_sbatch(job)
    _, controller, _ = settings(text, tmp_path)
    assert controller == ["python", "-c", "import ray; ray.init()"]
    assert "CONTROLLER_TAKES_ADDRESS=false" in text and "PYTHON=python" in text and "WORKDIR=/opt/megaflow" in text
    assert "CONTAINER_IMAGE=/shared/megaflow-cpu.sqsh" in text and "CONTAINER_MOUNTS=/data:/data" in text
    assert "--container-image=\"$CONTAINER_IMAGE\"" in text


@pytest.mark.parametrize("kw, match", [
    ({"nodes": 4}, r"--nodes=4, but recipe 'llama70b_ppo' needs 8 nodes, each with 8 GPUs and 64 CPUs"),
    ({"gpus_per_node": 4}, r"--gpus-per-node=4, but recipe 'llama70b_ppo' needs 8 GPUs on a node"),
    ({"cpus_per_node": 32}, r"--cpus-per-node=32, but recipe 'llama70b_ppo' needs 64 CPUs on a node"),
    ({"time": "two days"}, r"--time='two days' is not a Slurm time limit"),
    ({"ray_port": 80}, r"--ray-port=80: use a port in 1024..65535"),
    ({"sbatch_args": ("qos=high",)}, r"--sbatch-arg 'qos=high': expected one long sbatch option"),
    ({"nodes": 0}, r"--nodes must be a positive int, got 0"),
])
def test_impossible_jobs_are_refused_before_submission(tmp_path, kw, match):
    with pytest.raises(ValueError, match=match):
        render_sbatch(job_70b(tmp_path, **kw))


def test_more_nodes_than_needed_is_a_warning(tmp_path):
    required = launch_requirements(load_run("llama70b_ppo"))
    warnings = check_job(job_70b(tmp_path, nodes=9), required)
    assert warnings == ["--nodes=9: the recipe's pools use only 8; the other nodes stay idle"]
    assert "--nodes=9" in directives(render_sbatch(job_70b(tmp_path, nodes=9)))


def test_command_line(tmp_path, capsys):
    job_dir = tmp_path / "cli"
    assert slurm_main(["--recipe", "llama70b_ppo", "--job-dir", str(job_dir), "--partition", "gpu",
                       "--time", "1:00:00", "trainer.total_epochs=2"]) == 0
    out = capsys.readouterr().out
    assert "recipe 'llama70b_ppo' needs 8 nodes, each with 8 GPUs and 64 CPUs" in out
    script = job_dir / "megaflow-llama70b_ppo.sbatch"
    assert f"wrote {script}" in out and os.access(script, os.X_OK)
    assert slurm_main(["--recipe", "llama70b_ppo", "--job-dir", str(job_dir), "--nodes", "2"]) == 2
    assert "--nodes=2, but recipe 'llama70b_ppo' needs 8 nodes" in capsys.readouterr().err
    assert slurm_main(["--recipe", "llama70b_ppo", "--job-dir", str(job_dir), "actor.tp=3"]) == 2
    assert "actor.tp" in capsys.readouterr().err
