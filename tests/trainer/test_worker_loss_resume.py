"""A worker process killed during the tiny run: the controller exits naming role and rank,
and ``trainer.resume=auto`` continues from the last complete checkpoint."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

REPO = Path(__file__).resolve().parents[2]


def _cmd(out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "megaflow.trainer.main", "--recipe", "tiny_arith_grpo",
            f"trainer.output_dir={out}", "trainer.experiment_name=killed", "trainer.total_steps=4",
            "trainer.save_freq=1", "trainer.test_freq=0", "trainer.logger=[jsonl]", *extra]


def _steps(metrics: Path) -> list[int]:
    if not metrics.exists():
        return []
    return [json.loads(line)["step"] for line in metrics.read_text().splitlines() if line.strip()]


def _worker_pids(driver_pid: int) -> list[int]:
    """Ray worker processes hosting megaflow ranks started by this driver's local Ray."""
    pids = []
    for child in psutil.Process(driver_pid).children(recursive=True):
        try:
            parent = child.parent()
            # the rank's Ray actor process (started by the raylet), not a helper it forked
            if "WorkerHost" in " ".join(child.cmdline()) and parent is not None and "raylet" in parent.name():
                pids.append(child.pid)
        except psutil.Error:
            continue
    return sorted(pids)


def test_killed_worker_named_then_resume(tmp_path):
    run_dir = tmp_path / "megaflow" / "killed"
    env = dict(os.environ, RAY_ADDRESS="local")
    proc = subprocess.Popen(_cmd(tmp_path), cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.monotonic() + 900
    while 2 not in _steps(run_dir / "metrics.jsonl"):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the run did not reach step 2"
        time.sleep(1)
    victims = _worker_pids(proc.pid)
    assert len(victims) == 2, "expected the two actor ranks under the driver"
    helpers = [p for p in psutil.Process(proc.pid).children(recursive=True) if p.pid not in victims]
    victim = victims[-1]  # not necessarily rank 0: the message must name the dead rank, not a survivor
    os.kill(victim, signal.SIGKILL)
    killed_at = time.monotonic()
    _, stderr = proc.communicate(timeout=600)
    assert time.monotonic() - killed_at < 60
    assert proc.returncode == 3, stderr[-3000:]
    message = stderr[stderr.rfind("megaflow: "):]
    assert "role 'actor' rank" in message and f"pid {victim}) died" in message and "resume=auto" in message, message
    assert "Traceback" not in stderr[-2000:]
    _, alive = psutil.wait_procs(helpers, timeout=20)  # Ray's helper processes stop with the controller
    assert not alive, [(p.pid, p.name()) for p in alive]
    done = _steps(run_dir / "metrics.jsonl")
    assert 4 not in done

    resumed = subprocess.run(_cmd(tmp_path, "trainer.resume=auto"), cwd=REPO, env=env, capture_output=True,
                             text=True, timeout=900)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout
    assert sorted(set(_steps(run_dir / "metrics.jsonl"))) == [1, 2, 3, 4]
    assert (run_dir / "checkpoints" / "global_step_4" / "COMPLETE").is_file()
