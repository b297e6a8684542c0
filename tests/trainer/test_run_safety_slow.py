"""Whole runs of the tiny recipe (issue 37, issue 36 item 8): two runs with one name started
together, SIGTERM, and ``kill -9`` of the controller. Each lists the run's processes and its
temporary paths before and after."""
from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from megaflow.trainer.checkpoint import CheckpointManager

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

REPO = Path(__file__).resolve().parents[2]


def _start(tmp_path: Path, name: str, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "megaflow.trainer.main", "--recipe", "tiny_arith_grpo",
           f"trainer.output_dir={tmp_path}", f"trainer.experiment_name={name}", "trainer.save_freq=1",
           "trainer.test_freq=0", "trainer.logger=[jsonl]", *extra]
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})


def _temp_paths(pid: int) -> list[str]:
    """The controller's temporary directories (megaflow.launch.watchdog.temp_prefix)."""
    return glob.glob(os.path.join(tempfile.gettempdir(), f"megaflow-*-{pid}-*"))


def _wait_for_step_1(proc: subprocess.Popen, run_dir: Path) -> None:
    deadline = time.monotonic() + 900
    while not (run_dir / "checkpoints" / "global_step_1" / "COMPLETE").is_file():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the run did not save step 1"
        time.sleep(0.5)


def _run_processes(proc: subprocess.Popen) -> list[psutil.Process]:
    """Every process the controller started (Ray's gcs, raylet, agents, workers, engines, the watchdog)."""
    procs = psutil.Process(proc.pid).children(recursive=True)
    names = " ".join(p.name() + " " + " ".join(_cmdline(p)[:1]) for p in procs)
    assert "raylet" in names and "watchdog" in " ".join(" ".join(_cmdline(p)) for p in procs), names
    return procs


def _cmdline(process: psutil.Process) -> list[str]:
    """``process``'s command line; empty for one that has exited (a zombie not yet reaped by its
    parent, or gone) since the children were listed."""
    try:
        return process.cmdline()
    except (psutil.ZombieProcess, psutil.NoSuchProcess):
        return []


def _verified_checkpoints(run_dir: Path) -> list[int]:
    manager = CheckpointManager(run_dir / "checkpoints")
    for _, path in manager.complete_checkpoints():
        manager.verify(path)
    return [step for step, _ in manager.complete_checkpoints()]


def test_two_runs_with_one_name_started_together(tmp_path):
    runs = [_start(tmp_path, "same", "trainer.total_steps=2") for _ in range(2)]
    results = [(p.pid, *p.communicate(timeout=1500), p.returncode) for p in runs]
    codes = sorted(r[3] for r in results)
    assert codes == [0, 2], [r[2][-2000:] for r in results]
    winner = next(r for r in results if r[3] == 0)
    loser = next(r for r in results if r[3] == 2)
    assert f"pid {winner[0]}" in loser[2] and "is in use by another run" in loser[2], loser[2][-2000:]
    assert "Traceback" not in loser[2] and "Traceback" not in winner[2]
    run_dir = tmp_path / "megaflow" / "same"
    assert _verified_checkpoints(run_dir) == [1, 2]
    assert not [p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(".")]
    assert _temp_paths(winner[0]) == [] and _temp_paths(loser[0]) == []


def test_sigterm_stops_cleanly_with_exit_143(tmp_path):
    run_dir = tmp_path / "megaflow" / "term"
    proc = _start(tmp_path, "term", "trainer.total_steps=50")
    _wait_for_step_1(proc, run_dir)
    helpers = _run_processes(proc)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 143, stderr[-3000:]
    lines = [ln for ln in stderr.splitlines() if ln.startswith("megaflow: ")]
    assert len(lines) == 1 and lines[0].startswith("megaflow: stopped by SIGTERM after step "), stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    steps = _verified_checkpoints(run_dir)
    assert steps and f"global_step_{steps[-1]}" in lines[0]
    _, alive = psutil.wait_procs(helpers, timeout=30)
    assert not alive, [(p.pid, p.name()) for p in alive]
    assert _temp_paths(proc.pid) == []


def test_kill_9_of_the_controller_leaves_no_process(tmp_path):
    run_dir = tmp_path / "megaflow" / "killed"
    proc = _start(tmp_path, "killed", "trainer.total_steps=50")
    _wait_for_step_1(proc, run_dir)
    helpers = _run_processes(proc)
    names = {p.name() for p in helpers}
    proc.kill()
    proc.communicate(timeout=60)
    _, alive = psutil.wait_procs(helpers, timeout=30)
    assert not alive, ([(p.pid, p.name()) for p in alive], names)
    assert _temp_paths(proc.pid) == []
    assert _verified_checkpoints(run_dir)[0] == 1
